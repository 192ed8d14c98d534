"""How long one engine step takes, per op group, from its shape (step_shape.py).

    t = fixed + per_chunked_step·[chunks in it] + per_row·rows    fixed per-step cost
      + max(weight_read, per_decode_row·R_d + per_prefill_token·T_p
                         + per_mixed_prefill_token·T_p if R_d > 0)       projections
      + per_decode_kv·KV_d + per_prefill_kv·KV_p + per_pair·pairs       attention
      + per_sample·rows sampled                                          LM head and sampling
      + per_arrival·requests arriving meanwhile                         serving (the event loop's share)

Two ways to get the coefficients, labelled in the model's `source`:
- `fit`: measured on this machine by `kvserve plan calibrate --engine` (measure.py), each
  coefficient non-negative, least squares on relative error (a 5 ms step counts as much as
  a 1 s one). On a CPU a step's parts do not overlap, so the fit keeps `weight_read` at 0 and
  `fixed` holds the small-batch weight read together with Python's per-step cost.
- `datasheet`: a chip's figures fed into the planner's own roofline (planner/roofline.py,
  latency.py): projections max(W/β, 2·P·R_d/C + 2·P·T_p/(C·η)) over all P parameters for
  every position, decode KV reads c_kv/β per position, and nothing the planner leaves out
  (prefill attention pairs, per-step overheads). It extrapolates to hardware nobody measured
  and says so; it agrees with `plan run` by construction, which `kvserve sim check-plan` shows.

Tensor parallelism over N ranks divides the per-rank work by N and adds the planner's
2·L AllReduces of the step's [T, D] activations (planner/parallel.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import numpy as np

from kvserve.errors import ConfigError
from kvserve.paths import cache_root
from kvserve.engine.step_shape import StepShape

MODEL_VERSION = 1
COEFFICIENTS = ("fixed", "per_chunked_step", "per_row", "per_decode_row", "per_prefill_token", "per_mixed_prefill_token",
                "per_decode_kv", "per_prefill_kv", "per_pair", "per_sample", "per_arrival")  # fmt: skip
GROUPS = ("fixed", "projections", "attention", "lm_head", "serving")


@dataclasses.dataclass(frozen=True)
class StepTimeModel:
    fixed: float = 0.0  # s per step
    # s more per step with prompt chunks: such a step runs layer by layer, not as the fused
    # all-layers decode step, and pays Python's per-layer cost
    per_chunked_step: float = 0.0
    per_row: float = 0.0  # s per scheduled request
    per_decode_row: float = 0.0  # s per decode row through the projections
    per_prefill_token: float = 0.0  # s per prompt position through the projections
    per_mixed_prefill_token: float = 0.0  # s more per prompt position in a step that also decodes
    per_decode_kv: float = 0.0  # s per KV position a decode row's attention reads
    per_prefill_kv: float = 0.0  # s per KV position a prompt chunk's attention reads
    per_pair: float = 0.0  # s per (query, key) pair of a chunk's causal attention
    per_sample: float = 0.0  # s per row through the LM head and sampler (through the server: and its delivery)
    per_arrival: float = 0.0  # s a step is slowed per request the server takes in meanwhile
    weight_read: float = 0.0  # s: the projections' floor, reading every weight once
    # s from a client sending a request to its first token, beyond the steps: HTTP in, admission,
    # the first token's way out (measured through the server; 0 for the engine alone)
    request_overhead: float = 0.0
    # the same, for a request sent while the server is stepping: the HTTP path then shares the
    # cores (and the GIL) with the engine thread and is several times slower; 0: as idle
    busy_request_overhead: float = 0.0
    # the measured overheads behind those two medians: where given, each simulated request
    # draws its own (a tail of slow HTTP handling moves TTFT's p90, which one figure cannot)
    request_overhead_samples: tuple[float, ...] = ()
    busy_request_overhead_samples: tuple[float, ...] = ()
    source: str = "fit"  # fit | datasheet
    label: str = ""  # where the figures came from, for reports
    model_name: str = ""
    num_layers: int = 0  # for the TP communication term
    d_model: int = 0
    num_kv_heads: int = 0  # what tensor parallelism can split attention into (0: unknown, split N ways)
    kv_bytes_per_position: float = 0.0  # c_kv of the engine's pool: how many blocks a KV memory holds
    model_len: int = 0  # the model's context, before the pool caps it
    # each layer's sliding window (None: global); the pool holds windowed layers to their
    # window (engine/kv_groups.py) as the engine does. Empty: every layer global
    layer_windows: tuple[int | None, ...] = ()
    # a mixture of experts (planner/moe.py): E experts, k chosen per token, and the share of the
    # weight read that is routed experts; a step of T tokens then reads
    # weight_read·(1 − share + share·E_touched(T)/E). 0: a dense model
    moe_num_experts: int = 0
    moe_top_k: int = 0
    moe_routed_share: float = 0.0
    meta: dict = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in (*COEFFICIENTS, "weight_read", "request_overhead", "busy_request_overhead"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError("step model", f"{name} must be a finite number >= 0, got {value!r}")
        if self.source not in ("fit", "datasheet"):
            raise ConfigError("step model", f"source must be fit or datasheet, got {self.source!r}")
        for name in _SAMPLES:
            values = getattr(self, name)
            if not isinstance(values, (list, tuple)) or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
                raise ConfigError("step model", f"{name} must be a list of finite numbers, got {values!r}")
            object.__setattr__(self, name, tuple(float(v) for v in values))  # a JSON list in, hashable here

    def groups(self, shape: StepShape) -> dict[str, float]:
        """Seconds per op group for one step on one rank."""
        s = shape
        return {
            "fixed": self.fixed + self.per_chunked_step * (s.prefill_rows > 0) + self.per_row * s.rows,
            "projections": max(self.weight_read * self.read_fraction(s.decode_rows + s.prefill_tokens),
                               self.per_decode_row * s.decode_rows + self.per_prefill_token * s.prefill_tokens
                               + self.per_mixed_prefill_token * s.mixed_prefill_tokens),
            "attention": self.per_decode_kv * s.decode_kv_positions + self.per_prefill_kv * s.prefill_kv_positions
            + self.per_pair * s.prefill_pairs,
            "lm_head": self.per_sample * s.sample_rows,
            "serving": self.per_arrival * s.arrivals,
        }

    def read_fraction(self, tokens: int) -> float:
        """The share of the weights a step of `tokens` reads: 1, or a mixture of experts' attention
        and shared weights plus the E·(1 − (1 − k/E)^T) experts per layer its tokens touch."""
        if not self.moe_num_experts or tokens <= 0:
            return 1.0
        e, k = self.moe_num_experts, self.moe_top_k
        return 1 - self.moe_routed_share + self.moe_routed_share * (1 - (1 - k / e) ** tokens)

    def step_s(self, shape: StepShape) -> float:
        return sum(self.groups(shape).values())

    def overhead_s(self, busy: bool, rng: random.Random | None = None) -> float:
        """From a client sending a request to it reaching the scheduler, plus its first token's
        way out: `busy` if the server is stepping when it is sent. With `rng`, one of the
        measured overheads drawn at random, where the model has them; else the median."""
        busy = busy and bool(self.busy_request_overhead or self.busy_request_overhead_samples)
        samples = self.busy_request_overhead_samples if busy else self.request_overhead_samples
        if rng is not None and samples:
            return max(0.0, rng.choice(samples))  # a clock's jitter can put one a hair below 0
        return self.busy_request_overhead if busy else self.request_overhead

    def scaled(self, decode: float, prefill: float | None = None) -> "StepTimeModel":
        """The same machine found slower (> 1) or faster now, as probes measured in the same
        sitting say (bench sim-vs-real): the per-step and per-row costs × `decode`, the prompt
        positions' costs and the request overhead × `prefill` (default: `decode`). Two factors,
        since a neighbour's load slows memory-bound decoding and compute-bound prefill unequally."""
        prefill = decode if prefill is None else prefill
        if not (decode > 0 and prefill > 0):
            raise ConfigError("step model", f"scale factors must be > 0, got {decode} and {prefill}")
        samples = {k: tuple(v * prefill for v in getattr(self, k)) for k in _SAMPLES}
        return dataclasses.replace(self, **samples, **{k: getattr(self, k) * (prefill if k in _PREFILL_COSTS else decode)
                                                       for k in (*COEFFICIENTS, "weight_read", *_OVERHEADS)})

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["kvserve_step_model_version"] = MODEL_VERSION
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "StepTimeModel":
        if not isinstance(data, dict) or data.get("kvserve_step_model_version") != MODEL_VERSION:
            raise ConfigError("step model", f"not a version-{MODEL_VERSION} step model (rerun `kvserve plan calibrate --engine`)")
        fields = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        if "layer_windows" in fields:  # JSON gives a list
            fields["layer_windows"] = tuple(fields["layer_windows"])
        return cls(**fields)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=2) + "\n")
        return path


