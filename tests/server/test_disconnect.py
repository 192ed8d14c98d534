"""A client that leaves aborts its request within a step, and its KV blocks come back."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import metrics, wait_until_idle

LONG = {"prompt": "hello", "max_tokens": 240, "ignore_eos": True}  # the tiny server's max_model_len is 256
ABORTS = "kvserve:request_success_total{finished_reason=abort}"


def test_stream_disconnect_aborts_and_frees(server, http):
    before = metrics(server.url)
    with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # it is running
    # leaving the `with` closed the connection mid-stream
    after = wait_until_idle(server.url)
    assert after[ABORTS] == before[ABORTS] + 1
    assert after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] < LONG["max_tokens"]


def test_whole_answer_disconnect_aborts_and_frees(server, http):
    before = metrics(server.url)
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=LONG, timeout=0.05)
    after = wait_until_idle(server.url)
    assert after[ABORTS] == before[ABORTS] + 1
    assert after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] < LONG["max_tokens"]
