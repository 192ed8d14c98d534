"""`kvserve plan check-sim` and `kvserve plan calibrate --engine`: the plan commands the simulator backs.

They keep their `plan` spelling (users know them so), but their work is the simulator's
(check_plan.py, calibrate.py), and the planner sits below the simulator: so this room adds
them to the `plan` parser the planner registered (planner/cli.py `plan_commands`), and the
planner imports nothing from here.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from kvserve.errors import ConfigError
from kvserve.planner.cli import add_run_flags, build_inputs


def register(subparsers) -> None:
    """Add to `kvserve plan` (registered before this, kvserve/cli.py)."""
    commands = subparsers.choices["plan"].get_default("plan_commands")
    calibrate = commands.choices["calibrate"]
    _add_engine_calibrate_flags(calibrate)
    chip_calibrate = calibrate.get_default("func")
    calibrate.set_defaults(func=lambda args: _calibrate_engine(args) if args.engine else chip_calibrate(args))

    check = commands.add_parser("check-sim", help="the plan's step time and stage rates against the simulator at "
                                "saturation (same inputs, same roofline): the two tools must agree")  # fmt: skip
    add_run_flags(check)
    check.add_argument("--requests", type=int, help="requests per simulated run (default max(4·B, 64))")
    check.set_defaults(func=_check_sim)


def _add_engine_calibrate_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (with --engine)")
    g.add_argument("--engine", action="store_true",
                   help="time kvserve's own steps over a grid of shapes and fit the step model `kvserve sim` runs on, "
                        "instead of the chip's roofline figures")
    g.add_argument("--model", help="the model to run (default: SmolLM2-135M-Instruct), as kvserve serve takes it")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "int8"])
    g.add_argument("--kv-cache-memory", default="1GiB")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default, as kvserve serve)")
    g.add_argument("--in-process", action="store_true",
                   help="time the engine alone in this process, instead of through a `kvserve serve` it starts "
                        "(whose steps carry what serving adds: what kvserve sim must predict)")
    g.add_argument("--grid", choices=["full", "quick"], default="full",
                   help="full: about two minutes on the default model; quick: seconds, for tests")
    g.add_argument("--output", metavar="FILE", help="where to write the step model (default: kvserve's cache, where "
                   "kvserve sim looks)")


def _engine_flags(args) -> list[str]:
    """The engine flags of `plan calibrate --engine`, as `kvserve serve` takes them."""
    flags = ["--device", args.device, "--dtype", args.dtype, "--quantization", args.quantization,
             "--kv-cache-dtype", args.kv_cache_dtype, "--kv-cache-memory", str(args.kv_cache_memory),
             "--block-size", str(args.block_size), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--threads", str(args.threads)]  # fmt: skip
    if args.model:
        flags += ["--model", args.model]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    return flags


def _calibrate_engine(args) -> int:
    from kvserve.sim.calibrate import calibrate_in_process, calibrate_through_server
    from kvserve.sim.measure import Grid
    from kvserve.sim.step_model import COEFFICIENTS

    grid = Grid.quick() if args.grid == "quick" else Grid()
    if args.in_process:
        from kvserve.engine_args import add_engine_args, engine_config_from_args

        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        config = engine_config_from_args(parser.parse_args(_engine_flags(args)))
        model, errs, path = calibrate_in_process(config, grid, args.output, progress=sys.stderr.isatty())
    else:
        model, errs, path = calibrate_through_server(_engine_flags(args), grid, args.output, progress=sys.stderr.isatty())
    console = Console()
    console.print(model.label, markup=False, highlight=False)
    table = Table(title="fitted step model (seconds)", title_justify="left")
    table.add_column("coefficient")
    table.add_column("value", justify="right")
    for name in (*COEFFICIENTS, "request_overhead", "busy_request_overhead"):
        table.add_row(name, f"{getattr(model, name):.4g}")
    console.print(table)
    table = Table(title="fit error |predicted/measured − 1|", title_justify="left")
    for name in ("steps", "kind", "median", "worst"):
        table.add_column(name)
    for kind, e in errs.items():
        table.add_row(str(e["steps"]), kind.replace("_", " "), f"{e['median']:.1%}", f"{e['max']:.1%}")
    console.print(table)
    print(f"wrote {path}; kvserve sim uses it")
    return 0


def _check_sim(args) -> int:
    from kvserve.sim.check_plan import check

    if args.requests is not None and args.requests < 2:
        raise ConfigError("--requests", f"must be >= 2, got {args.requests}")
    rows = check(build_inputs(args), args.requests)
    if args.json:
        print(json.dumps([{"quantity": r.quantity, "planner": r.planner, "simulator": r.simulator, "unit": r.unit,
                           "difference": r.difference, "note": r.note} for r in rows], indent=2))  # fmt: skip
        return 0
    table = Table(title="plan run (closed form) against kvserve sim (saturated, the same roofline)", title_justify="left")
    for name in ("quantity", "planner", "simulator", "difference", "how the simulator ran"):
        table.add_column(name)
    for r in rows:
        table.add_row(r.quantity, f"{r.planner:.4g} {r.unit}", f"{r.simulator:.4g} {r.unit}", f"{r.difference:+.1%}", r.note)
    Console().print(table)
    return 0
