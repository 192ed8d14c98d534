"""`kvserve sim`: simulate a kvserve deployment serving a workload, on a fitted step model.

Step times come from `kvserve plan calibrate --engine` (this machine, measured) or, with
`--chip`, from a chip's datasheet figures through the planner's roofline (labelled as an
extrapolation). Engine flags keep `kvserve serve`'s names and defaults. Flags take the units
their names say; a bad value comes back as one line naming the flag.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from rich.console import Console
from rich.table import Table

from kvserve.errors import ConfigError
from kvserve.loadgen.stats import SLO
from kvserve.router.policy import POLICIES
from kvserve.sim import plan_commands

MS = 1e-3


def register(subparsers) -> None:
    p = subparsers.add_parser("sim", help="simulate serving a workload: latency percentiles, goodput, the highest rate "
                              "meeting SLOs, cost", description=__doc__.split("\n\n")[0])  # fmt: skip
    add_flags(p)
    p.set_defaults(func=_run)
    plan_commands.register(subparsers)  # and `plan check-sim`, `plan calibrate --engine`


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("step times")
    g.add_argument("--step-model", metavar="FILE", help="a fitted step model (default: the one `kvserve plan calibrate "
                   "--engine` wrote in kvserve's cache)")
    g.add_argument("--chip", help="instead: a chip preset (or local) through the planner's roofline, for hardware not "
                   "measured; needs --model")
    g.add_argument("--model", help="with --chip: the model (a plan preset, .gguf or config.json)")
    g.add_argument("--quantization", default="none", help="with --chip: the weight format, as plan run takes it (default none: bf16)")
    g.add_argument("--kv-cache-dtype", default="bfloat16", help="with --chip: the KV format (default bfloat16)")
    g.add_argument("--bytes-per-weight", type=float, help="with --chip: p_w instead of --quantization")
    g.add_argument("--bytes-per-kv-element", type=float, help="with --chip: p_kv instead of --kv-cache-dtype")
    g.add_argument("--utilisation", type=float, default=0.4, help="with --chip: prefill's η (default 0.4, as plan run)")
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=1000)
    g.add_argument("--rate", type=float, action="append", help="arrival rate, req/s; repeat for a sweep; inf: all at "
                   "once (default 4)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 Poisson, < 1 bursty")
    g.add_argument("--input-len", default="128", help="prompt tokens: N, fixed:N or uniform:LO:HI (default 128)")
    g.add_argument("--output-len", default="128", help="output tokens: N, fixed:N or uniform:LO:HI (default 128)")
    g.add_argument("--trace", metavar="JSONL", help="take prompt/output lengths from this file, one request a line")
    g.add_argument("--shared-prefix-len", type=int, default=0, help="a common prefix before every prompt (a system prompt)")
    g.add_argument("--num-prefixes", type=int, default=1, help="that many different prefixes, round robin")
    g.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn below this")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("deployment")
    g.add_argument("--replicas", type=int, default=1, help="colocated instances behind the router")
    g.add_argument("--policy", choices=POLICIES, default="round-robin", help="the router's policy over replicas")
    g.add_argument("--prefill", type=int, default=0, help="instances in a prefill pool (with --decode: disaggregated)")
    g.add_argument("--decode", type=int, default=0, help="instances in a decode pool")
    g.add_argument("--handoff-gb-per-s", type=float, default=10.0, help="each prefill instance's link to the decode pool")
    g.add_argument("--handoff-latency-us", type=float, default=0.0)
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks per instance (the planner's TP model)")
    g.add_argument("--link-gb-per-s", type=float, help="TP AllReduce link (default: --chip's, else the local chip's, else 10)")
    g.add_argument("--link-latency-us", type=float, help="TP AllReduce α (default: --chip's, else the local chip's, else 10)")
    g.add_argument("--tp-comm", action=argparse.BooleanOptionalAction, default=True,
                   help="count the TP AllReduces in each step (--no-tp-comm: leave them out, as plan run's step does)")
    g = p.add_argument_group("engine (as kvserve serve)")
    g.add_argument("--kv-cache-memory", default="1GiB")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--shared-prefix-attention", choices=["auto", "off"], default="auto")
    g.add_argument("--max-model-len", type=int)
    g = p.add_argument_group("SLOs, search and cost")
    g.add_argument("--slo-ttft-ms", type=float)
    g.add_argument("--slo-tpot-ms", type=float)
    g.add_argument("--slo-e2e-ms", type=float)
    g.add_argument("--slo-attainment", type=float, default=0.9, help="share of requests that must meet the SLOs (0.9)")
    g.add_argument("--find-max-rate", action="store_true", help="search the highest rate meeting the SLOs")
    g.add_argument("--chip-cost-usd-per-hour", type=float, help="price per chip-hour: cost per million tokens and per request")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true")
    g.add_argument("--plot", metavar="PNG", help="latency against rate (a sweep) or its distribution (one rate)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar (default: on a terminal, for runs of 2,000 requests or more)")


def step_model(args):
    from kvserve.sim.step_model import from_datasheet, load_step_model

    if args.chip is None:
        if args.model is not None:
            raise ConfigError("--model", "the model comes with the step model; --model goes with --chip")
        return load_step_model(args.step_model)
    if args.step_model is not None:
        raise ConfigError("--chip", "give --step-model or --chip, not both")
    if args.model is None:
        raise ConfigError("--model", "--chip needs --model")
    from kvserve.planner import formats, hardware, models

    shape = models.load_model(args.model)
    chip = hardware.get_chip(args.chip)
    kv_format = formats.kv_format(args.kv_cache_dtype)
    p_kv, scale = kv_format.bytes_per_kv_element, kv_format.scale_bytes
    if args.bytes_per_kv_element is not None:
        if not 0 < args.bytes_per_kv_element <= 8:
            raise ConfigError("--bytes-per-kv-element", f"must be in (0, 8], got {args.bytes_per_kv_element}")
        p_kv, scale = args.bytes_per_kv_element, 0.0
    p_w = formats.weight_format(args.quantization, shape).bytes_per_weight
    if args.bytes_per_weight is not None:
        if not 0 < args.bytes_per_weight <= 8:
            raise ConfigError("--bytes-per-weight", f"must be in (0, 8], got {args.bytes_per_weight}")
        p_w = args.bytes_per_weight
    c_kv = shape.arch.kv_bytes_per_position(p_kv, scale)
    if not 0 < args.utilisation <= 1:
        raise ConfigError("--utilisation", f"must be in (0, 1], got {args.utilisation}")
    return from_datasheet(shape, chip, p_w, c_kv, args.utilisation)


def deployment(args, model):
    from kvserve.sim.instance import InstanceSpec
    from kvserve.sim.simulator import Deployment
    from kvserve.sim.step_model import TensorParallel

    link_bw, link_alpha = 10e9, 10e-6
    try:
        from kvserve.planner.hardware import get_chip

        chip = get_chip(args.chip or "local")
        link_bw, link_alpha = chip.link_bytes_per_s, chip.link_latency_s
    except ConfigError:  # no local measurement: the rough default
        pass
    tp = args.tensor_parallel_size
    if tp < 1:
        raise ConfigError("--tensor-parallel-size", f"must be >= 1, got {tp}")
    if tp > 1 and not (model.num_layers and model.d_model):
        raise ConfigError("--tensor-parallel-size", "the step model names no layer count or width for the TP reductions")
    return Deployment(
        replicas=args.replicas, policy=args.policy, prefill=args.prefill, decode=args.decode,
        handoff_bytes_per_s=args.handoff_gb_per_s * 1e9, handoff_latency_s=args.handoff_latency_us * 1e-6,
        instance=InstanceSpec(
            kv_cache_memory=args.kv_cache_memory, block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs, long_prefill_token_threshold=args.long_prefill_token_threshold,
            enable_prefix_caching=args.enable_prefix_caching, shared_prefix_attention=args.shared_prefix_attention,
            max_model_len=args.max_model_len,
        ),
        tensor_parallel=TensorParallel(
            tp, link_bw if args.link_gb_per_s is None else args.link_gb_per_s * 1e9,
            link_alpha if args.link_latency_us is None else args.link_latency_us * 1e-6, include_comm=args.tp_comm,
        ),
    )  # fmt: skip


def workload_spec(args, rate: float):
    from kvserve.sim.workload import Lengths, WorkloadSpec, read_trace

    if args.trace:
        prompt_lens, output_lens = read_trace(args.trace)
    else:
        prompt_lens, output_lens = Lengths.parse("--input-len", args.input_len), Lengths.parse("--output-len", args.output_len)
    return WorkloadSpec(args.num_requests, rate, prompt_lens, output_lens, args.burstiness, args.shared_prefix_len,
                        args.num_prefixes, args.vocab_size, args.seed)  # fmt: skip


def slo_of(args) -> SLO:
    for flag in ("slo_ttft_ms", "slo_tpot_ms", "slo_e2e_ms"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise ConfigError("--" + flag.replace("_", "-"), f"must be > 0 ms, got {value}")
    scaled = [None if v is None else v * MS for v in (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)]
    return SLO(*scaled)


def _run(args) -> int:
    from tqdm import tqdm

    from kvserve.sim.report import summary
    from kvserve.sim.simulator import Simulator
    from kvserve.sim.workload import build

    if args.num_requests < 1:
        raise ConfigError("--num-requests", f"must be >= 1, got {args.num_requests}")
    if args.chip_cost_usd_per_hour is not None and args.chip_cost_usd_per_hour < 0:
        raise ConfigError("--chip-cost-usd-per-hour", f"must be >= 0, got {args.chip_cost_usd_per_hour}")
    rates = args.rate or [4.0]
    if any(not r > 0 for r in rates):
        raise ConfigError("--rate", f"every rate must be > 0 requests/s (inf: all at once), got {rates}")
    workload_spec(args, rates[0])  # the workload flags are checked before anything is loaded
    slo = slo_of(args)
    model = step_model(args)
    sim = Simulator(deployment(args, model), model, seed=args.seed)
    show_progress = args.progress if args.progress is not None else (sys.stderr.isatty() and args.num_requests >= 2000)
    results = []
    for rate in rates:
        spec = workload_spec(args, rate)
        requests = build(spec)
        with tqdm(total=len(requests), desc=f"simulating {rate:g} req/s", unit="req", disable=not show_progress,
                  leave=False) as bar:  # fmt: skip
            run = sim.run(requests, progress=lambda: bar.update(1))
        results.append((rate, summary(run, slo, args.chip_cost_usd_per_hour), run.traces))
    search = None
    if args.find_max_rate:
        from kvserve.sim.search import find_max_rate

        search = find_max_rate(sim, workload_spec(args, rates[0]), slo, args.slo_attainment, start_rate=rates[0],
                               usd_per_chip_hour=args.chip_cost_usd_per_hour)  # fmt: skip
    out = {
        "step_model": {"source": model.source, "label": model.label, "model": model.model_name},
        "deployment": sim.deployment.describe(),
        "slo_ms": {k.replace("_s", "_ms"): None if v is None else v * 1e3 for k, v in slo.to_dict().items()},
        "runs": [{"rate_req_per_s": "inf" if math.isinf(r) else r, **s} for r, s, _ in results],
    }
    if search is not None:
        out["max_rate"] = {"target_attainment": args.slo_attainment, "max_rate_req_per_s": search.max_rate_req_per_s,
                           "trials": search.trials, "at_max": search.at_max}  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _render(out, Console())
    if args.plot:
        from kvserve.sim.plot import write_plot

        print(f"wrote {write_plot(args.plot, results)}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _ms(summary: dict, key: str, stat: str) -> str:
    value = summary[key][stat]
    return "—" if value is None else f"{value:.1f}"


def _render(out: dict, console: Console) -> None:
    console.print(f"step times: {out['step_model']['label'] or out['step_model']['source']}", markup=False, highlight=False)
    console.print(f"deployment: {out['deployment']}", markup=False, highlight=False)
    latency = Table(title="simulated latency, ms (p50 / p90)", title_justify="left")
    for name in ("rate req/s", "TTFT", "TPOT", "ITL p50", "E2E"):
        latency.add_column(name, no_wrap=True)
    load = Table(title="simulated load and cost", title_justify="left")
    for name in ("rate", "done", "req/s", "out tok/s", "preempt", "hit", "SLO met", "goodput", "USD/M tok"):
        load.add_column(name, no_wrap=True)
    for run in out["runs"]:
        rate = str(run["rate_req_per_s"])
        latency.add_row(rate, f"{_ms(run, 'ttft_ms', 'median')} / {_ms(run, 'ttft_ms', 'p90')}",
                        f"{_ms(run, 'tpot_ms', 'median')} / {_ms(run, 'tpot_ms', 'p90')}", _ms(run, "itl_ms", "median"),
                        f"{_ms(run, 'e2e_ms', 'median')} / {_ms(run, 'e2e_ms', 'p90')}")  # fmt: skip
        load.add_row(
            rate, str(run["completed"]), f"{run['request_throughput_req_per_s']:.3g}", f"{run['output_throughput_tok_per_s']:.4g}",
            str(run["preemptions"]), f"{run['prefix_cache_hit_rate']:.0%}",
            f"{run['slo_attainment']:.0%}" if "slo_attainment" in run else "—",
            f"{run['goodput_req_per_s']:.3g}" if "goodput_req_per_s" in run else "—",
            f"{run['cost_per_million_output_tokens_usd']:.4g}" if run.get("cost_per_million_output_tokens_usd") else "—",
        )  # fmt: skip
    console.print(latency)
    console.print(load)
    for run in out["runs"]:
        if run["rejected"]:
            console.print(f"rate {run['rate_req_per_s']}: {run['rejected']} request(s) refused: {run['rejected_why'][0]}",
                          markup=False, highlight=False)  # fmt: skip
    if "max_rate" in out:
        m = out["max_rate"]
        found = m["max_rate_req_per_s"]
        trials = ", ".join(f"{r:.3g} → {a:.0%}" for r, a in m["trials"])
        console.print(f"highest rate with ≥{m['target_attainment']:.0%} of requests within the SLOs: "
                      f"{'none found' if found is None else f'{found:.3g} req/s'} (trials: {trials})",
                      markup=False, highlight=False)  # fmt: skip
        if found is not None and m["at_max"].get("cost_per_million_output_tokens_usd"):
            console.print(f"cost there: {m['at_max']['cost_per_million_output_tokens_usd']:.4g} USD per million output "
                          f"tokens, {m['at_max']['cost_per_request_usd']:.4g} USD per request", markup=False, highlight=False)
