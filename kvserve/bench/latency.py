"""`kvserve bench latency`: batch-1 decode and prefill speed, each beside its roofline.

Both run through `LLMEngine.step()`, so the figures include everything a real request
pays per step (scheduling, batch preparation, sampling, detokenizing), not the forward
pass alone. Decode tokens/s counts only steps after the prompt was prefilled and a few
warm-up steps were taken. Prefill tokens/s is prompt tokens ÷ the time from adding a
request with `max_tokens=1` to its finish on an idle engine (its TTFT), with a fresh
random prompt each time so the prefix cache never hits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from statistics import median, quantiles
from typing import Any, Callable

import numpy as np
import torch

from kvserve.bench import roofline
from kvserve.bench.workload import random_token_ids
from kvserve.engine.engine import LLMEngine
from kvserve.errors import ConfigError
from kvserve.loadgen.stats import summarize
from kvserve.arch import KV_INT8_SCALE_BYTES
from kvserve.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class LatencySettings:
    prompt_lens: tuple[int, ...] = (128, 512, 2048)
    prefill_iters: int = 3
    decode_context_len: int = 128
    decode_warmup_steps: int = 8
    decode_steps: int = 64
    read_share_steps: int = 32  # decode steps timed between reads of their bytes (read_share); 0: none
    seed: int = 0


def check_fits(engine: LLMEngine, settings: LatencySettings) -> None:
    """Every request of the run must fit max_model_len; say which flag to lower if not."""
    limit = engine.max_model_len
    too_long = [n for n in settings.prompt_lens if n + 1 > limit]
    if too_long:
        raise ConfigError("--prompt-lens", f"{too_long} + 1 output token exceed max_model_len={limit}")
    # the decode steps and the read-share steps each run one request of their own
    steps, flag = max((settings.decode_steps, "--decode-steps"), (settings.read_share_steps, "--read-share-steps"))
    decode_len = settings.decode_context_len + settings.decode_warmup_steps + steps + 1
    if decode_len > limit:
        raise ConfigError(flag, f"context {settings.decode_context_len} + warm-up + steps = {decode_len} exceeds max_model_len={limit}")


def _special_ids(engine: LLMEngine) -> list[int]:
    return list(getattr(engine.tokenizer.hf, "all_special_ids", []) or [])


def decode_context_start(settings: LatencySettings) -> int:
    """Positions the first timed decode step attends to: the prompt, the warm-up tokens, its own."""
    return settings.decode_context_len + settings.decode_warmup_steps + 1


@contextlib.contextmanager
def decoding(engine: LLMEngine, settings: LatencySettings, rng: np.random.Generator, steps: int):
    """One batch-1 request of a random prompt, prefilled and past its warm-up steps, ready for
    `steps` more decode steps; aborted (its KV blocks freed) on the way out, whatever happened."""
    prompt = random_token_ids(settings.decode_context_len, engine.arch.vocab_size, rng, _special_ids(engine))
    max_tokens = 1 + settings.decode_warmup_steps + steps
    request_id = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    first_token_at = engine.counters.generation_tokens + 1
    try:
        while engine.counters.generation_tokens < first_token_at:
            engine.step()  # prefill (in one or more chunks) until the first token is sampled
        for _ in range(settings.decode_warmup_steps):
            engine.step()
        yield
    finally:
        engine.abort_request(request_id)


def measure_decode(engine: LLMEngine, settings: LatencySettings, rng: np.random.Generator) -> dict[str, Any]:
    tp = engine.tp
    with decoding(engine, settings, rng, settings.decode_steps):
        generated_before = engine.counters.generation_tokens
        experts_before = dataclasses.replace(engine.model.expert_counts)
        step_times_s = []
        comm_before = dict(tp.comm_seconds) if tp is not None else {}
        calls_before = dict(tp.comm_calls) if tp is not None else {}
        for _ in range(settings.decode_steps):
            start = time.perf_counter()
            engine.step()
            step_times_s.append(time.perf_counter() - start)
        decoded = engine.counters.generation_tokens - generated_before
    elapsed_s = sum(step_times_s)
    out = {
        "context_len_start": decode_context_start(settings),
        "steps": settings.decode_steps,
        "tokens": decoded,  # one per step at batch 1; checked by the caller
        "elapsed_s": elapsed_s,
        "tok_per_s": decoded / elapsed_s,
        "step_ms": summarize(step_times_s, 1e3),
    }
    if engine.arch.num_experts:  # what the routed experts read per step, beside all of them (model/moe.py)
        out["experts"] = expert_reads(engine.model.expert_counts, experts_before, settings.decode_steps)
    if tp is not None:  # rank 0's time inside collectives (waits for the other ranks included), per decode step
        out["tensor_parallel_size"] = tp.world
        out["kv_layout"] = "requests" if engine.requests_layout else "heads"
        # the kinds the steps used (all_to_all only in the requests KV layout)
        out["comm_ms_per_step"] = {
            k: (tp.comm_seconds[k] - comm_before[k]) * 1e3 / settings.decode_steps for k in comm_before
            if tp.comm_calls[k] > calls_before[k]
        }
    return out


def expert_reads(after, before, steps: int) -> dict[str, float]:
    """Per step between two ExpertCounts: experts run per sparse layer, their bytes, and the bytes
    of every expert (the dense equivalent)."""
    passes = max(after.layer_passes - before.layer_passes, 1)
    return {
        "experts_per_layer": (after.experts_touched - before.experts_touched) / passes,
        "expert_bytes_per_step": (after.expert_weight_bytes - before.expert_weight_bytes) / steps,
        "all_experts_bytes_per_step": (after.all_experts_bytes - before.all_experts_bytes) / steps,
    }


def measure_read_share(engine: LLMEngine, settings: LatencySettings, rng: np.random.Generator,
                       bytes_per_step: float) -> dict[str, Any]:
    """Decode's share of the memory-read bandwidth, step by step: each decode step is timed
    between two passes of a plain read of its bytes (torch.sum over an fp32 buffer of
    `bytes_per_step`, one pass each), and its share is the mean of those passes' times ÷ its
    own time. The roofline's `fraction_of_roofline` divides the mean decode rate by the best
    read rate of 1-second tests run before and after everything; on a shared host whose
    bandwidth moves (30-60 GB/s within minutes on a 2-core Zen 4 VM here), that quotient says
    as much about when each test ran as about the engine. Here the step and its reads see the
    same state of the host. The median step's share, with the quartiles."""
    steps = settings.read_share_steps
    device = engine.config.torch_device
    buffer = torch.ones(max(int(bytes_per_step) // 4, 1), dtype=torch.float32, device=device)

    def read_s() -> float:
        start = time.perf_counter()
        buffer.sum().item()  # .item(): the sum has finished (and synced, on a GPU)
        return time.perf_counter() - start

    read_s()  # the buffer's page faults, before any pass is timed
    with decoding(engine, settings, rng, steps):
        reads_s, steps_s = [read_s()], []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            steps_s.append(time.perf_counter() - start)
            reads_s.append(read_s())
    del buffer
    shares = [(reads_s[i] + reads_s[i + 1]) / 2 / steps_s[i] for i in range(steps)]
    quartiles = quantiles(shares, n=4) if steps > 1 else [shares[0]] * 3
    return {
        "steps": steps,
        "bytes": int(bytes_per_step),
        "median": median(shares),
        "p25": quartiles[0],
        "p75": quartiles[2],
        "read_bytes_per_s_median": bytes_per_step / median(reads_s),
        "decode_bytes_per_s_median": bytes_per_step / median(steps_s),
    }


def measure_prefill(engine: LLMEngine, prompt_len: int, iters: int, rng: np.random.Generator) -> dict[str, Any]:
    special = _special_ids(engine)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times_s, steps = [], []
    for i in range(iters + 1):  # the first run warms up kernels for this shape and is dropped
        prompt = random_token_ids(prompt_len, engine.arch.vocab_size, rng, special)
        steps_before = engine.counters.steps
        start = time.perf_counter()
        engine.add_request(None, prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        elapsed_s = time.perf_counter() - start
        if i:
            times_s.append(elapsed_s)
            steps.append(engine.counters.steps - steps_before)
    time_s = median(times_s)
    return {
        "prompt_len": prompt_len,
        "iters": iters,
        "steps_per_prefill": max(steps),
        "time_ms": summarize(times_s, 1e3),
        "tok_per_s": prompt_len / time_s,
    }


def run_latency(
    engine: LLMEngine, settings: LatencySettings, measure_limits: Callable[[int], roofline.MachineLimits]
) -> dict[str, Any]:
    """`measure_limits(decode_bytes_per_step)` runs before and after the engine's
    measurements; the best of the two is the roofline. It is given the bytes one decode
    step reads, so the bandwidth test can read as much: caches make a smaller test faster."""
    check_fits(engine, settings)
    if engine.has_unfinished_requests():
        raise ConfigError("engine", "the latency benchmark needs an idle engine")
    rng = np.random.default_rng(settings.seed)
    arch = engine.arch
    element_bytes = torch.empty((), dtype=engine.config.torch_dtype).element_size()
    # the KV pool's own elements (an int8 cache: 1 byte and an fp32 scale per position and KV head)
    layout = engine.layout
    kv_bytes, kv_scale_bytes = (1, KV_INT8_SCALE_BYTES) if layout.quantized else (element_bytes, 0)

    mean_context = decode_context_start(settings) + (settings.decode_steps - 1) / 2
    weights_read = engine.model.decode_weight_bytes()
    bytes_per_step = roofline.decode_bytes_per_step(arch, element_bytes, kv_bytes, mean_context, kv_scale_bytes, weights_read=weights_read)

    limits_before = measure_limits(int(bytes_per_step))
    decode = measure_decode(engine, settings, rng)
    if "experts" in decode:  # a mixture of experts: the routed experts this step read, not all of them
        experts = decode["experts"]
        bytes_per_step += experts["expert_bytes_per_step"] - (weights_read - engine.model.decode_weight_bytes(routed_experts=False))
        experts["dense_equivalent_bytes_per_step"] = bytes_per_step - experts["expert_bytes_per_step"] + experts["all_experts_bytes_per_step"]
    decode["bytes_per_step"] = bytes_per_step
    if settings.read_share_steps:
        decode["read_share"] = measure_read_share(engine, settings, rng, bytes_per_step)

    prefill = [measure_prefill(engine, n, settings.prefill_iters, rng) for n in settings.prompt_lens]
    limits_after = measure_limits(int(bytes_per_step))
    limits = roofline.best_of(limits_before, limits_after)

    decode["roofline_tok_per_s"] = limits.read_bytes_per_s / decode["bytes_per_step"]
    decode["fraction_of_roofline"] = decode["tok_per_s"] / decode["roofline_tok_per_s"]
    for row in prefill:
        prompt_len = row["prompt_len"]
        flops = roofline.prefill_flops(arch, prompt_len)
        row["flops"] = flops
        row["roofline_tok_per_s"] = prompt_len * limits.gemm_flops_per_s / flops["total"]
        row["fraction_of_roofline"] = row["tok_per_s"] / row["roofline_tok_per_s"]

    return {
        "settings": dataclasses.asdict(settings),
        "model": {
            "name": engine.model_name,
            "params": roofline.total_params(arch),
            "layer_params": roofline.layer_params(arch),
            "dtype": str(engine.config.torch_dtype).removeprefix("torch."),
            "device": str(engine.config.torch_device),
            "kv_bytes_per_position": layout.kv_bytes_per_position,
            # the CPU kernels' ISA level and each family's (None where the kernels are off)
            "kernel_level": engine.kernels.level,
            "kernel_families": dict(engine.kernels.families),
        },
        "machine": {**limits.to_dict(), "before": limits_before.to_dict(), "after": limits_after.to_dict()},
        "decode": decode,
        "prefill": prefill,
        "notes": [] if engine.config.torch_dtype == torch.bfloat16 else [
            f"the engine runs {engine.config.torch_dtype}; the prefill roofline uses the bf16 GEMM rate"
        ],
    }
