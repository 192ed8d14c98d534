"""The engine thread serves many asyncio streams at once; closing a stream aborts its request."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.errors import EngineOverloadedError
from kvserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = AsyncLLMEngine(EngineConfig(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4))
    yield eng
    eng.shutdown()


def test_many_streams_progress_together(engine):
    async def one(i):
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        ids = engine.prepare_prompt(f"hello world {i}", params)
        outs = [o async for o in engine.generate(ids, params, f"r{i}")]
        return outs

    async def main():
        return await asyncio.gather(*(one(i) for i in range(16)))

    results = asyncio.run(main())
    for outs in results:
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
        assert sum(len(o.outputs[0].delta_token_ids) for o in outs) == 8
    kv = engine.engine.kv_cache
    assert kv.num_free_blocks() == kv.num_blocks


def test_closing_a_stream_aborts_and_frees(engine):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        ids = engine.prepare_prompt("The quick brown fox", params)
        stream = engine.generate(ids, params, "to-abort")
        await stream.__anext__()
        stream.close()  # what the server does for a client that disconnected
        for _ in range(100):
            if engine.engine.num_running == 0 and engine.engine.num_waiting == 0:
                break
            await asyncio.sleep(0.02)

    asyncio.run(main())
    kv = engine.engine.kv_cache
    assert kv.num_free_blocks() == kv.num_blocks
    assert engine.engine.counters.finished["abort"] >= 1


def test_waiting_queue_limit(tiny_llama):
    eng = AsyncLLMEngine(
        EngineConfig(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory="8MiB", max_waiting_requests=1, max_num_seqs=1)
    )
    try:

        async def main():
            params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
            ids = eng.prepare_prompt("hello", params)
            running = eng.generate(ids, params, "q0")
            await running.__anext__()  # admitted: the only running slot is taken
            waiting = eng.generate(ids, params, "q1")
            for _ in range(100):
                if eng.engine.num_waiting == 1:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(EngineOverloadedError, match="waiting queue is full"):
                eng.generate(ids, params, "q2")
            running.close()
            waiting.close()

        asyncio.run(main())
    finally:
        eng.shutdown()
