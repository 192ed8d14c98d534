"""Drive an OpenAI-compatible server at one request rate and turn the records into figures.

Requests leave at gamma-distributed times (`arrivals.py`); with `max_concurrency` a
request that is due waits for a free slot before it is sent, so the cap bounds the
server's load and TTFT still starts at the real send. The run's duration is from the
first send to the last response, so throughput includes the drain at the end.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from tqdm import tqdm

from kvserve.loadgen.arrivals import interarrival_gaps_s, send_times_s
from kvserve.loadgen.client import RequestRecord, completion_payload, send_completion
from kvserve.loadgen.stats import SLO, goodput_req_per_s, summarize


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer token a server behind `--api-key` wants on every request, /v1/models included."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _run(base: str, model: str, prompts: list, prompt_lens: list[int], output_lens: list[int],
               rate: float, burstiness: float, max_concurrency: int | None, seed: int,
               timeout_s: float, progress: bool, desc: str, api_key: str | None) -> tuple[list[RequestRecord], float]:
    url = base + "/completions"
    offsets = send_times_s(interarrival_gaps_s(len(prompts), rate, burstiness, seed))
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # no pool limit of our own: a request must not queue inside the client unseen
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    bar = tqdm(total=len(prompts), desc=desc, unit="req", disable=not progress, leave=False)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, headers=auth_headers(api_key)) as client:
        async def one(i: int) -> RequestRecord:
            payload = completion_payload(model, prompts[i], output_lens[i])
            if slots is None:
                record = await send_completion(client, url, payload, prompt_lens[i])
            else:
                async with slots:
                    record = await send_completion(client, url, payload, prompt_lens[i])
            bar.update(1)
            return record

        start = time.perf_counter()
        tasks = []
        for i, offset in enumerate(offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        records = await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - start
    bar.close()
    return list(records), duration_s


def run_at_rate(base: str, model: str, prompts: list, prompt_lens: list[int], output_lens: list[int], *,
                rate: float, burstiness: float, max_concurrency: int | None, seed: int, timeout_s: float,
                progress: bool, api_key: str | None = None) -> tuple[list[RequestRecord], float]:
    desc = f"rate {rate:g} req/s" + (f", ≤{max_concurrency} in flight" if max_concurrency else "")
    return asyncio.run(_run(base, model, prompts, prompt_lens, output_lens, rate, burstiness, max_concurrency, seed,
                            timeout_s, progress, desc, api_key))


def load_metrics(records: list[RequestRecord], duration_s: float, slo: SLO) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    itl = [gap for r in done for gap in r.itl_s]
    metrics: dict[str, Any] = {
        "completed": len(done),
        "failed": len(failed),
        "errors": sorted({r.error for r in failed if r.error})[:3],
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput_req_per_s": len(done) / duration_s,
        "output_throughput_tok_per_s": output_tokens / duration_s,
        "total_token_throughput_tok_per_s": (prompt_tokens + output_tokens) / duration_s,
        "ttft_ms": summarize((r.ttft_s for r in done), 1e3),
        "tpot_ms": summarize((r.tpot_s for r in done), 1e3),
        "itl_ms": summarize(itl, 1e3),
        "e2e_ms": summarize((r.e2e_s for r in done), 1e3),
        "usage_reported": all(r.usage_reported for r in done),
    }
    if slo.is_set:
        latencies = [(r.ttft_s, r.tpot_s, r.e2e_s) for r in done]
        metrics["goodput_req_per_s"] = goodput_req_per_s(latencies, slo, duration_s)
        metrics["slo_attainment"] = sum(slo.met_by(*lat) for lat in latencies) / len(records) if records else 0.0
    return metrics
