"""`kvserve bench throughput`: N requests of given lengths through the engine at once.

The kvserve run happens in this process through the offline `LLM.generate` (continuous
batching over the whole workload); `--compare hf` then runs transformers on the very
same prompts, each mode in its own process so every peak RSS is that engine's alone.
Output tokens/s counts the tokens each request asked for; total tokens/s adds the
prompt tokens. Every engine gets one untimed warm-up on a few small requests first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvserve.bench.attention_time import decode_attention_profile
from kvserve.bench.hf_peer import peak_rss_mib
from kvserve.bench.latency import expert_reads
from kvserve.bench.workload import Workload, build_workload
from kvserve.loadgen.stats import summarize
from kvserve.sampling_params import SamplingParams

WARMUP_REQUESTS = 2
WARMUP_OUTPUT_LEN = 4


def warmup_workload(workload: Workload, vocab_size: int, seed: int, exclude_ids=()) -> Workload:
    """A couple of requests at the workload's longest prompt, with short outputs: the
    prefill shapes and the decode path are warm when timing starts."""
    length = max(len(p) for p in workload.prompts)
    return build_workload(min(WARMUP_REQUESTS, workload.num_requests), length, WARMUP_OUTPUT_LEN, vocab_size,
                          seed=seed + 10_000, exclude_ids=exclude_ids)


def rates(workload: Workload, elapsed_s: float) -> dict[str, float]:
    return {
        "elapsed_s": elapsed_s,
        "requests_per_s": workload.num_requests / elapsed_s,
        "output_tok_per_s": workload.num_output_tokens / elapsed_s,
        "total_tok_per_s": (workload.num_prompt_tokens + workload.num_output_tokens) / elapsed_s,
    }


def _params(output_lens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]


def run_kvserve(
    llm, workload: Workload, warmup: Workload, profile_attention: bool = False, alternate_shared_prefix: bool = False,
) -> dict[str, Any]:
    engine = llm.engine
    # a later round must not find the earlier round's prompts in the prefix cache
    engine.reset_prefix_cache()
    llm.generate(warmup.prompts, _params(warmup.output_lens))
    steps_before = engine.counters.steps
    kv_read_before = engine.counters.attention_kv_bytes_read
    kv_read_unshared_before = engine.counters.attention_kv_bytes_read_without_sharing
    shared_steps_before = engine.counters.shared_prefix_steps
    preemptions_before = engine.scheduler.num_preemptions
    kv = engine.kv_cache
    queries_before, hits_before = kv.prefix_queries, kv.prefix_hits
    experts_before = dataclasses.replace(engine.model.expert_counts)
    profiled: dict[str, Any] = {}
    profiling = profile_attention or alternate_shared_prefix
    with decode_attention_profile(engine, alternate_shared_prefix) if profiling else contextlib.nullcontext(profiled) as profiled:
        start = time.perf_counter()
        outputs = llm.generate(workload.prompts, _params(workload.output_lens))
        elapsed_s = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    steps = max(1, engine.counters.steps - steps_before)
    kv_read = engine.counters.attention_kv_bytes_read - kv_read_before
    kv_read_unshared = engine.counters.attention_kv_bytes_read_without_sharing - kv_read_unshared_before
    timings = [o.timings[0] for o in outputs]
    result = {
        "engine": "kvserve",
        # the CPU kernels' ISA level and each family's (None where the kernels are off)
        "kernel_level": engine.kernels.level,
        "kernel_families": dict(engine.kernels.families),
        **rates(workload, elapsed_s),
        "generated_tokens": generated,
        "peak_rss_mib": peak_rss_mib(),
        "steps": engine.counters.steps - steps_before,
        "preemptions": engine.scheduler.num_preemptions - preemptions_before,
        # tokens found in the prefix cache / tokens looked up, over this run only
        "prefix_cache_hit_rate": (kv.prefix_hits - hits_before) / max(1, kv.prefix_queries - queries_before),
        # KV bytes attention read per step (all layers), and what scanning each history alone reads
        "shared_prefix_attention": engine.config.shared_prefix_attention,
        "shared_prefix_steps": engine.counters.shared_prefix_steps - shared_steps_before,
        "kv_bytes_read_per_step": kv_read / steps,
        "kv_bytes_read_per_step_without_sharing": kv_read_unshared / steps,
        "kv_read_ratio": kv_read_unshared / kv_read if kv_read else 1.0,
        "ttft_ms": summarize((t.ttft_s for t in timings), 1e3),
        "tpot_ms": summarize((t.tpot_s for t in timings), 1e3),
        **profiled,
    }
    if engine.arch.num_experts:  # per step: experts run per sparse layer, their bytes and every expert's
        result["experts"] = expert_reads(engine.model.expert_counts, experts_before, steps)
    if generated != workload.num_output_tokens:
        result["warning"] = f"generated {generated} tokens, the workload asked for {workload.num_output_tokens}"
    return result


def run_hf_peer(mode: str, spec: dict[str, Any], workload: Workload) -> dict[str, Any]:
    """One transformers mode in a child process; a failure is reported, not raised."""
    name = f"transformers {mode}"
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps({**spec, "mode": mode}))
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}
        proc = subprocess.run([sys.executable, "-m", "kvserve.bench.hf_peer", str(spec_path), str(out_path)],
                              capture_output=True, text=True, env=env)
        try:
            peer = json.loads(out_path.read_text())
        except (OSError, ValueError):
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            peer = {"error": f"the peer process exited with {proc.returncode}: {tail}"}
    if "error" in peer:
        return {"engine": name, "error": peer["error"]}
    result = {"engine": name, **rates(workload, peer.pop("elapsed_s")), **peer}
    if peer["generated_tokens"] > workload.num_output_tokens:
        # static batches decode every row to the batch's longest output; only asked-for tokens count
        result["note"] = f"generated {peer['generated_tokens']} tokens to deliver {workload.num_output_tokens}"
    return result


def best_of_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per engine, its fastest round, with every round's elapsed time beside it.

    The machine is shared: another tenant's load can slow any one run by 1.5x. Engines take
    turns round by round, so each has the same chances of a quiet run, and each one's best
    is its speed with the least interference.
    """
    best = []
    for runs in zip(*rounds):
        ok = [r for r in runs if "error" not in r]
        if not ok:
            best.append(runs[0])
            continue
        pick = dict(min(ok, key=lambda r: r["elapsed_s"]))
        if len(runs) > 1:
            pick["elapsed_s_rounds"] = [r.get("elapsed_s") for r in runs]
        best.append(pick)
    return best


def ratios(results: list[dict[str, Any]]) -> dict[str, float]:
    """kvserve's output tokens/s over each peer's."""
    ours = results[0]["output_tok_per_s"]
    return {r["engine"]: ours / r["output_tok_per_s"] for r in results[1:] if "error" not in r}
