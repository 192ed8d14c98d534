"""The bodies of `kvserve bench …`: check the flags (a `ConfigError` naming the flag, which
the dispatcher prints as one line), run the benchmark, print and write its figures."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from kvserve.engine.gc_policy import freeze_after_startup, thaw
from kvserve.engine_args import engine_config_from_args
from kvserve.errors import ConfigError

MIB = 2**20
BUSY_WARNING_FRACTION = 0.1
# memory read before each throughput round: about the bytes of one batched decode step
# (weights plus the KV of 64 requests), large enough that caches don't answer for memory
_ROUND_PROBE_BYTES = 512 * MIB


def _read_gb_s_in_child() -> float:
    """Memory-read bandwidth, summed in a child process so that its 512 MiB buffer does not
    count in this process's peak RSS, which the report gives as kvserve's."""
    import subprocess

    code = ("from kvserve.planner.calibrate import measure_read_bytes_per_s as m; "
            f"print(m({_ROUND_PROBE_BYTES}, seconds=1.0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1]) / 1e9


# ---- validation at the edge -------------------------------------------------------------


def _at_least(flag: str, value: int | float | None, low: float) -> None:
    if value is not None and not value >= low:
        raise ConfigError(flag, f"must be >= {low:g}, got {value}")


def _int_list(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(flag, f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 2:
        raise ConfigError(flag, f"expected integers >= 2, got {text!r}")
    return values


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(math.inf if v.strip().lower() in ("inf", "infinity") else float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError("--request-rate", f"expected comma-separated numbers or inf, got {text!r}") from None
    if not rates or any(not r > 0 or math.isnan(r) for r in rates):
        raise ConfigError("--request-rate", f"every rate must be > 0 (or inf), got {text!r}")
    return rates


def _check_workload(args: argparse.Namespace) -> None:
    _at_least("--num-prompts", args.num_prompts, 1)
    _at_least("--input-len", args.input_len, 1)
    _at_least("--output-len", args.output_len, 1)
    if not 0 <= args.range_ratio < 1:
        raise ConfigError("--range-ratio", f"must be in [0, 1), got {args.range_ratio}")


def _before_run(args: argparse.Namespace):
    """(how busy the CPUs were before, a meter of other processes' CPU time during the run).
    Only a JSON records them, so only then is the half second spent."""
    from kvserve.loadgen.machine import ContentionMeter, contention_before_run

    return (contention_before_run() if args.json else None), ContentionMeter()


def _write_outputs(args: argparse.Namespace, benchmark: str, results: dict[str, Any], plot_fn, contention) -> None:
    from kvserve.loadgen.machine import envelope

    before, meter = contention
    during = meter.read()
    others = during.get("others_cpu_fraction")
    # for `bench serve` a local server is one of the "others": no warning there
    if benchmark != "serve" and others is not None and others > BUSY_WARNING_FRACTION:
        print(f"note: other processes took {100 * others:.0f}% of the CPUs during this run; the figures are not the "
              "engine's alone", file=sys.stderr)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(envelope(benchmark, vars(args), results, before, during), indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    if plot_fn and getattr(args, "plot", None):
        path = Path(args.plot)
        path.parent.mkdir(parents=True, exist_ok=True)
        plot_fn(results, path)
        print(f"wrote {path}", file=sys.stderr)


_OPEN_ENGINES: list = []  # engines the running command built: closed when it returns (close_engines)


def _engine(args: argparse.Namespace):
    from kvserve.engine.describe import describe
    from kvserve.engine.llm import LLM

    llm = LLM.from_config(engine_config_from_args(args))
    _OPEN_ENGINES.append(llm.engine)
    print(describe(llm.engine), file=sys.stderr)
    freeze_after_startup()  # as a server does: collections stop walking the engine's objects
    return llm


def close_engines() -> None:
    """Close what the command opened: a tensor-parallel engine's ranks stop, and its group is
    left, so a later engine in the same process can form its own."""
    while _OPEN_ENGINES:
        _OPEN_ENGINES.pop().close()
    thaw()  # what _engine froze can be collected again (tests run commands in one process)


# ---- commands ----------------------------------------------------------------------------


def latency(args: argparse.Namespace) -> int:
    from kvserve.bench import plot, report
    from kvserve.bench.latency import LatencySettings, check_fits, run_latency
    from kvserve.bench.roofline import measure_machine

    settings = LatencySettings(
        prompt_lens=_int_list("--prompt-lens", args.prompt_lens),
        prefill_iters=args.prefill_iters,
        decode_context_len=args.decode_context_len,
        decode_warmup_steps=args.decode_warmup_steps,
        decode_steps=args.decode_steps,
        read_share_steps=args.read_share_steps,
        seed=args.seed,
    )
    _at_least("--prefill-iters", args.prefill_iters, 1)
    _at_least("--decode-context-len", args.decode_context_len, 1)
    _at_least("--decode-warmup-steps", args.decode_warmup_steps, 0)
    _at_least("--decode-steps", args.decode_steps, 1)
    _at_least("--read-share-steps", args.read_share_steps, 0)
    if args.read_mib is not None and not args.read_mib > 0:
        raise ConfigError("--read-mib", f"must be > 0, got {args.read_mib}")
    _at_least("--gemm-size", args.gemm_size, 1)
    if not args.calibration_seconds > 0:
        raise ConfigError("--calibration-seconds", f"must be > 0, got {args.calibration_seconds}")

    contention = _before_run(args)
    llm = _engine(args)
    check_fits(llm.engine, settings)
    device = str(llm.engine.config.torch_device)
    peer = _llama_cpp_peer(args, "llama-bench")

    def measure_limits(decode_bytes_per_step: int):
        read_bytes = int(args.read_mib * MIB) if args.read_mib else decode_bytes_per_step
        print(f"measuring memory-read bandwidth ({read_bytes / 1e6:.0f} MB) and GEMM FLOP/s …", file=sys.stderr)
        return measure_machine(device, read_bytes, args.gemm_size, args.calibration_seconds)

    results = run_latency(llm.engine, settings, measure_limits)
    if peer is not None:
        from kvserve.bench import llama_cpp

        results["llama_cpp"] = (llama_cpp.compare_latency(llm.engine, settings, results, peer[0], args.llama_cpp_rounds)
                                if peer[0] else peer[1])
    report.print_latency(results)
    if peer is not None:
        llama_cpp.print_latency_comparison(results["llama_cpp"])
    _write_outputs(args, "latency", results, plot.plot_latency, contention)
    return 0


def _llama_cpp_peer(args: argparse.Namespace, binary: str):
    """None without --compare-llama-cpp; else (the peer, None) or (None, {"skipped": why}),
    the skip said at once on stderr. Threads: the engine's (set by --threads, else torch's)."""
    if not args.compare_llama_cpp:
        return None
    import torch

    from kvserve.bench import llama_cpp

    lc, why = llama_cpp.find(args.compare_llama_cpp, args.model, binary, torch.get_num_threads())
    return (lc, None) if lc else (None, llama_cpp.skipped(why))


def throughput(args: argparse.Namespace) -> int:
    import torch

    from kvserve.bench import plot, report
    from kvserve.bench.hf_peer import MODES
    from kvserve.bench.throughput import best_of_rounds, ratios, run_hf_peer, run_kvserve, warmup_workload
    from kvserve.bench.workload import build_workload

    _check_workload(args)
    modes = [m.strip() for m in args.hf_modes.split(",") if m.strip()]
    if any(m not in MODES for m in modes) or not modes:
        raise ConfigError("--hf-modes", f"expected a comma-separated subset of {', '.join(MODES)}, got {args.hf_modes!r}")
    _at_least("--hf-batch-size", args.hf_batch_size, 1)
    _at_least("--shared-prefix-len", args.shared_prefix_len, 0)
    _at_least("--num-prefixes", args.num_prefixes, 1)
    _at_least("--rounds", args.rounds, 1)

    contention = _before_run(args)
    llm = _engine(args)
    engine = llm.engine
    longest = (args.shared_prefix_len + round(args.input_len * (1 + args.range_ratio))
               + round(args.output_len * (1 + args.range_ratio)))
    if longest > engine.max_model_len:
        raise ConfigError("--input-len", f"prompt + output of up to {longest} tokens exceed max_model_len={engine.max_model_len}")
    special = list(getattr(engine.tokenizer.hf, "all_special_ids", []) or [])
    workload = build_workload(args.num_prompts, args.input_len, args.output_len, engine.arch.vocab_size,
                              seed=args.seed, range_ratio=args.range_ratio, exclude_ids=special,
                              shared_prefix_len=args.shared_prefix_len, num_prefixes=args.num_prefixes)
    warmup = warmup_workload(workload, engine.arch.vocab_size, args.seed, special)
    spec = {
        "model": args.model,
        "dtype": str(engine.config.torch_dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "batch_size": args.hf_batch_size or workload.num_requests,
        "max_batch_tokens": engine.config.max_num_batched_tokens,
        "workload": workload.to_dict(),
        "warmup": warmup.to_dict(),
    }
    peer = _llama_cpp_peer(args, "llama-batched-bench")
    if peer is not None and peer[0]:
        from kvserve.bench.llama_cpp import run_batched_bench, throughput_notes

        llama_notes = throughput_notes(args.range_ratio, args.shared_prefix_len)
    rounds, round_read_gb_s = [], []
    for i in range(args.rounds):
        label = f" (round {i + 1} of {args.rounds})" if args.rounds > 1 else ""
        if args.rounds > 1:  # the host's memory bandwidth moves; kvserve's decode is bound by it
            round_read_gb_s.append(_read_gb_s_in_child())
        print(f"kvserve: {workload.num_requests} requests{label} …", file=sys.stderr)
        runs = [run_kvserve(llm, workload, warmup, profile_attention=args.profile_attention,
                            alternate_shared_prefix=args.shared_prefix_attention_ab)]  # fmt: skip
        for mode in modes if args.compare == "hf" else []:
            print(f"transformers {mode}: {workload.num_requests} requests (own process){label} …", file=sys.stderr)
            runs.append(run_hf_peer(mode, spec, workload))
        if peer is not None and peer[0]:
            print(f"llama.cpp: llama-batched-bench, {args.num_prompts} x ({args.input_len} + {args.output_len}) tokens{label} …",
                  file=sys.stderr)
            runs.append(run_batched_bench(peer[0], args.num_prompts, args.input_len, args.output_len, llama_notes))
        rounds.append(runs)
    engines = best_of_rounds(rounds)

    results = {"model": engine.model_name, "dtype": str(engine.config.torch_dtype).removeprefix("torch."),
               "workload": workload.describe(), "engines": engines, "ratios": ratios(engines)}
    if args.rounds > 1:
        results["round_ratios"] = [ratios(runs) for runs in rounds]
        results["round_read_gb_s"] = round_read_gb_s
    if peer is not None:
        results["llama_cpp"] = peer[1] or {"bin_dir": str(peer[0].bin_dir), "model": str(peer[0].model),
                                           "threads": peer[0].threads}
    report.print_throughput(results)
    if peer is not None and peer[1]:
        print(f"llama.cpp comparison skipped: {peer[1]['skipped']}")
    _write_outputs(args, "throughput", results, plot.plot_throughput, contention)
    return 0


def serve(args: argparse.Namespace) -> int:
    from kvserve.bench import plot, report
    from kvserve.bench.serve import ServeSettings, run_serve
    from kvserve.loadgen.stats import SLO

    _check_workload(args)
    rates = _rates(args.request_rate)
    if not args.burstiness > 0:
        raise ConfigError("--burstiness", f"must be > 0, got {args.burstiness}")
    _at_least("--max-concurrency", args.max_concurrency, 1)
    _at_least("--vocab-size", args.vocab_size, 1)
    _at_least("--warmup-requests", args.warmup_requests, 0)
    if not args.request_timeout_s > 0:
        raise ConfigError("--request-timeout-s", f"must be > 0, got {args.request_timeout_s}")
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms), ("--slo-e2e-ms", args.slo_e2e_ms)):
        if value is not None and not value > 0:
            raise ConfigError(flag, f"must be > 0, got {value}")
    ms = lambda v: None if v is None else v / 1e3  # noqa: E731

    settings = ServeSettings(
        url=args.url, model_name=args.model_name, api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio, request_rates=rates, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, prompt_format=args.prompt_format, vocab_size=args.vocab_size,
        warmup_requests=args.warmup_requests, timeout_s=args.request_timeout_s, seed=args.seed,
        slo=SLO(ttft_s=ms(args.slo_ttft_ms), tpot_s=ms(args.slo_tpot_ms), e2e_s=ms(args.slo_e2e_ms)),
        progress=not args.no_progress,
    )
    contention = _before_run(args)
    results = run_serve(settings)
    report.print_serve(results)
    _write_outputs(args, "serve", results, plot.plot_serve, contention)
    return 0


def quality(args: argparse.Namespace) -> int:
    from kvserve.bench.quality import QualitySettings, print_quality, run_quality
    from kvserve.engine.describe import describe
    from kvserve.engine.engine import LLMEngine

    # both configurations are checked before anything loads: a bad combination of flags is a
    # usage error (exit status 2), as argparse's own are
    try:
        cand_config = engine_config_from_args(args)
        ref_config = engine_config_from_args(args, dtype=args.ref_dtype, quantization=args.ref_quantization,
                                             kv_cache_dtype=args.ref_kv_cache_dtype)
    except ConfigError as exc:
        print(f"kvserve bench quality: error: {exc}", file=sys.stderr)
        return 2
    settings = QualitySettings(ppl_window=args.ppl_window, ppl_tokens=args.ppl_tokens, greedy_tokens=args.greedy_tokens,
                               num_greedy_prompts=args.greedy_prompts, text_path=args.text)

    def build(config, role: str) -> LLMEngine:
        engine = LLMEngine(config)
        print(f"{role}: {describe(engine)}", file=sys.stderr)
        return engine

    contention = _before_run(args)
    results = run_quality(ref_config, cand_config, settings, build)
    print_quality(results)
    _write_outputs(args, "quality", results, None, contention)
    return 0