_OVERHEADS = ("request_overhead", "busy_request_overhead")
_SAMPLES = ("request_overhead_samples", "busy_request_overhead_samples")
_PREFILL_COSTS = ("per_prefill_token", "per_mixed_prefill_token", "per_prefill_kv", "per_pair", *_OVERHEADS)


def default_model_path() -> Path:
    """Where `plan calibrate --engine` writes unless told otherwise (kvserve's cache directory)."""
    return cache_root() / "step_model.json"


def load_step_model(path: str | Path | None = None) -> StepTimeModel:
    path = Path(path) if path else default_model_path()
    if not path.exists():
        raise ConfigError("step model", f"no step model at {path} (--step-model); run `kvserve plan calibrate --engine` first")
    try:
        return StepTimeModel.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError, KeyError) as exc:
        raise ConfigError("step model", f"{path} is not a step model ({exc}); rerun `kvserve plan calibrate --engine`") from exc


# ---- the fit -----------------------------------------------------------------------------

def _features(shape: StepShape) -> list[float]:
    s = shape
    return [1.0, float(s.prefill_rows > 0), s.rows, s.decode_rows, s.prefill_tokens, s.mixed_prefill_tokens, s.decode_kv_positions,
            s.prefill_kv_positions, s.prefill_pairs, s.sample_rows, s.arrivals]  # fmt: skip


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: solve on the free set, drop the most negative, repeat."""
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0
            x[free] = sol
            return x
        free.pop(int(np.argmin(sol)))
    return x


def fit(samples, kinds: tuple[str, ...] = ("prefill", "decode", "mixed"), **described) -> StepTimeModel:
    """The coefficients that best explain the samples of `kinds` (relative least squares);
    `described`: the model's descriptive fields (label, model_name, num_layers, ...)."""
    used = [s for s in samples if s.kind in kinds and not s.held_out and s.seconds > 0]
    if len(used) < len(COEFFICIENTS):
        raise ConfigError("step model", f"{len(used)} measured steps cannot fit {len(COEFFICIENTS)} coefficients")
    a = np.array([_features(s.shape) for s in used], dtype=np.float64)
    t = np.array([s.seconds for s in used], dtype=np.float64)
    # scale columns to unit size so the solver treats them alike, then weight rows by 1/t
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    x = _nnls(a / scale / t[:, None], np.ones_like(t)) / scale
    return StepTimeModel(**dict(zip(COEFFICIENTS, map(float, x))), source="fit", **described)


