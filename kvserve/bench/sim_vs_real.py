"""`kvserve bench sim-vs-real`: the simulator's predictions against the real server, side by side.

In one sitting (the machine's speed drifts between sittings):
1. the server's steps are timed and fitted (`plan calibrate --engine`: a server of its own,
   driven over the calibration grid, not this workload), unless `--step-model` names a fit
   already made;
2. per scenario, a real `kvserve serve` starts on a loopback port with the scenario's engine
   flags, takes two warm-up requests, then serves the workload at three request rates
   (`kvserve bench serve`'s client: streamed completions of random token ids with
   ignore_eos, gamma arrivals);
3. the simulator serves the same requests (the same ids, lengths and send times) on a
   simulated instance with the same flags;
4. predicted and measured p50 and p90 of TTFT and TPOT are printed with their relative error.

The machine's speed drifts within minutes on a shared host (36-68 GB/s memory bandwidth within
an hour here), more than the 10% the comparison is judged by. So each rate's run is bracketed
by a probe: a few lone requests (128 prompt tokens, 48 out) whose TTFT and TPOT are compared
with the same probe measured by the calibration, right after fitting; the model's prompt costs
are scaled by the TTFT ratio and its per-step and per-row costs by the TPOT ratio (each the
mean of the probes before and after) for that rate, and the factors are printed beside its
figures. Measured against measured, the factors hold the machine's drift and nothing of the
fit's own error.
`--no-probe` compares with the model as fitted.

Scenarios: `plain`; `chunked` (long prompts cut into 256-position chunks that share steps with
decoding); `shared-prefix` (4 system prompts of 512 tokens before 64 own tokens: prefix-cache
hits); `preempt` (a KV pool too small for the load: preemption by recompute). The rates, unless
given, are 30%, 60% and 85% of the simulated instance's saturated rate for the scenario.
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

from rich.console import Console
from rich.table import Table

from kvserve.bench.arrivals import interarrival_gaps_s, send_times_s
from kvserve.bench.errors import BenchError
from kvserve.bench.serve_load import load_metrics, run_at_rate
from kvserve.bench.stats import SLO
from kvserve.bench.workload import build_workload


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
    "preempt": Scenario("preempt", 256, 256, range_ratio=0.25, server_flags=("--kv-cache-memory", "40MiB"),
                        rate_fractions=(0.5, 0.8, 1.0)),  # fmt: skip
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
                   help="scale the model per rate by the machine's speed now, from probe requests around the run (default on)")
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

    capacity = summary(sim.run(_sim_requests(scenario, 200, math.inf, seed)))["request_throughput_req_per_s"]
    return [round(capacity * f, 3) for f in scenario.rate_fractions]


def _workload(scenario: Scenario, num: int, seed: int, vocab_size: int):
    return build_workload(num, scenario.input_len, scenario.output_len, vocab_size, seed=seed,
                          range_ratio=scenario.range_ratio, shared_prefix_len=scenario.shared_prefix_len,
                          num_prefixes=scenario.num_prefixes)  # fmt: skip


def _sim_requests(scenario: Scenario, num: int, rate: float, seed: int, vocab_size: int = 32000):
    from kvserve.sim.workload import from_lists

    w = _workload(scenario, num, seed, vocab_size)
    return from_lists(w.prompts, w.output_lens, send_times_s(interarrival_gaps_s(num, rate, 1.0, seed)))


def _instance_spec(scenario: Scenario):
    from kvserve.sim.instance import InstanceSpec

    return InstanceSpec(kv_cache_memory=scenario.flag("--kv-cache-memory", "1GiB"),
                        long_prefill_token_threshold=int(scenario.flag("--long-prefill-token-threshold", "0")))  # fmt: skip


def _model_flags(args) -> list[str]:
    return (["--model", args.model] if args.model else []) + (["--threads", str(args.threads)] if args.threads else [])


def run(args) -> int:
    from kvserve.sim.measure_server import probe_server, start_server, stop_server
    from kvserve.sim.simulator import Deployment, Simulator
    from kvserve.sim.step_model import load_step_model

    if args.num_prompts < 1:
        raise BenchError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    from kvserve.bench.machine import contention_before_run

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
                probe_before = probe_server(base, model_name, 20_000 + seed, vocab) if reference else None
                w = _workload(scenario, args.num_prompts, seed, vocab)
                records, duration = run_at_rate(base, model_name, w.prompts, [len(p) for p in w.prompts], w.output_lens,
                                                rate=rate, burstiness=1.0, max_concurrency=None, seed=seed, timeout_s=600,
                                                progress=sys.stderr.isatty())  # fmt: skip
                measured = load_metrics(records, duration, SLO())
                if measured["failed"]:
                    raise BenchError(f"{scenario.name} at {rate} req/s: {measured['failed']} request(s) failed: {measured['errors']}")
                factors = (1.0, 1.0)  # prefill, decode
                if reference:
                    after = probe_server(base, model_name, 30_000 + seed, vocab)
                    factors = tuple((probe_before[k] + after[k]) / 2 / reference[k] for k in ("ttft_s", "tpot_s"))
                scaled = Simulator(sim.deployment, model.scaled(decode=factors[1], prefill=factors[0]))
                from kvserve.sim.report import summary

                predicted = summary(scaled.run(_sim_requests(scenario, args.num_prompts, rate, seed, vocab)))
                results.append({"scenario": scenario.name, "rate_req_per_s": rate, "speed_factors": {"prefill": factors[0], "decode": factors[1]},
                                "predicted": _stats(predicted), "measured": _stats(measured),
                                "predicted_preemptions": predicted["preemptions"], "measured_preemptions": None,
                                "predicted_prefix_hit_rate": predicted["prefix_cache_hit_rate"]})  # fmt: skip
        finally:
            stop_server(proc)
    _render(results, model, console)
    if args.json:
        from kvserve.bench.machine import envelope

        step_model = {k: v for k, v in model.as_dict().items() if k != "meta"}
        step_model["meta"] = {k: v for k, v in model.meta.items() if k != "samples"}  # the samples stay in the model file
        data = envelope("sim-vs-real", vars(args), {"step_model": step_model, "results": results}, before)
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
        console.print(f"wrote {args.json}", highlight=False)
    return 0


def _cell(row: dict, key: str) -> str:
    p, m = row["predicted"][key], row["measured"][key]
    err = _relative(p, m)
    return "—" if err is None else f"{p:.1f} / {m:.1f} ({err:+.0%})"


def _render(results: list[dict], model, console: Console) -> None:
    console.print(f"step model: {model.label or model.source}", markup=False, highlight=False)
    table = Table(title="simulated / measured, ms (relative error)", title_justify="left")
    for name in ("scenario", "rate", "slower ×", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90"):
        table.add_column(name, no_wrap=True)
    for row in results:
        table.add_row(row["scenario"], f"{row['rate_req_per_s']:.3g}", f"{row['speed_factors']['prefill']:.2f}/{row['speed_factors']['decode']:.2f}", _cell(row, "ttft_median"),
                      _cell(row, "ttft_p90"), _cell(row, "tpot_median"), _cell(row, "tpot_p90"))  # fmt: skip
    console.print(table)
    within = [abs(_relative(r["predicted"][k], r["measured"][k]) or 0) <= (0.10 if "median" in k else 0.15)
              for r in results for k in r["predicted"]]  # fmt: skip
    console.print(f"{sum(within)} of {len(within)} figures within the target (p50 ±10%, p90 ±15%)", highlight=False)
