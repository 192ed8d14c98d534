"""`kvserve plan calibrate --engine`: measure kvserve's steps on this machine and fit the step model.

Loads the engine as `kvserve serve` would (same flags), times it over the grid (measure.py),
fits the coefficients (step_model.fit) and saves them with what they were measured on and how
well they fit: the error on the fitted steps per kind, and on held-out shapes the fit never
saw. The samples are kept in the file, so a refit needs no new measurement.
"""

from __future__ import annotations

import platform
from datetime import datetime, timezone
from pathlib import Path

from kvserve.sim.measure import Grid, Sample, measure, num_points
from kvserve.sim.step_model import StepTimeModel, default_model_path, errors, fit


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrate_engine(config, grid: Grid = Grid(), output: str | Path | None = None, progress: bool = False,
                     seed: int = 0) -> tuple[StepTimeModel, dict, Path]:  # fmt: skip
    """Measure the engine `config` describes; returns (model, its errors, the file written)."""
    from tqdm import tqdm

    from kvserve.engine.engine import LLMEngine

    engine = LLMEngine(config)
    try:
        with tqdm(total=num_points(grid), desc="timing engine steps", unit="shape", disable=not progress, leave=False) as bar:
            samples = measure(engine, grid, seed=seed, progress=lambda: bar.update(1))
        arch = engine.arch
        model = fit(
            samples, label=f"fitted: kvserve on {_cpu_name()} ({engine.model_name})", model_name=engine.model_name,
            num_layers=arch.num_layers, d_model=arch.hidden_size, kv_bytes_per_position=float(engine.layout.kv_bytes_per_position),
            model_len=_model_len(config, arch),
        )  # fmt: skip
        errs = errors(model, samples)
        described = StepTimeModel(**{**model.__dict__, "meta": {
            "measured_at": datetime.now(timezone.utc).isoformat(), "cpu": _cpu_name(), "torch_threads": _threads(),
            "engine": {"model": engine.model_name, "dtype": str(config.torch_dtype).removeprefix("torch."),
                       "quantization": config.quantization, "kv_cache_dtype": config.kv_cache_dtype,
                       "block_size": config.block_size, "max_num_batched_tokens": config.max_num_batched_tokens},
            "errors": errs, "samples": [s.as_dict() for s in samples],
        }})  # fmt: skip
    finally:
        engine.close()
    path = described.save(output or default_model_path())
    return described, errs, path


def _model_len(config, arch) -> int:
    """The context before the pool caps it (the simulator applies its own pool), as the engine takes it."""
    if config.max_model_len:
        return config.max_model_len
    if arch.sliding_window and arch.sliding_window < arch.max_position_embeddings:
        return arch.sliding_window
    return arch.max_position_embeddings


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def refit(model: StepTimeModel) -> StepTimeModel:
    """The same samples fitted again (after a change to the fit), keeping the description."""
    samples = [Sample.from_dict(d) for d in model.meta.get("samples", [])]
    fields = {k: getattr(model, k) for k in ("label", "model_name", "num_layers", "d_model", "kv_bytes_per_position", "model_len")}
    again = fit(samples, **fields)
    return StepTimeModel(**{**again.__dict__, "meta": {**model.meta, "errors": errors(again, samples)}})
