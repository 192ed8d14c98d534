"""`kvserve bench serve` against a real `kvserve serve` process on the tiny model."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from tests.server.conftest import ServerProcess

API_KEY = "bench-key"


@pytest.fixture(scope="module")
def kvserve_server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("bench-server") / "serve.log"
    proc = ServerProcess(tiny_llama, log, "--max-model-len", "128", "--kv-cache-memory", "4MiB", "--api-key", API_KEY)
    yield proc
    proc.terminate()


def test_exact_lengths_and_usage_from_kvserve(kvserve_server, tmp_path):
    out = tmp_path / "serve.json"
    vocab = 300  # below the tiny tokenizer's vocabulary
    assert main(["bench", "serve", "--url", kvserve_server.url, "--api-key", API_KEY, "--num-prompts", "4",
                 "--input-len", "8", "--output-len", "6", "--vocab-size", str(vocab), "--request-rate", "inf",
                 "--no-progress", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["args"]["api_key"] == "<redacted>"
    r = data["results"]
    assert r["model"] == kvserve_server.model_name
    (row,) = r["sweep"]
    assert row["completed"] == 4 and row["failed"] == 0 and row["usage_reported"]
    assert row["prompt_tokens"] == 4 * 8 and row["output_tokens"] == 4 * 6  # ignore_eos honoured: exact lengths
    assert row["ttft_ms"]["count"] == 4 and row["tpot_ms"]["count"] == 4
