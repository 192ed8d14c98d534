"""`kvserve plan calibrate --engine`: measure kvserve's steps on this machine and fit the step model.

Two ways to measure, the same grid of shapes (measure.Grid) and the same fit:
- through the server (the default): a `kvserve serve --step-log` with the engine flags
  given, driven by streamed requests (measure_server.py). The step times include what serving
  adds, which is what the simulator must predict: on 2 cores, delivering tokens to the HTTP
  streams and the event loop's share of the cores made a batch-1 decode step ~1.4x the
  engine's alone.
- in process (`--in-process`): the engine alone (measure.py), for the engine's own costs.

The file keeps the coefficients, what they were measured on, the fit's error on the fitted
steps per kind and on held-out shapes the fit never saw, and the samples (`measure.Sample.from_dict`),
so a refit (`step_model.fit`) needs no new measurement.
"""

from __future__ import annotations

import statistics
from datetime import datetime, timezone
from pathlib import Path

from kvserve.loadgen.machine import cpu_model
from kvserve.sim.measure import Grid, Sample, measure, num_points
from kvserve.sim.step_model import StepTimeModel, default_model_path, errors, fit


def _median_overhead(values: list[float]) -> float:
    """The median: a request that met a noisy step says little of the HTTP path's own time."""
    return max(0.0, statistics.median(values)) if values else 0.0


def _fit_and_save(samples: list[Sample], engine: dict, how: str, output, extra: dict) -> tuple[StepTimeModel, dict, Path]:
    """`extra`: what the measurement adds to the file's meta; the request overheads measured
    through a server (request_overheads_s, busy_request_overheads_s) also go into the model."""
    idle, busy = extra.get("request_overheads_s", []), extra.get("busy_request_overheads_s", [])
    model = fit(
        samples, label=f"fitted: kvserve {how} on {cpu_model()} ({engine['model']}, {engine['threads']} threads)",
        model_name=engine["model"], num_layers=engine["num_layers"], d_model=engine["d_model"],
        num_kv_heads=engine.get("num_kv_heads", 0),
        kv_bytes_per_position=float(engine["kv_bytes_per_position"]), model_len=int(engine["model_len"]),
        layer_windows=tuple(engine.get("layer_windows") or ()),
        request_overhead=_median_overhead(idle), busy_request_overhead=_median_overhead(busy),
        request_overhead_samples=tuple(idle), busy_request_overhead_samples=tuple(busy),
    )  # fmt: skip
    errs = errors(model, samples)
    meta = {"measured_at": datetime.now(timezone.utc).isoformat(), "cpu": cpu_model(), "measured": how,
            "engine": {k: v for k, v in engine.items() if k != "kvserve_step_log"}, **extra, "errors": errs,
            "samples": [s.as_dict() for s in samples]}  # fmt: skip
    described = StepTimeModel(**{**model.__dict__, "meta": meta})
    return described, errs, described.save(output or default_model_path())


def calibrate_in_process(config, grid: Grid = Grid(), output: str | Path | None = None, progress: bool = False,
                         seed: int = 0) -> tuple[StepTimeModel, dict, Path]:  # fmt: skip
    """The engine `config` describes, timed in this process; returns (model, its errors, the file)."""
    from tqdm import tqdm

    from kvserve.engine.describe import step_log_header
    from kvserve.engine.engine import LLMEngine

    engine = LLMEngine(config)
    try:
        with tqdm(total=num_points(grid), desc="timing engine steps", unit="shape", disable=not progress, leave=False) as bar:
            samples = measure(engine, grid, seed=seed, progress=lambda: bar.update(1))
        described = step_log_header(engine)
    finally:
        engine.close()
    return _fit_and_save(samples, described, "in process", output, {})


def calibrate_through_server(engine_flags: list[str], grid: Grid = Grid(), output: str | Path | None = None,
                             progress: bool = False, seed: int = 0) -> tuple[StepTimeModel, dict, Path]:  # fmt: skip
    """A `kvserve serve` with `engine_flags`, timed through its step log; returns (model, errors, file)."""
    from tqdm import tqdm

    from kvserve.sim.measure_server import measure_through_server

    with tqdm(total=num_points(grid), desc="timing served steps", unit="shape", disable=not progress, leave=False) as bar:
        samples, found = measure_through_server(engine_flags, grid, seed=seed, progress=lambda: bar.update(1))
    extra = {"engine_flags": engine_flags, "step_log": found["step_log"], "warm_up_steps": found["warm_up_steps"],
             "request_overheads_s": found["request_overheads_s"], "busy_request_overheads_s": found["busy_request_overheads_s"],
             "probe": found["probe"]}  # fmt: skip
    return _fit_and_save(samples, found["engine"], "through its server", output, extra)
