"""AsyncLLMEngine's failure paths, on the real engine and the tiny model: bounded delivery to a
consumer that stops reading, engine death (a test-built engine whose step raises), requests
a shutdown ends before they start, adds that race the engine thread's end, and admission
counted in samples and prompt tokens."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, Stop
from kvserve.errors import EngineOverloadedError
from kvserve.sampling_params import SamplingParams
from tests.support.faults import FailingEngine


def _config(tiny_llama, **kw) -> EngineConfig:
    return EngineConfig(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4, **kw)


def _engine(tiny_llama, **kw) -> AsyncLLMEngine:
    return AsyncLLMEngine(_config(tiny_llama, **kw))


def _params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = _engine(tiny_llama)
    yield eng
    eng.shutdown()


def test_a_consumer_that_never_reads_holds_one_merged_output(engine):
    async def main():
        params = _params(48, logprobs=2)
        ids = engine.prepare_prompt("hello world", params)
        steps_before = engine.engine.counters.steps
        stream = engine.generate(ids, params, "lazy")
        await _until(lambda: engine.num_in_flight() == 0)  # ran to its end, unread
        assert engine.engine.counters.steps - steps_before >= 48  # one output per step was produced
        outs = [o async for o in stream]
        return outs

    (out,) = asyncio.run(main())  # … and held merged into one
    c = out.outputs[0]
    assert out.finished and c.finish_reason == "length"
    assert len(c.delta_token_ids) == 48 and c.delta_token_ids == c.token_ids
    assert len(c.delta_logprobs) == 48 and c.delta_logprobs == c.logprobs
    assert c.delta_text == c.text and out.num_generated_tokens == 48


def test_running_outputs_carry_deltas_not_copies(engine):
    async def main():
        params = _params(12)
        ids = engine.prepare_prompt("The quick brown fox", params)
        return [o async for o in engine.generate(ids, params, "reader")]

    outs = asyncio.run(main())
    *running, final = outs
    assert running and all(o.outputs[0].token_ids == [] for o in running)  # no per-step copy of the output so far
    deltas = [t for o in outs for t in o.outputs[0].delta_token_ids]
    assert deltas == final.outputs[0].token_ids and len(deltas) == 12
    assert "".join(o.outputs[0].delta_text for o in outs) == final.outputs[0].text


def test_a_failed_step_kills_the_engine_and_fails_every_stream(tiny_llama):
    eng = AsyncLLMEngine(engine=FailingEngine(_config(tiny_llama)))
    dead = threading.Event()
    eng.on_dead = lambda exc: dead.set()
    try:

        async def main():
            params = _params(200)
            ids = eng.prepare_prompt("hello", params)
            streams = [eng.generate(ids, params, f"r{i}") for i in range(3)]
            await streams[0].__anext__()
            eng.engine.fail_after_steps = eng.engine.steps + 2  # a later step raises
            for s in streams:
                with pytest.raises(EngineDeadError, match="injected engine failure"):
                    async for _ in s:
                        pass
            assert not eng.is_running
            with pytest.raises(EngineDeadError, match="the engine failed"):
                eng.generate(ids, params, "after")
            with pytest.raises(EngineDeadError):
                eng.check_admission(1)

        asyncio.run(main())
        assert dead.wait(5) and isinstance(eng.dead_error, RuntimeError)
    finally:
        eng.shutdown()  # returns at once: the thread is gone


def test_shutdown_fails_requests_that_had_not_started(tiny_llama):
    eng = _engine(tiny_llama, max_num_seqs=1)

    async def main():
        params = _params(400)
        ids = eng.prepare_prompt("hello", params)
        running = eng.generate(ids, params, "running")
        await running.__anext__()
        queued = eng.generate(ids, params, "queued")  # the only slot is taken: never scheduled
        await asyncio.to_thread(eng.shutdown, 0.0)
        with pytest.raises(EngineDeadError, match="not started"):
            await queued.__anext__()
        last = [o async for o in running][-1]
        assert last.outputs[0].finish_reason == "abort"  # it had started: ended, not failed

    asyncio.run(main())


def test_an_add_racing_the_engine_thread_end_never_hangs(tiny_llama):
    """The add either is refused or gets its error: the thread fails adds it never applied."""
    outcomes = set()
    for i in range(12):
        eng = _engine(tiny_llama)

        async def main():
            params = _params(4)
            ids = eng.prepare_prompt("hello", params)
            eng._lock.acquire()
            eng._submit(Stop())
            await _until(lambda: eng._stopped)  # the thread waits for the lock to close
            eng._lock.release()
            if i % 2:
                await asyncio.sleep(0)  # now one order, now the other
            try:
                stream = eng.generate(ids, params, "late")
            except EngineDeadError:
                return "refused"
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(stream.__anext__(), timeout=5)
            return "failed"

        outcomes.add(asyncio.run(main()))
        eng.shutdown()
        assert not eng._streams and not eng._commands
    assert outcomes <= {"refused", "failed"}


def test_admission_counts_samples_and_prompt_tokens(tiny_llama):
    eng = _engine(tiny_llama, max_num_seqs=1, max_waiting_requests=3, max_waiting_tokens=40)

    async def main():
        params = _params(300)
        ids = eng.prepare_prompt("hello", params)
        running = eng.generate(ids, params, "running")
        await running.__anext__()
        two = eng.generate(ids, SamplingParams(n=2, temperature=0, max_tokens=300, ignore_eos=True), "two")
        with pytest.raises(EngineOverloadedError, match="3 samples"):
            eng.check_admission(2)  # 2 waiting + 2 > 3, refused before tokenizing
        eng.check_admission(1)
        long_ids = list(range(1, 40))  # 39 more prompt tokens: over 40 with those waiting
        with pytest.raises(EngineOverloadedError, match="prompt tokens"):
            eng.generate(long_ids, params, "long")
        one = eng.generate(ids, params, "one")  # fits both bounds
        for s in (running, two, one):
            s.close()
        await _until(lambda: eng.num_in_flight() == 0)
        assert eng._waiting_samples == 0 and eng._waiting_tokens == 0

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()