def errors(model: StepTimeModel, samples) -> dict[str, dict[str, float]]:
    """Per kind of step (and the held-out steps apart): the relative error of the model, as the
    median and the worst |predicted/measured − 1|."""
    out: dict[str, dict[str, float]] = {}
    for key in sorted({s.kind for s in samples if not s.held_out}) + ["held_out"]:
        rel = [abs(model.step_s(s.shape) / s.seconds - 1) for s in samples
               if (s.held_out if key == "held_out" else s.kind == key and not s.held_out)]  # fmt: skip
        if rel:
            out[key] = {"steps": len(rel), "median": float(np.median(rel)), "max": float(np.max(rel))}
    return out


# ---- the datasheet model -----------------------------------------------------------------

def from_datasheet(model, chip, bytes_per_weight: float, kv_bytes_per_position: float, utilisation: float,
                   model_len: int = 1 << 20) -> StepTimeModel:  # fmt: skip
    """The planner's roofline as a step model (`model`: planner.models.PlannedModel, `chip`: planner.hardware.Chip):
    its step time on one chip for one decode row reading one KV position gives the projections'
    compute per row, the weight read and the KV read per position; its prefill time of one
    position, the cost per prompt position."""
    from kvserve.planner import latency, layout, moe, roofline

    p, c, beta, a = model.num_params, chip.peak_flops_per_s, chip.hbm_bytes_per_s, model.arch
    placement = layout.place("heads", 1, p, bytes_per_weight, a.num_kv_heads, kv_bytes_per_position)
    one = roofline.step_time(placement, 1, c, beta)
    experts = moe.expert_shape(a, p)  # a mixture: compute by the active parameters, the read by the tokens' experts
    active = p if experts is None else experts.active_params
    return StepTimeModel(
        per_decode_row=roofline.step_time(placement, 1, c, beta, experts=experts).projection_compute_s,
        per_prefill_token=latency.prefill_time_s(active, 1, 1, c, utilisation),
        per_decode_kv=one.kv_read_s, weight_read=one.weight_read_s, source="datasheet",
        moe_num_experts=a.num_experts, moe_top_k=a.num_experts_per_tok,
        moe_routed_share=0.0 if experts is None else experts.routed_params / experts.num_params,
        label=f"datasheet: {chip.name} (β {beta / 1e9:.4g} GB/s, C {c / 1e12:.4g} TFLOP/s, η {utilisation:g}), "
              "the planner's roofline; not measured",
        model_name=model.name, num_layers=a.num_layers, d_model=a.hidden_size, num_kv_heads=a.num_kv_heads,
        kv_bytes_per_position=kv_bytes_per_position, model_len=model_len,
        layer_windows=a.layer_windows if any(w is not None for w in a.layer_windows) else (),
    )  # fmt: skip


