"""What a simulated run means to a user: latency percentiles, goodput under SLOs, cost.

Percentiles and goodput use the benchmark's own definitions (loadgen/stats.py), so a
simulated figure and a measured one are the same statistic. Cost counts every chip for the
whole run, from the first arrival to the last token: at a low arrival rate the chips sit
idle between requests and are paid for anyway (the seed's §8 point), which is why the cost
per token falls as the rate rises until the SLOs break.
"""

from __future__ import annotations

from typing import Any

from kvserve.loadgen.stats import SLO, summarize
from kvserve.sim.simulator import SimRun


def summary(run: SimRun, slo: SLO = SLO(), usd_per_chip_hour: float | None = None) -> dict[str, Any]:
    done = [t for t in run.traces if t.finished_s is not None]
    rejected = [t for t in run.traces if t.rejected]
    start = min((t.arrival_s for t in run.traces), default=0.0)
    duration = max(run.end_s - start, 1e-12)
    output_tokens = sum(t.output_tokens for t in done)
    prompt_tokens = sum(t.prompt_tokens for t in done)
    out: dict[str, Any] = {
        "deployment": run.deployment.describe(),
        "completed": len(done),
        "rejected": len(rejected),
        "rejected_why": sorted({t.rejected for t in rejected})[:3],
        "duration_s": duration,
        "request_throughput_req_per_s": len(done) / duration,
        "output_throughput_tok_per_s": output_tokens / duration,
        "ttft_ms": summarize((t.ttft_s for t in done), 1e3),
        "tpot_ms": summarize((t.tpot_s for t in done), 1e3),
        "itl_ms": summarize((g for t in done for g in t.itl_s), 1e3),
        "e2e_ms": summarize((t.e2e_s for t in done), 1e3),
        "preemptions": sum(t.preemptions for t in run.traces),
        "prefix_cache_hit_rate": sum(t.cached_tokens for t in done) / prompt_tokens if prompt_tokens else 0.0,
        "handoff_bytes": run.handoff_bytes,
        "instances": [
            {"name": i.name, "role": i.role, "steps": i.steps, "busy_fraction": i.busy_s / duration,
             "max_running": i.max_running, "num_blocks": i.kv.num_blocks}
            for i in run.instances
        ],  # fmt: skip
    }
    if slo.is_set:
        met = sum(slo.met_by(t.ttft_s, t.tpot_s, t.e2e_s) for t in done)
        out["slo_attainment"] = met / len(run.traces) if run.traces else 0.0
        out["goodput_req_per_s"] = met / duration
    if usd_per_chip_hour is not None:
        dollars = usd_per_chip_hour * run.deployment.num_chips * duration / 3600
        out["cost_usd"] = dollars
        out["cost_per_million_output_tokens_usd"] = dollars / output_tokens * 1e6 if output_tokens else None
        out["cost_per_request_usd"] = dollars / len(done) if done else None
    return out
