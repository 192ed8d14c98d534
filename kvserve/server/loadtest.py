"""N streaming chat clients at once against a running server; prints TTFT and ITL percentiles.

    python -m kvserve.server.loadtest --url http://127.0.0.1:8000 --clients 64 --max-tokens 64

Every client sends one request at the same moment, with its own prompt and
`ignore_eos`, so each streams exactly --max-tokens tokens. TTFT is measured from sending
the request to the first chunk with content; ITL is the gap between content chunks
(as vLLM's serving benchmark does). The server's own histograms (/metrics) are
printed beside them: they exclude HTTP and client time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

_TOPICS = ["the sea", "a lighthouse", "autumn", "a robot", "mountains", "a library", "the moon", "a train"]


async def _one(client: httpx.AsyncClient, model: str, i: int, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Write a short story about {_TOPICS[i % len(_TOPICS)]} (#{i})."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    arrivals, usage = [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c["delta"].get("content") for c in chunk["choices"]):
                arrivals.append(time.perf_counter())
    return {"ttft": arrivals[0] - start, "itl": np.diff(arrivals).tolist(), "e2e": time.perf_counter() - start, "usage": usage}


def _server_means(url: str, headers: dict) -> dict[str, tuple[float, float]]:
    """(sum, count) of the server's latency histograms."""
    text = httpx.get(f"{url}/metrics", headers=headers).text
    out = {}
    for family in text_string_to_metric_families(text):
        if family.type == "histogram":
            total = {s.name.rsplit("_", 1)[-1]: s.value for s in family.samples if s.name.endswith(("_sum", "_count"))}
            out[family.name] = (total.get("sum", 0.0), total.get("count", 0.0))
    return out


def _pcts(values: list[float]) -> str:
    p50, p90, p99 = np.percentile(values, [50, 90, 99]) * 1000
    return f"p50 {p50:7.1f} ms   p90 {p90:7.1f} ms   p99 {p99:7.1f} ms   (n={len(values)})"


async def _run(args) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await _one(client, model, 0, 4)  # warm-up, not counted
        before = _server_means(args.url, headers)
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(client, model, i, args.max_tokens) for i in range(args.clients)))
        wall = time.perf_counter() - start
        after = _server_means(args.url, headers)

    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    exact = all(r["usage"]["completion_tokens"] == args.max_tokens for r in results)
    print(f"model {model}: {args.clients} concurrent streams x {args.max_tokens} tokens, all exact: {exact}")
    print(f"wall {wall:.2f} s, output {tokens / wall:.1f} tok/s")
    print(f"TTFT  {_pcts([r['ttft'] for r in results])}")
    print(f"ITL   {_pcts([gap for r in results for gap in r['itl']])}")
    print(f"E2E   {_pcts([r['e2e'] for r in results])}")
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_queue_time_seconds"):
        key = f"kvserve:{name}"
        if key in after:
            total = after[key][0] - before.get(key, (0, 0))[0]
            count = after[key][1] - before.get(key, (0, 0))[1]
            if count:
                print(f"server {name}: mean {1000 * total / count:.1f} ms over {count:.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--timeout", type=float, default=600.0)
    asyncio.run(_run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
