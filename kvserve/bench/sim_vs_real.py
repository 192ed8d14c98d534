"""`kvserve bench sim-vs-real`: the simulator's predictions against the real server, side by side.

In one sitting (the machine's speed drifts between sittings):
1. the server's steps are timed and fitted (`plan calibrate --engine`: a server of its own,
   driven over the calibration grid, not this workload), unless `--step-model` names a fit
   already made;
2. per scenario, a real `kvserve serve` starts on a loopback port with the scenario's engine
   flags, takes two warm-up requests, then serves the workload at three request rates
   (`kvserve bench serve`'s client: streamed completions of random token ids with
   ignore_eos, Poisson arrivals), each rate twice (`--repeat`, on by default): run B has run
   A's lengths and send times and other token ids;
3. the simulator serves the same requests (the same ids, lengths and send times) on a
   simulated instance with the same flags;
4. predicted and measured p50 and p90 of TTFT and TPOT are printed with their relative error,
   and, beside them, run B's figures against run A's: how far the machine repeats itself,
   the floor under any prediction's error.

The machine's speed drifts within minutes on a shared host (36-68 GB/s memory bandwidth within
an hour here), more than the 10% the comparison is judged by. So each run is bracketed by
probes: a few lone requests (128 prompt tokens, 48 out) whose TPOT is compared with the same
probe measured at the calibration's start and end; the model's costs are all scaled by that
ratio (the mean of the probes before and after the run), printed beside its figures. One
factor, from TPOT: a probe's TTFT is one step per request and moved by twice as much as the
run's steps did when both were measured. `--no-probe` compares with the model as fitted.

Scenarios: `plain`; `chunked` (long prompts cut into 256-position chunks that share steps with
decoding); `shared-prefix` (4 system prompts of 512 tokens before 64 own tokens: prefix-cache
hits); `preempt` (a 32 MiB KV pool, too small for the load: preemption by recompute, counted
on both sides). The rates, unless given, are 30%, 60% and 85% of the simulated instance's
saturated rate for the scenario.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvserve.bench.errors import BenchError
from kvserve.bench.workload import build_workload
from kvserve.loadgen.arrivals import interarrival_gaps_s, send_times_s
from kvserve.loadgen.load import load_metrics, run_at_rate
from kvserve.loadgen.stats import SLO


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    input_len: int
    output_len: int
    range_ratio: float = 0.5
    shared_prefix_len: int = 0
    num_prefixes: int = 1
    server_flags: tuple[str, ...] = ()  # beside the command's engine flags
    rate_fractions: tuple[float, ...] = (0.3, 0.6, 0.85)

    def flag(self, name: str, default: str) -> str:
        flags = list(self.server_flags)
        return flags[flags.index(name) + 1] if name in flags else default


SCENARIOS = {
    "plain": Scenario("plain", 128, 128),
    "chunked": Scenario("chunked", 1024, 64, server_flags=("--long-prefill-token-threshold", "256")),
    "shared-prefix": Scenario("shared-prefix", 64, 128, shared_prefix_len=512, num_prefixes=4),
    "preempt": Scenario("preempt", 256, 256, range_ratio=0.25, server_flags=("--kv-cache-memory", "32MiB")),
}


def register(sub) -> None:
    p = sub.add_parser("sim-vs-real", help="the simulator's TTFT/TPOT predictions against the real server, at three rates")
    p.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                   help="workload and engine setting to check; repeat for several (default: all four)")
    p.add_argument("--num-prompts", type=int, default=80, help="requests per rate (default 80)")
    p.add_argument("--input-len", type=int, help="every scenario's own prompt tokens, instead of its preset (mean)")
    p.add_argument("--output-len", type=int, help="every scenario's output tokens, instead of its preset (mean)")
    p.add_argument("--request-rates", help="three rates, comma-separated (default: 30/60/85%% of the simulated capacity)")
    p.add_argument("--step-model", metavar="FILE", help="a fitted step model (default: fit one now, in this sitting)")
    p.add_argument("--grid", choices=["full", "quick"], default="full", help="the calibration grid when fitting now")
    p.add_argument("--model", default=None, help="the model to serve (default: SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=0, help="torch threads of the server and the calibration (0: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-timeout-s", type=float, default=300.0, help="wait this long for a server to start")
    p.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True,
                   help="scale the model per run by the machine's speed then, from probe requests before and after it (default on)")
    p.add_argument("--repeat", action=argparse.BooleanOptionalAction, default=True,
                   help="serve each rate's workload a second time (the same lengths and send times, other token ids): "
                        "the server against itself, how far this machine repeats its own figures (default on)")
    p.add_argument("--json", metavar="FILE", help="write every figure, predicted and measured, as JSON")
    p.set_defaults(func=run)


def _stats(metrics: dict) -> dict[str, float | None]:
    return {f"{k}_{s}": metrics[f"{k}_ms"][s] for k in ("ttft", "tpot") for s in ("median", "p90")}


def _relative(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return predicted / measured - 1


def _rates(sim, scenario: Scenario, seed: int, given: str | None) -> list[float]:
    if given:
        try:
            rates = [float(r) for r in given.split(",")]
        except ValueError:
            raise BenchError(f"--request-rates: expected numbers separated by commas, got {given!r}") from None
        if not rates or any(not r > 0 for r in rates):
            raise BenchError(f"--request-rates: every rate must be > 0, got {given!r}")
        return rates
    from kvserve.sim.report import summary

    w = _workload(scenario, 200, seed, 32000)
    capacity = summary(sim.run(_sim_requests(w, math.inf, seed)))["request_throughput_req_per_s"]
    return [round(capacity * f, 3) for f in scenario.rate_fractions]


def _workload(scenario: Scenario, num: int, seed: int, vocab_size: int):
    return build_workload(num, scenario.input_len, scenario.output_len, vocab_size, seed=seed,
                          range_ratio=scenario.range_ratio, shared_prefix_len=scenario.shared_prefix_len,
                          num_prefixes=scenario.num_prefixes)  # fmt: skip


def _fresh_ids(workload, scenario: Scenario, seed: int, vocab_size: int):
    """`workload` again with other random token ids: the same lengths, and the same requests
    sharing a prefix (a new one), so a second run meets a cold prefix cache as the first did."""
    from kvserve.bench.workload import Workload, random_token_ids

    rng = np.random.default_rng([seed, 1])
    n = scenario.shared_prefix_len
    prefixes: dict[tuple, list[int]] = {}
    prompts = []
    for p in workload.prompts:
        head = prefixes.setdefault(tuple(p[:n]), random_token_ids(n, vocab_size, rng)) if n else []
        prompts.append(head + random_token_ids(len(p) - len(head), vocab_size, rng))
    return Workload(prompts, list(workload.output_lens))


def _sim_requests(workload, rate: float, seed: int):
    """The workload's requests, sent when `kvserve bench serve` sends them at `rate` with `seed`."""
    from kvserve.sim.workload import from_lists

    n = len(workload.prompts)
    return from_lists(workload.prompts, workload.output_lens, send_times_s(interarrival_gaps_s(n, rate, 1.0, seed)))


