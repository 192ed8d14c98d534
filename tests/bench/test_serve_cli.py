"""`kvserve bench serve` against a stand-in OpenAI-compatible server (tests/bench/fake_openai_server.py)."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from tests.bench.fake_openai_server import MODEL_ID, FakeServer, RunningServer, free_port

OUTPUT_LEN = 5


@pytest.fixture
def fake():
    server = FakeServer(token_delay_s=0.005)
    with RunningServer(server.app) as running:
        server.url = running.url
        yield server


def _serve(url: str, *extra: str) -> list[str]:
    return ["bench", "serve", "--url", url, "--num-prompts", "6", "--input-len", "10", "--output-len", str(OUTPUT_LEN),
            "--no-progress", *extra]


def test_sweep_reports_latency_and_throughput(fake, tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    assert main(_serve(fake.url, "--request-rate", "200,inf", "--slo-ttft-ms", "10000", "--json", str(out),
                       "--plot", str(png))) == 0
    r = json.loads(out.read_text())["results"]
    assert r["model"] == MODEL_ID
    assert [row["request_rate"] for row in r["sweep"]] == [200.0, "inf"]
    for row in r["sweep"]:
        assert row["completed"] == 6 and row["failed"] == 0 and row["usage_reported"]
        assert row["output_tokens"] == 6 * OUTPUT_LEN and row["prompt_tokens"] == 60
        assert row["ttft_ms"]["count"] == 6 and row["ttft_ms"]["median"] > 0
        assert row["itl_ms"]["count"] == 6 * (OUTPUT_LEN - 1)  # a gap between each pair of text chunks
        assert row["tpot_ms"]["min"] >= 5.0 * 0.5  # the server spaces tokens 5 ms apart
        assert row["e2e_ms"]["min"] >= row["ttft_ms"]["min"]
        assert row["goodput_req_per_s"] == pytest.approx(row["request_throughput_req_per_s"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the requests asked for exact lengths, greedy, streamed with usage
    payload = fake.payloads[-1]
    assert payload["ignore_eos"] is True and payload["stream"] is True
    assert payload["stream_options"] == {"include_usage": True} and len(payload["prompt"]) == 10


def test_max_concurrency_caps_requests_in_flight(fake):
    assert main(_serve(fake.url, "--request-rate", "inf", "--max-concurrency", "2")) == 0
    assert fake.max_in_flight == 2


def test_tight_slo_gives_zero_goodput(fake, tmp_path):
    out = tmp_path / "serve.json"
    assert main(_serve(fake.url, "--slo-tpot-ms", "0.001", "--json", str(out))) == 0
    row = json.loads(out.read_text())["results"]["sweep"][0]
    assert row["goodput_req_per_s"] == 0 and row["slo_attainment"] == 0


def test_server_rejecting_id_prompts_fails_with_a_hint(tmp_path, capsys):
    server = FakeServer(accept_token_ids=False)
    with RunningServer(server.app) as running:
        assert main(_serve(running.url)) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "HTTP 400" in err and "--prompt-format text" in err
        assert main(_serve(running.url, "--prompt-format", "text")) == 0


def test_unreachable_server_is_one_line(capsys):
    assert main(_serve(f"http://127.0.0.1:{free_port()}")) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "cannot list models" in err


def test_bad_rate_flag(capsys):
    assert main(["bench", "serve", "--request-rate", "0"]) == 1
    assert "--request-rate" in capsys.readouterr().err


def test_text_with_unicode_line_separators_is_one_chunk(tmp_path):
    """U+2028, U+2029 and U+0085 are not line ends in an event stream; JSON leaves them raw."""
    server = FakeServer(token_delay_s=0.001, token_text="a\u2028b\u2029c\x85d{i}")
    out = tmp_path / "serve.json"
    with RunningServer(server.app) as running:
        assert main(_serve(running.url, "--json", str(out))) == 0
    row = json.loads(out.read_text())["results"]["sweep"][0]
    assert row["completed"] == 6 and row["failed"] == 0
    assert row["itl_ms"]["count"] == 6 * (OUTPUT_LEN - 1)


@pytest.mark.parametrize("chunks", [
    ["data: a\r\n\r\ndata: b\n\n"],
    ["data: a\r", "\n\r", "\ndata: b\n", "\n"],  # CRLFs cut between chunks
    ["data: a\r\rdata: b\r\r"],  # lone CRs
    ["data: a\u2028x\n", "\ndata: b"],  # a separator inside a line; the last line unterminated
])
def test_sse_lines_end_at_cr_lf_or_crlf_only(chunks):
    import asyncio

    from kvserve.loadgen.client import sse_lines

    class Response:  # what sse_lines reads of an httpx.Response
        async def aiter_text(self):
            for c in chunks:
                yield c

    async def collect():
        return [line async for line in sse_lines(Response())]

    lines = [line for line in asyncio.run(collect()) if line]
    assert lines in (["data: a", "data: b"], ["data: a\u2028x", "data: b"])
