"""The server's failure paths, on real `kvserve serve` processes and the tiny model: an engine
that fails (a test-built engine whose step raises: tests/support/faults.py), caps on what a request may ask for,
absurd prompts refused before tokenizing, errors inside an event stream, and requests a
shutdown ends before they start."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from kvserve.server.api import build_app
from kvserve.server.lifecycle import SSE_DONE, ended_properly
from tests.server.conftest import ServerProcess, metrics
from tests.support.faults import FailingEngine

COMPLETIONS = "/v1/completions"
FAULTY_SERVER = "tests.support.faulty_server"  # `kvserve serve` with a fault in its engines
LONG = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True}


def _events(response: httpx.Response) -> list[str]:
    return [line for line in response.iter_lines() if line.startswith("data: ")]


def test_an_engine_failure_ends_every_request_and_the_process(tiny_llama, tmp_path):
    # step 200 comes after both requests are in (the stream is read before the other is sent),
    # however slow the machine, and before either is done (LONG runs 400 steps)
    server = ServerProcess(tiny_llama, tmp_path / "serve.log", "--kv-cache-memory", "4MiB", "--fail-after-steps", "200",
                           module=FAULTY_SERVER)  # fmt: skip
    try:
        whole: dict = {}

        def non_streaming():
            whole["response"] = httpx.post(f"{server.url}{COMPLETIONS}", json=LONG, timeout=30)

        waiter = threading.Thread(target=non_streaming)
        with httpx.stream("POST", f"{server.url}{COMPLETIONS}", json={**LONG, "stream": True}, timeout=30) as response:
            assert response.status_code == 200
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            events = [next(lines)]  # the stream runs; the whole-answer request joins it (or finds the engine dead)
            waiter.start()
            events += list(lines)
        waiter.join(30)
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "service_unavailable" and "injected engine failure" in error["message"]
        assert len(events) > 2  # it had streamed tokens before the failure
        assert whole["response"].status_code == 503, whole["response"].text
        assert server.proc.wait(timeout=30) == 1, server.log()
        assert "the engine failed" in server.log()
    finally:
        server.kill()


def test_restart_engine_brings_a_failed_engine_back_then_stops_a_crash_loop(tiny_llama, tmp_path):
    # every engine of this process fails at its 11th step: the first failure restarts it,
    # the second, within a minute of that restart, ends the process with status 1
    server = ServerProcess(
        tiny_llama, tmp_path / "serve.log", "--kv-cache-memory", "4MiB", "--restart-engine", "--fail-after-steps", "10",
        module=FAULTY_SERVER,
    )
    try:
        failed = httpx.post(f"{server.url}{COMPLETIONS}", json=LONG, timeout=30)
        assert failed.status_code == 503, failed.text
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        assert "engine restarted" in server.log()
        short = httpx.post(f"{server.url}{COMPLETIONS}", json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True}, timeout=30)
        assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 3, short.text
        assert httpx.post(f"{server.url}{COMPLETIONS}", json=LONG, timeout=30).status_code == 503
        assert server.proc.wait(timeout=30) == 1, server.log()
        assert "failed again within 60s of a restart" in server.log()
    finally:
        server.kill()


def test_health_and_new_requests_answer_503_once_the_engine_is_dead(tiny_llama):
    config = EngineConfig(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory="4MiB")
    engine = AsyncLLMEngine(engine=FailingEngine(config, fail_after_steps=3))
    try:
        with TestClient(build_app(engine)) as client:
            assert client.get("/health").status_code == 200
            failed = client.post(COMPLETIONS, json=LONG)
            assert failed.status_code == 503 and failed.json()["error"]["type"] == "service_unavailable"
            assert client.get("/health").status_code == 503
            again = client.post(COMPLETIONS, json={**LONG, "stream": True})
            assert again.status_code == 503
    finally:
        engine.shutdown()


def _stops(k: int) -> list[str]:
    return [f"s{i}" for i in range(k)]


def _bias(k: int) -> dict[str, float]:
    return {str(i): 1.0 for i in range(k)}


@pytest.mark.parametrize(
    "param, over, at_cap",
    [
        ("stop", _stops(MAX_STOP_STRINGS + 1), _stops(MAX_STOP_STRINGS)),
        ("stop", "x" * (MAX_STOP_STRING_CHARS + 1), "x" * MAX_STOP_STRING_CHARS),
        ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1)), None),  # the tiny vocabulary is smaller than the cap
        ("logit_bias", _bias(MAX_LOGIT_BIAS + 1), _bias(MAX_LOGIT_BIAS)),
    ],
    ids=["stop strings", "stop string length", "stop_token_ids", "logit_bias"],
)
def test_caps_on_what_is_checked_per_token(http, param, over, at_cap):
    response = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1, param: over})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and "at most" in response.json()["error"]["message"]
    if at_cap is not None:
        assert http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1, param: at_cap}).status_code == 200


def test_message_count_is_capped(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}] * 2049, max_tokens=1)
    assert err.value.body["param"] == "messages"


def test_an_absurd_text_prompt_is_refused_before_tokenizing(http):
    response = http.post(COMPLETIONS, json={"prompt": "a" * 60_000, "max_tokens": 1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "at least" in error["message"]


def test_an_unexpected_error_in_an_event_stream_ends_it_with_an_error_and_done():
    async def broken():
        yield "data: {}\n\n"
        raise RuntimeError("a bug")

    async def collect():
        return [event async for event in ended_properly(broken())]

    events = asyncio.run(collect())
    assert events[0] == "data: {}\n\n" and events[-1] == SSE_DONE
    assert json.loads(events[1][6:])["error"]["type"] == "internal_error"


def test_shutdown_answers_503_to_requests_that_had_not_started(tiny_llama, tmp_path):
    server = ServerProcess(tiny_llama, tmp_path / "serve.log", "--max-num-seqs", "1", "--drain-timeout", "0", "--kv-cache-memory", "4MiB")
    try:
        url = server.url
        results: dict = {}

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                async with c.stream("POST", COMPLETIONS, json={**LONG, "stream": True}) as running:
                    lines = running.aiter_lines()
                    await anext(lines)  # it runs, holding the only slot
                    queued = [asyncio.ensure_future(c.post(COMPLETIONS, json={**LONG, "stream": s})) for s in (False, True)]
                    while (await asyncio.to_thread(metrics, url))["kvserve:num_requests_waiting"] < 2:
                        await asyncio.sleep(0.02)
                    server.proc.send_signal(signal.SIGTERM)
                    results["queued"] = await asyncio.gather(*queued)
                    results["running"] = [line async for line in lines if line.startswith("data: ")]

        asyncio.run(main())
        for response in results["queued"]:
            assert response.status_code == 503, response.text
            assert "not started" in response.json()["error"]["message"]
        assert results["running"][-1] == "data: [DONE]" and '"finish_reason":"abort"' in results["running"][-2]
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.kill()
