"""Start-up report, and SIGTERM/SIGINT: stop accepting, finish (or abort) what is in flight, exit 0."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from tests.server.conftest import ServerProcess

LONG = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}


def _stream_in_background(url: str) -> tuple[threading.Event, list[str]]:
    started, lines = threading.Event(), []

    def run():
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=60) as response:
                for line in response.iter_lines():
                    lines.append(line)
                    started.set()
        except httpx.HTTPError as exc:
            lines.append(f"error: {exc!r}")
        started.set()

    threading.Thread(target=run, daemon=True).start()
    return started, lines


@pytest.mark.parametrize(
    "sig, drain_s, finish",
    [(signal.SIGTERM, "30", '"finish_reason":"length"'), (signal.SIGINT, "0", '"finish_reason":"abort"')],
    ids=["SIGTERM, time to drain", "SIGINT, no time to drain"],
)
def test_signal_drains_then_exits_cleanly(tiny_llama, tmp_path, sig, drain_s, finish):
    server = ServerProcess(tiny_llama, tmp_path / "serve.log", "--drain-timeout", drain_s, "--kv-cache-memory", "4MiB")
    log = server.log()
    assert "c_kv" in log and "blocks" in log and "dtype float32" in log  # the start-up report
    assert f"serving {server.model_name} at http://127.0.0.1:" in log

    started, lines = _stream_in_background(server.url)
    assert started.wait(30)
    assert server.terminate(sig) == 0, server.log()
    assert "shutting down" in server.log() and "kvserve: stopped" in server.log()
    # with time to drain, the stream ran to its end; without, it was ended, not dropped
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and finish in events[-2], lines[-3:]
