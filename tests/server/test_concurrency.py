"""Many streams at once: each completes with its exact usage, and the KV pool ends all free."""

from __future__ import annotations

import asyncio
import time

from tests.server.conftest import API_KEY, metrics, wait_until_idle

NUM_CLIENTS = 32


def test_concurrent_streams_complete_and_free_the_pool(server):
    import openai

    before = metrics(server.url)

    async def one(client, i: int):
        max_tokens = 32 + i % 9
        kwargs = dict(model=server.model_name, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
        extra = {"ignore_eos": True}
        if i % 2:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": f"request {i}"}], extra_body=extra, **kwargs
            )
        else:
            stream = await client.completions.create(prompt=f"request number {i}", extra_body=extra, **kwargs)
        chunks, arrivals = [], []
        async for chunk in stream:
            chunks.append(chunk)
            arrivals.append(time.monotonic())
        return max_tokens, chunks, arrivals[0], arrivals[-1]

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS)))

    results = asyncio.run(main())
    for max_tokens, chunks, _, _ in results:
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage.completion_tokens == max_tokens
        assert usage.total_tokens == usage.prompt_tokens + max_tokens
        assert [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason] == ["length"]

    # they ran together, not one after another: many streams were open at once
    most_open = max(sum(first <= t < last for _, _, first, last in results) for _, _, t, _ in results)
    assert most_open >= NUM_CLIENTS // 2

    after = wait_until_idle(server.url)
    assert after["kvserve:kv_cache_usage_perc"] == 0
    generated = sum(r[0] for r in results)
    assert after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] == generated