def _preemptions(base: str) -> int:
    """The server's preemptions so far (GET /v1/engine/stats)."""
    import httpx

    response = httpx.get(base + "/engine/stats", timeout=30)
    response.raise_for_status()
    return int(response.json()["preemptions"])


def _instance_spec(scenario: Scenario):
    from kvserve.sim.instance import InstanceSpec

    return InstanceSpec(kv_cache_memory=scenario.flag("--kv-cache-memory", "1GiB"),
                        long_prefill_token_threshold=int(scenario.flag("--long-prefill-token-threshold", "0")))  # fmt: skip


def _model_flags(args) -> list[str]:
    return (["--model", args.model] if args.model else []) + (["--threads", str(args.threads)] if args.threads else [])


def run(args) -> int:
    from kvserve.sim.measure_server import probe_server, start_server, stop_server
    from kvserve.sim.report import summary
    from kvserve.sim.simulator import Deployment, Simulator
    from kvserve.sim.step_model import load_step_model

    if args.num_prompts < 1:
        raise BenchError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    from kvserve.loadgen.machine import contention_before_run

    for flag in ("input_len", "output_len"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise BenchError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    scenarios = [dataclasses.replace(SCENARIOS[s], input_len=args.input_len or SCENARIOS[s].input_len,
                                     output_len=args.output_len or SCENARIOS[s].output_len)
                 for s in (args.scenario or list(SCENARIOS))]  # fmt: skip
    console = Console()
    before = contention_before_run()
    if args.step_model:
        model = load_step_model(args.step_model)
    else:
        from kvserve.sim.calibrate import calibrate_through_server
        from kvserve.sim.measure import Grid

        console.print("fitting the step model in this sitting (kvserve plan calibrate --engine) …", highlight=False)
        out = Path(tempfile.mkdtemp(prefix="kvserve-sim-vs-real-")) / "step_model.json"
        model, _, _ = calibrate_through_server(_model_flags(args), Grid.quick() if args.grid == "quick" else Grid(), out,
                                               progress=sys.stderr.isatty())  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="kvserve-sim-vs-real-logs-"))
    # the same probe measured when the model was fitted: the machine's speed then
    reference = model.meta.get("probe") if args.probe else None
    if args.probe and reference is None:
        console.print("the step model has no probe from its calibration (fitted in process?): comparing unscaled",
                      highlight=False)  # fmt: skip
    results: list[dict[str, Any]] = []
    for scenario in scenarios:
        sim = Simulator(Deployment(instance=_instance_spec(scenario)), model)
        rates = _rates(sim, scenario, args.seed, args.request_rates)
        proc, base, model_name = start_server([*_model_flags(args), *scenario.server_flags], logs / f"server-{scenario.name}.log",
                                              args.server_timeout_s, what="server")  # fmt: skip
        try:
            vocab = min(model.meta.get("engine", {}).get("vocab_size", 32000), 32000)
            warm = _workload(scenario, 2, 10_000 + args.seed, vocab)
            run_at_rate(base, model_name, warm.prompts, [len(p) for p in warm.prompts], [8, 8], rate=math.inf,
                        burstiness=1.0, max_concurrency=1, seed=args.seed, timeout_s=120, progress=False)  # fmt: skip
            for index, rate in enumerate(rates):
                seed = args.seed + 1 + index
                first = _workload(scenario, args.num_prompts, seed, vocab)
                # run B: the same lengths and send times, other token ids (no prefix hit on run A's prompts)
                runs = [("A", first)] + ([("B", _fresh_ids(first, scenario, seed, vocab))] if args.repeat else [])
                probes = [probe_server(base, model_name, 20_000 + seed, vocab)] if reference else []
                for run_name, w in runs:
                    preempted = _preemptions(base)
                    records, duration = run_at_rate(base, model_name, w.prompts, [len(p) for p in w.prompts], w.output_lens,
                                                    rate=rate, burstiness=1.0, max_concurrency=None, seed=seed, timeout_s=600,
                                                    progress=sys.stderr.isatty())  # fmt: skip
                    preempted = _preemptions(base) - preempted
                    measured = load_metrics(records, duration, SLO())
                    if measured["failed"]:
                        raise BenchError(f"{scenario.name} at {rate} req/s: {measured['failed']} request(s) failed: {measured['errors']}")
                    factor, ttft_ratio = 1.0, None
                    if reference:
                        probes.append(probe_server(base, model_name, 30_000 + seed + len(probes), vocab))
                        factor = (probes[-2]["tpot_s"] + probes[-1]["tpot_s"]) / 2 / reference["tpot_s"]
                        ttft_ratio = (probes[-2]["ttft_s"] + probes[-1]["ttft_s"]) / 2 / reference["ttft_s"]
                    predicted = summary(Simulator(sim.deployment, model.scaled(factor), seed=seed).run(_sim_requests(w, rate, seed)))
                    results.append({"scenario": scenario.name, "rate_req_per_s": rate, "run": run_name, "speed_factor": factor,
                                    "probe_ttft_ratio": ttft_ratio, "predicted": _stats(predicted), "measured": _stats(measured),
                                    "predicted_preemptions": predicted["preemptions"], "measured_preemptions": preempted,
                                    "predicted_prefix_hit_rate": predicted["prefix_cache_hit_rate"]})  # fmt: skip
        finally:
            stop_server(proc)
    _render(results, model, console)
    if args.json:
        from kvserve.loadgen.machine import envelope

        step_model = {k: v for k, v in model.as_dict().items() if k != "meta"}
        step_model["meta"] = {k: v for k, v in model.meta.items() if k != "samples"}  # the samples stay in the model file
        data = envelope("sim-vs-real", vars(args), {"step_model": step_model, "results": results, "summary": summarize(results)},
                        before)  # fmt: skip
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
        console.print(f"wrote {args.json}", highlight=False)
    return 0


