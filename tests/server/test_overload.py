"""A server with one running slot and a waiting queue of one: the third request gets 429
at once, with a clear message; nothing is dropped silently. Also: no key, no auth."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess, metrics, wait_until_idle

LONG = {"prompt": "hello", "max_tokens": 500, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def small_server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("small-server") / "serve.log"
    proc = ServerProcess(tiny_llama, log, "--max-num-seqs", "1", "--max-waiting-requests", "1", "--kv-cache-memory", "4MiB")
    yield proc
    proc.terminate()


def test_no_api_key_means_open(small_server):
    response = httpx.get(f"{small_server.url}/v1/models")
    assert response.status_code == 200 and response.json()["data"][0]["id"] == small_server.model_name


def test_full_queue_answers_429(small_server):
    url = small_server.url

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json=LONG) as running:
                lines = running.aiter_lines()  # held: a dropped iterator would close the stream
                await lines.__anext__()  # admitted: the one running slot is taken
                # the second waits for the slot; its answer won't start while the first runs
                waiting = asyncio.ensure_future(client.post("/v1/completions", json={**LONG, "stream": False}))
                deadline = time.monotonic() + 10
                while metrics(url)["kvserve:num_requests_waiting"] < 1:
                    assert time.monotonic() < deadline, "the second request never queued"
                    await asyncio.sleep(0.01)
                rejected = await client.post("/v1/completions", json=LONG)
                waiting.cancel()
            return rejected

    rejected = asyncio.run(main())
    assert rejected.status_code == 429
    assert rejected.headers["retry-after"] == "1"
    error = rejected.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "waiting queue is full" in error["message"]
    wait_until_idle(url)  # both others were aborted when their clients left
