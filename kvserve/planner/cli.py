"""`kvserve plan …`: run | examples | calibrate | presets.

Flags take convenient units named in the flag (`--step-target-ms`, `--hbm-gb`); they
are converted once here to the API's base units (seconds, bytes). A bad value comes
back as one line naming the API field and the flag. The commands the simulator backs
(`plan check-sim`, `plan calibrate --engine`) are added by kvserve/sim/plan_commands.py,
since the simulator sits above the planner.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from kvserve.errors import ConfigError
from kvserve.arch import ModelArchitecture
from kvserve.planner import formats, hardware, models
from kvserve.planner.layout import KV_LAYOUTS

GB, MS, US = 1e9, 1e-3, 1e-6

# API field -> flag, so a ConfigError names what the user typed
_FLAGS = {
    "num_chips": "--num-chips", "bytes_per_weight": "--bytes-per-weight", "bytes_per_kv_element": "--bytes-per-kv-element",
    "bytes_per_activation": "--bytes-per-activation", "reserved_bytes_per_chip": "--reserved-gb-per-chip",
    "kv_layout": "--kv-layout", "exchange_s_per_step": "--exchange-ms-per-step", "history_positions": "--history-positions",
    "prompt_positions": "--prompt-positions", "output_tokens": "--output-tokens", "new_positions": "--new-positions",
    "shared_prefix_positions": "--shared-prefix-positions", "shared_prefix_reads": "--shared-prefix-reads",
    "kv_block_positions": "--kv-block-positions",
    "step_target_s": "--step-target-ms", "utilisation": "--utilisation", "batch": "--batch",
    "replica_chips": "--replica-chips", "prefill_groups": "--prefill-groups", "handoff_bytes_per_s": "--handoff-gb-per-s",
    "target_rate_req_per_s": "--target-rate-req-per-s", "arrival_rate_req_per_s": "--arrival-rate-req-per-s",
    "hbm_bytes": "--hbm-gb", "hbm_bytes_per_s": "--hbm-gb-per-s", "peak_flops_per_s": "--peak-tflops",
    "cost_usd_per_chip_s": "--chip-cost-usd-per-hour", "link_bytes_per_s": "--link-gb-per-s",
    "link_latency_s": "--link-latency-us", "model": "--model", "chip": "--chip",
    "kv_scale_bytes": "--kv-cache-dtype", "weight_format": "--quantization", "kv_cache_dtype": "--kv-cache-dtype",
    **{f: "--" + f.replace("_", "-") for f in (*models.SEED_NAMES, "num_params")},
}


def register(subparsers) -> None:
    plan = subparsers.add_parser("plan", help="inference arithmetic: what batch fits, how fast, at what cost",
                                 description="The seed's inference arithmetic for any model and chip.")
    sub = plan.add_subparsers(dest="plan_command", metavar="PLAN_COMMAND")
    # plan_commands: for the rooms above the planner to add theirs (kvserve/sim/plan_commands.py)
    plan.set_defaults(func=lambda args: (plan.print_help(), 2)[1], plan_commands=sub)

    run = sub.add_parser("run", help="compute every quantity for one model, chip and workload")
    add_run_flags(run)
    run.set_defaults(func=_run)

    examples = sub.add_parser("examples", help="recompute the seed's worked examples; exit 1 on a mismatch")
    examples.add_argument("--json", action="store_true", help="print JSON instead of a table")
    examples.set_defaults(func=_examples)

    calibrate = sub.add_parser("calibrate", help="measure this machine as the `local` chip (--engine: kvserve's own "
                               "step times, fitted for `kvserve sim`)")
    calibrate.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    calibrate.add_argument("--read-mb", type=float, help="tensor summed for bandwidth, MiB (default 256 cpu, 2048 cuda)")
    calibrate.add_argument("--matmul-size", type=int, help="n of the n×n bf16 matmul (default 2048 cpu, 8192 cuda)")
    calibrate.add_argument("--seconds", type=float, default=1.0, help="time budget per measurement (default 1)")
    calibrate.add_argument("--chip-cost-usd-per-hour", type=float, help="price to store with the measurement")
    calibrate.add_argument("--collectives", action=argparse.BooleanOptionalAction, default=True,
                           help="time a two-rank gloo AllReduce on this host for the TP link's α and bandwidth (default on)")
    calibrate.set_defaults(func=_calibrate)

    presets = sub.add_parser("presets", help="list model and chip presets")
    presets.set_defaults(func=_presets)


def add_run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True, help=f"preset ({', '.join(models.PRESETS)}), a .gguf, a config.json "
                   "(or its directory), or `custom` with every shape flag")
    for flag in models.SEED_NAMES:
        g.add_argument("--" + flag.replace("_", "-"), type=int, help="override the model's value")
    g.add_argument("--num-params", type=float, help="P; default: the source's, or counted from Llama shapes")
    g = p.add_argument_group("chip")
    g.add_argument("--chip", required=True, help=f"preset: {', '.join([*hardware.PRESETS, hardware.LOCAL])}")
    g.add_argument("--hbm-gb", type=float, help="HBM per chip H_mem, GB (1e9 B)")
    g.add_argument("--hbm-gb-per-s", type=float, help="HBM bandwidth β, GB/s")
    g.add_argument("--peak-tflops", type=float, help="peak bf16 FLOP/s C, in 1e12")
    g.add_argument("--chip-cost-usd-per-hour", type=float, help="price c per chip-hour")
    g.add_argument("--link-gb-per-s", type=float, help="TP link bandwidth, GB/s one way")
    g.add_argument("--link-latency-us", type=float, help="collective start-up α, µs")
    g = p.add_argument_group("deployment")
    g.add_argument("--num-chips", type=int, default=1, help="N chips in one model replica (default 1)")
    g.add_argument("--quantization", metavar="NAME",
                   help=f"p_w from the engine's weight format: {', '.join(formats.QUANTIZATIONS)} (auto: a .gguf's own "
                   "tensor bytes, else bf16); instead of --bytes-per-weight")
    g.add_argument("--kv-cache-dtype", metavar="NAME",
                   help=f"p_kv from the engine's KV cache type: {', '.join(formats.KV_CACHE_DTYPES)} (int8 adds its "
                   "fp32 scale per position and KV head); instead of --bytes-per-kv-element")
    g.add_argument("--bytes-per-weight", type=float, help="p_w (default 2 = bf16; 1 = int8)")
    g.add_argument("--bytes-per-kv-element", type=float, help="p_kv (default 2)")
    g.add_argument("--bytes-per-activation", type=float, default=2.0, help="p_a of TP collectives (default 2)")
    g.add_argument("--reserved-gb-per-chip", type=float, default=0.0, help="R: workspace and other use, GB (default 0)")
    g.add_argument("--kv-layout", choices=KV_LAYOUTS, default="heads",
                   help="heads: full Query heads per chip, KV replicated past N_kv chips; requests: whole requests per chip")
    g.add_argument("--exchange-ms-per-step", type=float, default=0.0, help="Q/output reshuffle of the requests layout, ms")
    g = p.add_argument_group("workload")
    g.add_argument("--prompt-positions", type=int, default=8192, help="prompt length (default 8192)")
    g.add_argument("--history-positions", type=int, help="S cached per request at the decode snapshot (default: prompt)")
    g.add_argument("--output-tokens", type=int, default=512, help="N_out returned per request (default 512)")
    g.add_argument("--new-positions", type=int, help="T for attention work (default N_out − 1)")
    g.add_argument("--shared-prefix-positions", type=int, default=0, help="of S, shared exactly by all requests")
    g.add_argument("--shared-prefix-reads", choices=["once", "per-request"], default="once",
                   help="how a decode step reads the shared prefix: once for all requests (shared-prefix attention, "
                        "the engine's default) or once per request (default once)")
    g.add_argument("--kv-block-positions", type=int, default=16, help="KV page size in positions (default 16)")
    g.add_argument("--step-target-ms", type=float, default=50.0, help="decode step target, ms (default 50)")
    g.add_argument("--utilisation", type=float, default=0.4, help="η of prefill (default 0.4)")
    g.add_argument("--batch", type=int, help="evaluate this decode batch instead of the largest meeting the target")
    g.add_argument("--replica-chips", type=int, help="chips per replica in TP vs replicas (default: fewest that fit)")
    g = p.add_argument_group("disaggregation and cost")
    g.add_argument("--prefill-groups", type=int, default=1, help="prefill groups feeding one decode group (default 1)")
    g.add_argument("--handoff-gb-per-s", type=float, default=10.0, help="prefill→decode link, GB/s (default 10)")
    g.add_argument("--target-rate-req-per-s", type=float, help="rate to size the handoff link for")
    g.add_argument("--arrival-rate-req-per-s", type=float, help="arrival rate for cost below full load")
    g = p.add_argument_group("output")
    g.add_argument("--explain", action="store_true", help="show each formula with numbers substituted")
    g.add_argument("--json", action="store_true", help="print JSON (keys documented in docs/planner.md)")
    g.add_argument("--plot", metavar="FILE", help="write step time, throughput and stage rates to a PNG")


def _scaled(value: float | None, unit: float) -> float | None:
    return None if value is None else value * unit


def _model(args) -> models.PlannedModel:
    shape = {f: getattr(args, f) for f in models.SEED_NAMES}
    if args.model != "custom":
        return models.with_overrides(models.load_model(args.model), **shape, num_params=args.num_params)
    if shape["head_dim"] is None and shape["d_model"] and shape["num_query_heads"]:
        shape["head_dim"] = shape["d_model"] // shape["num_query_heads"]
    missing = [f for f, v in shape.items() if v is None]
    if missing:
        raise ConfigError("model", "custom needs " + ", ".join("--" + f.replace("_", "-") for f in missing))
    arch = ModelArchitecture("llama", **{models.SEED_NAMES[f]: v for f, v in shape.items()})
    return models.PlannedModel("custom", arch, args.num_params or arch.num_params, note="custom shape",
                               architecture_known=False)


def _either(name_flag: str, name: str | None, number_flag: str, number: float | None) -> None:
    if name is not None and number is not None:
        raise ConfigError(name_flag, f"give {name_flag} or {number_flag}, not both (got {name!r} and {number:g})")


def _bytes(args, model: models.PlannedModel) -> dict:
    """p_w, p_kv and the KV scale bytes from the format names or the explicit numbers (default bf16)."""
    _either("--quantization", args.quantization, "--bytes-per-weight", args.bytes_per_weight)
    _either("--kv-cache-dtype", args.kv_cache_dtype, "--bytes-per-kv-element", args.bytes_per_kv_element)
    out = {"bytes_per_weight": 2.0 if args.bytes_per_weight is None else args.bytes_per_weight,
           "bytes_per_kv_element": 2.0 if args.bytes_per_kv_element is None else args.bytes_per_kv_element}
    if args.quantization is not None:
        out["bytes_per_weight"] = formats.weight_format(args.quantization, model).bytes_per_weight
        out["weight_format"] = args.quantization
    if args.kv_cache_dtype is not None:
        kv_format = formats.kv_format(args.kv_cache_dtype)
        out.update(bytes_per_kv_element=kv_format.bytes_per_kv_element, kv_scale_bytes=kv_format.scale_bytes,
                   kv_cache_dtype=args.kv_cache_dtype)
    return out


def build_inputs(args):
    from kvserve.planner.inputs import PlanInputs

    try:
        model = _model(args)
        chip = hardware.with_overrides(
            hardware.get_chip(args.chip), hbm_bytes=_scaled(args.hbm_gb, GB), hbm_bytes_per_s=_scaled(args.hbm_gb_per_s, GB),
            peak_flops_per_s=_scaled(args.peak_tflops, 1e12), cost_usd_per_chip_s=_scaled(args.chip_cost_usd_per_hour, 1 / 3600),
            link_bytes_per_s=_scaled(args.link_gb_per_s, GB), link_latency_s=_scaled(args.link_latency_us, US),
        )
        return PlanInputs(
            model=model, chip=chip, num_chips=args.num_chips, **_bytes(args, model),
            bytes_per_activation=args.bytes_per_activation,
            reserved_bytes_per_chip=args.reserved_gb_per_chip * GB, kv_layout=args.kv_layout,
            exchange_s_per_step=args.exchange_ms_per_step * MS,
            history_positions=args.history_positions or args.prompt_positions, prompt_positions=args.prompt_positions,
            output_tokens=args.output_tokens, new_positions=args.new_positions,
            shared_prefix_positions=args.shared_prefix_positions, shared_prefix_reads=args.shared_prefix_reads,
            kv_block_positions=args.kv_block_positions,
            step_target_s=args.step_target_ms * MS, utilisation=args.utilisation, batch=args.batch,
            replica_chips=args.replica_chips, prefill_groups=args.prefill_groups,
            handoff_bytes_per_s=args.handoff_gb_per_s * GB, target_rate_req_per_s=args.target_rate_req_per_s,
            arrival_rate_req_per_s=args.arrival_rate_req_per_s,
        )
    except ConfigError as exc:
        flag = _FLAGS.get(exc.field)
        if flag is None or exc.field.startswith("--"):
            raise
        raise ConfigError(f"{exc.field} ({flag})", str(exc).split(": ", 1)[1]) from exc


def _run(args) -> int:
    from kvserve.planner import report
    from kvserve.planner.plan import make_plan

    plan = make_plan(build_inputs(args))
    if args.json:
        print(report.plan_json(plan))
    else:
        report.render_plan(plan, Console(), explain=args.explain)
    if args.plot:
        from kvserve.planner.plot import write_plot

        print(f"wrote {write_plot(plan, args.plot)}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _examples(args) -> int:
    from kvserve.planner import report
    from kvserve.planner.examples import all_examples

    rows = all_examples()
    if args.json:
        print(report.examples_json(rows))
    else:
        report.render_examples(rows, Console())
    return 0 if all(e.match is not False for e in rows) else 1


def _calibrate(args) -> int:
    from kvserve.planner.calibrate import calibrate
    from kvserve.planner.hardware import local_chip_path
    from kvserve.planner.quantity import show

    read_bytes = None if args.read_mb is None else int(args.read_mb * 2**20)
    chip = calibrate(args.device, read_bytes, args.matmul_size, args.seconds, args.chip_cost_usd_per_hour,
                     collectives=args.collectives)  # fmt: skip
    print(f"memory {show(chip.hbm_bytes, 'B')}, read bandwidth {show(chip.hbm_bytes_per_s, 'B/s')}, "
          f"bf16 matmul {chip.peak_flops_per_s / 1e9:.4g} GFLOP/s")
    print(f"TP link: α {chip.link_latency_s * 1e6:.1f} µs, {show(chip.link_bytes_per_s, 'B/s')}"
          f"{' (a two-rank gloo AllReduce on this host)' if args.collectives else ' (assumed: memory bandwidth)'}")
    print(f"wrote {local_chip_path()}; use it with --chip local")
    return 0


def _presets(args) -> int:
    console = Console()
    table = Table(title="Model presets", title_justify="left")
    for name in ("name", "L", "D", "F", "N_q", "N_kv", "H", "V", "P"):
        table.add_column(name, no_wrap=True)
    for m in models.PRESETS.values():
        table.add_row(m.name, *(str(getattr(m.arch, f)) for f in models.SEED_NAMES.values()), f"{m.num_params:.4g}")
    console.print(table)
    table = Table(title="Chip presets", title_justify="left")
    for name in ("name", "HBM GB", "β GB/s", "C TFLOP/s", "USD/h", "link GB/s"):
        table.add_column(name, no_wrap=True)
    for c in hardware.PRESETS.values():
        price = "—" if c.cost_usd_per_chip_s is None else f"{c.cost_usd_per_chip_s * 3600:g}"
        table.add_row(c.name, f"{c.hbm_bytes / GB:g}", f"{c.hbm_bytes_per_s / GB:g}", f"{c.peak_flops_per_s / 1e12:g}",
                      price, f"{c.link_bytes_per_s / GB:g}")
    table.add_row(hardware.LOCAL, "measured", "", "", "", "")
    console.print(table)
    for item in [*models.PRESETS.values(), *hardware.PRESETS.values()]:
        console.print(f"{item.name}: {item.note}", markup=False, highlight=False)
    console.print(f"{hardware.LOCAL}: `kvserve plan calibrate` writes {hardware.local_chip_path()}", markup=False, highlight=False)
    return 0