KEYS = ("ttft_median", "ttft_p90", "tpot_median", "tpot_p90")


def _within(predicted: float | None, measured: float | None, key: str) -> bool:
    """The target: p50 within ±10%, p90 within ±15%."""
    err = _relative(predicted, measured)
    return err is not None and abs(err) <= (0.10 if "median" in key else 0.15)


def _cell(p: float | None, m: float | None, key: str) -> str:
    err = _relative(p, m)
    return "—" if err is None else f"{p:.1f} / {m:.1f} ({err:+.0%})" + ("" if _within(p, m, key) else " ✗")


def _pairs(results: list[dict]) -> list[tuple[dict, dict]]:
    """(run A, run B) of each scenario and rate served twice."""
    first = {(r["scenario"], r["rate_req_per_s"]): r for r in results if r["run"] == "A"}
    return [(first[(r["scenario"], r["rate_req_per_s"])], r) for r in results if r["run"] == "B"]


def summarize(results: list[dict]) -> dict[str, int]:
    """How many figures meet the target: the simulator against each run, and run B against run A."""
    sim = [_within(r["predicted"][k], r["measured"][k], k) for r in results for k in KEYS]
    again = [_within(b["measured"][k], a["measured"][k], k) for a, b in _pairs(results) for k in KEYS]
    return {"simulator_within": sum(sim), "simulator_figures": len(sim), "again_within": sum(again), "again_figures": len(again)}