# ---- tensor parallelism --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """N ranks per instance, kvserve's heads layout: each rank computes 1/N of the projections and
    of the LM head, and the attention of its KV heads (past N_kv ranks the KV heads are
    replicated, so attention divides by N_kv at most); then 2·L AllReduces of the step's [T, D]
    activations (planner/parallel.py). `include_comm=False` leaves them out, as the planner's
    staged step does (it reports them beside it)."""

    size: int = 1
    link_bytes_per_s: float = 1e10
    link_latency_s: float = 1e-5
    bytes_per_activation: float = 2.0
    include_comm: bool = True

    def attention_split(self, model: StepTimeModel) -> int:
        return min(self.size, model.num_kv_heads) if model.num_kv_heads else self.size

    def step_s(self, model: StepTimeModel, shape: StepShape) -> float:
        if self.size == 1:
            return model.step_s(shape)
        g = model.groups(shape)
        work = (g["projections"] + g["lm_head"]) / self.size + g["attention"] / self.attention_split(model)
        comm = 0.0
        if self.include_comm:
            from kvserve.planner.parallel import tp_comm_s_per_step

            comm = tp_comm_s_per_step(model.num_layers, self.size, shape.tokens, model.d_model, self.bytes_per_activation,
                                      self.link_bytes_per_s, self.link_latency_s)  # fmt: skip
        return g["fixed"] + g["serving"] + work + comm