def _render(results: list[dict], model, console: Console) -> None:
    console.print(f"step model: {model.label or model.source}", markup=False, highlight=False)
    table = Table(title="simulated / measured, ms (relative error; ✗ outside p50 ±10%, p90 ±15%)", title_justify="left")
    for name in ("scenario", "rate", "run", "slower ×", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "preempted"):
        table.add_column(name, no_wrap=True)
    for r in results:
        table.add_row(r["scenario"], f"{r['rate_req_per_s']:.3g}", r["run"], f"{r['speed_factor']:.2f}",
                      *(_cell(r["predicted"][k], r["measured"][k], k) for k in KEYS),
                      f"{r['predicted_preemptions']} / {r['measured_preemptions']}")  # fmt: skip
    console.print(table)
    pairs = _pairs(results)
    if pairs:
        table = Table(title="the server against itself: run B / run A, ms (the same lengths and send times)", title_justify="left")
        for name in ("scenario", "rate", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "preempted"):
            table.add_column(name, no_wrap=True)
        for a, b in pairs:
            table.add_row(a["scenario"], f"{a['rate_req_per_s']:.3g}", *(_cell(b["measured"][k], a["measured"][k], k) for k in KEYS),
                          f"{b['measured_preemptions']} / {a['measured_preemptions']}")  # fmt: skip
        console.print(table)
    n = summarize(results)
    line = f"simulator: {n['simulator_within']} of {n['simulator_figures']} figures within the target (p50 ±10%, p90 ±15%)"
    if pairs:
        line += f"; the server against itself: {n['again_within']} of {n['again_figures']}"
    console.print(line, highlight=False)
