"""The web playground: a chat page at `/`, a live view of the engine, and a planner page.

Pages and their assets are static files shipped in the package (`server/static/`, no CDN,
no build step). They are served without the API key: they hold code, never data. Every
piece of data they show comes from a JSON route under `/v1/`, which `APIKeyAuth` guards
like the rest of the API when the server has `--api-key`; the page asks for the key,
keeps it in the browser's localStorage and sends it as `Authorization: Bearer <key>`.

JSON routes added here:

    GET /v1/engine/stats    the figures /metrics exports, as one JSON object (read from
                            the same registry, so the two never disagree)
    GET /v1/planner/presets the model and chip names /v1/planner/sweep accepts
    GET /v1/planner/sweep   the planner's step time and throughput against decode batch
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

from kvserve.errors import ConfigError
from kvserve.server.context import ServingContext
from kvserve.server.errors import APIError

STATIC_DIR = Path(__file__).with_name("static")
SERVED = "served"  # the planner's name for the model this server runs
DEFAULT_CHIP = "h100"

# the browser revalidates every time (cheap: a 304 on the ETag), so a new kvserve never
# runs against a cached page of the old one
_NO_CACHE = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

_MAX_SWEEP_POINTS = 1000
_MAX_BATCH = 1_000_000
_HISTOGRAMS = {
    "ttft": "time_to_first_token_seconds",
    "itl": "inter_token_latency_seconds",
    "tpot": "request_time_per_output_token_seconds",
    "e2e": "e2e_request_latency_seconds",
    "queue_time": "request_queue_time_seconds",
}


class _Static(StaticFiles):
    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers.update(_NO_CACHE)
        return response


def install_playground(app: FastAPI, ctx: ServingContext) -> None:
    """Add the pages (no key: static code) and their JSON routes (under /v1: keyed)."""

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8", headers=_NO_CACHE)

    app.mount("/playground", _Static(directory=STATIC_DIR, html=True), name="playground")

    @app.get("/v1/engine/stats")
    async def engine_stats() -> dict:
        return stats(ctx)

    @app.get("/v1/planner/presets")
    async def planner_presets() -> dict:
        return presets(ctx)

    @app.get("/v1/planner/sweep")
    async def planner_sweep(raw: Request) -> dict:
        return sweep(ctx, dict(raw.query_params))


# --- the live view --------------------------------------------------------------------------


def stats(ctx: ServingContext) -> dict:
    """One snapshot of the server's metrics registry (the one /metrics renders).

    Counters are totals since start; the page turns them into rates from the
    difference between two polls (`time` is the server's clock at the snapshot).
    """
    samples: dict[str, float] = {}
    buckets: dict[str, list[tuple[float, float]]] = {}
    finished: dict[str, int] = {}
    for family in ctx.metrics.registry.collect():
        for s in family.samples:
            name = s.name.removeprefix("kvserve:")
            if name.endswith("_bucket"):
                buckets.setdefault(name[: -len("_bucket")], []).append((float(s.labels["le"]), s.value))
            elif name == "request_success_total":
                finished[s.labels["finished_reason"]] = int(s.value)
            else:
                samples[name] = s.value

    queries, hits = samples.get("prefix_cache_queries_total", 0), samples.get("prefix_cache_hits_total", 0)
    return {
        "object": "engine.stats",
        "model": ctx.model_name,
        "time": time.time(),
        "engine_alive": ctx.engine_alive(),
        "running": int(samples.get("num_requests_running", 0)),
        "waiting": int(samples.get("num_requests_waiting", 0)),
        "kv_cache": {
            "usage": samples.get("kv_cache_usage_perc", 0.0),
            "blocks_total": int(samples.get("kv_cache_blocks_total", 0)),
            "blocks_free": int(samples.get("kv_cache_blocks_free", 0)),
        },
        "prefix_cache": {"queries": int(queries), "hits": int(hits), "hit_rate": hits / queries if queries else None},
        "preemptions": int(samples.get("num_preemptions_total", 0)),
        "prompt_tokens": int(samples.get("prompt_tokens_total", 0)),
        "generation_tokens": int(samples.get("generation_tokens_total", 0)),
        "requests_finished": finished,
        "latency": {key: _histogram(samples, buckets, name) for key, name in _HISTOGRAMS.items()},
        "kernels": _kernels(ctx),
        "experts": _experts(samples),
    }


def _experts(samples: dict) -> dict | None:
    """A mixture of experts' routed-expert counters (model/moe.py ExpertCounts), with the
    experts run per sparse layer pass; None for a dense model."""
    if "moe_layer_passes_total" not in samples:
        return None
    passes, touched = int(samples["moe_layer_passes_total"]), int(samples["moe_experts_touched_total"])
    return {
        "layer_passes": passes,
        "experts_touched": touched,
        "experts_per_layer": touched / passes if passes else None,
        "weight_bytes_read": int(samples["moe_expert_weight_bytes_read_total"]),
        "weight_bytes_dense_equivalent": int(samples["moe_expert_weight_bytes_dense_equivalent_total"]),
    }


def _kernels(ctx: ServingContext) -> dict:
    """The CPU kernels' ISA level and each family's (null level where they are off)."""
    support = ctx.engine.engine.kernels
    return {"level": support.level, "families": dict(support.families)}


def _histogram(samples: dict, buckets: dict, name: str) -> dict:
    count, total = int(samples.get(f"{name}_count", 0)), samples.get(f"{name}_sum", 0.0)
    cumulative = sorted(buckets.get(name, []))
    return {
        "count": count,
        "sum_s": total,
        "mean_s": total / count if count else None,
        "p50_s": _quantile(cumulative, 0.5),
        "p90_s": _quantile(cumulative, 0.9),
        "p99_s": _quantile(cumulative, 0.99),
    }


def _quantile(cumulative: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket holding the q-th observation."""
    if not cumulative or cumulative[-1][1] == 0:
        return None
    rank = q * cumulative[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # beyond the last finite bucket: its bound is all we know
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


# --- the planner ----------------------------------------------------------------------------


def _served_shape(ctx: ServingContext):
    from kvserve.planner.models import PlannedModel

    arch = ctx.engine.engine.arch
    return PlannedModel(ctx.model_name, arch, arch.num_params, note=f"the model this server runs ({arch.architecture})")


def _chips() -> dict:
    from kvserve.planner import hardware

    chips = dict(hardware.PRESETS)
    if hardware.local_chip_path().exists():  # `kvserve plan calibrate` measured this machine
        try:
            chips[hardware.LOCAL] = hardware.load_local_chip()
        except ConfigError:
            pass
    return chips


def presets(ctx: ServingContext) -> dict:
    from kvserve.planner.models import PRESETS

    models = [_shape_json(_served_shape(ctx), SERVED)] + [_shape_json(m, name) for name, m in PRESETS.items()]
    return {"models": models, "chips": [_chip_json(c, name) for name, c in _chips().items()], "default_model": SERVED, "default_chip": DEFAULT_CHIP}


def _shape_json(m, key: str) -> dict:
    from kvserve.planner.models import SEED_NAMES

    shape = m.as_json()
    return {"key": key, **{k: shape[k] for k in ("name", *SEED_NAMES, "num_params", "note")}}


def _chip_json(c, key: str) -> dict:
    return {
        "key": key, "name": c.name, "hbm_bytes": c.hbm_bytes, "hbm_bytes_per_s": c.hbm_bytes_per_s,
        "peak_flops_per_s": c.peak_flops_per_s, "note": c.note,
    }


def _number(query: dict, name: str, default, kind=float):
    raw = query.get(name, "")
    if raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise APIError(400, f"{name} must be a{'n integer' if kind is int else ' number'}, got {raw!r}", param=name) from None
    if isinstance(value, float) and not math.isfinite(value):
        raise APIError(400, f"{name} must be finite, got {raw!r}", param=name)
    return value


def _batches(query: dict, plan) -> list[int]:
    """`batches=1,2,8` as given; else a geometric sweep (four points an octave) up to
    `max_batch`, or to the range `kvserve plan run --plot` draws, with the batches the
    plan marks (capacity, B*, the decode batch) added."""
    from kvserve.planner.plot import _batch_range

    if query.get("batches"):
        try:
            wanted = sorted({int(b) for b in query["batches"].split(",") if b.strip()})
        except ValueError:
            raise APIError(400, f"batches must be integers separated by commas, got {query['batches']!r}", param="batches") from None
        if not wanted or wanted[0] < 1 or wanted[-1] > _MAX_BATCH or len(wanted) > _MAX_SWEEP_POINTS:
            raise APIError(400, f"batches: 1 to {_MAX_SWEEP_POINTS} sizes, each 1 to {_MAX_BATCH}", param="batches")
        return wanted
    top = _number(query, "max_batch", None, int)
    if top is None:
        top = _batch_range(plan).stop - 1
    elif not 1 <= top <= _MAX_BATCH:
        raise APIError(400, f"max_batch must be 1 to {_MAX_BATCH}, got {top}", param="max_batch")
    points = {max(1, round(2 ** (k / 4))) for k in range(int(4 * math.log2(top)) + 1)} | {top}
    d = plan.derived
    marks = {d.capacity_batch(), d.decode_batch, math.floor(plan["critical_batch"]), math.ceil(plan["critical_batch"])}
    return sorted(b for b in points | marks if 1 <= b <= top)


def sweep(ctx: ServingContext, query: dict) -> dict:
    """Run the planner (`make_plan`, the code behind `kvserve plan run`) for one model and
    chip, then its staged step time (`Derived.step`) at each batch of the sweep."""
    from kvserve.planner import capacity
    from kvserve.planner.inputs import PlanInputs
    from kvserve.planner.models import PRESETS
    from kvserve.planner.plan import make_plan

    model_key, chip_key = query.get("model") or SERVED, query.get("chip") or DEFAULT_CHIP
    # names only: a web request never makes the server open a path of its choosing
    if model_key == SERVED:
        model = _served_shape(ctx)
    elif model_key in PRESETS:
        model = PRESETS[model_key]
    else:
        raise APIError(400, f"unknown model {model_key!r}; use one of {', '.join([SERVED, *PRESETS])}", param="model")
    chips = _chips()
    if chip_key not in chips:
        raise APIError(400, f"unknown chip {chip_key!r}; use one of {', '.join(chips)}", param="chip")
    chip = chips[chip_key]
    context = _number(query, "context_positions", 4096, int)
    try:
        inputs = PlanInputs(
            model=model, chip=chip, num_chips=_number(query, "num_chips", 1, int),
            bytes_per_weight=_number(query, "bytes_per_weight", 2.0),
            bytes_per_kv_element=_number(query, "bytes_per_kv_element", 2.0),
            reserved_bytes_per_chip=_number(query, "reserved_gb_per_chip", 0.0) * 1e9,
            kv_layout=query.get("kv_layout") or "heads",
            history_positions=context, prompt_positions=context,
            output_tokens=_number(query, "output_tokens", 512, int),
            step_target_s=_number(query, "step_target_ms", 50.0) * 1e-3,
        )
        plan = make_plan(inputs)
        d = plan.derived
        cap = d.capacity_batch()
        points = []
        for b in _batches(query, plan):
            step = d.step(b)
            points.append({
                "batch": b, "step_s": step.total_s, "projection_s": step.projection_s,
                "projection_compute_s": step.projection_compute_s, "weight_read_s": step.weight_read_s,
                "kv_read_s": step.kv_read_s, "exchange_s": step.exchange_s, "branch": step.branch,
                "tokens_per_s": capacity.tokens_per_s(b, step.total_s),
                "tokens_per_s_per_chip": capacity.tokens_per_s_per_chip(b, step.total_s, inputs.num_chips),
                "fits": b <= cap, "meets_target": step.total_s <= inputs.step_target_s,
            })
    except ConfigError as exc:
        raise APIError(400, str(exc), param=exc.field.split(" ")[0]) from exc
    return {
        "object": "planner.sweep",
        "model": _shape_json(model, model_key),
        "chip": _chip_json(chip, chip_key),
        "inputs": {
            "num_chips": inputs.num_chips, "context_positions": context, "output_tokens": inputs.output_tokens,
            "step_target_s": inputs.step_target_s, "bytes_per_weight": inputs.bytes_per_weight,
            "bytes_per_kv_element": inputs.bytes_per_kv_element, "reserved_bytes_per_chip": inputs.reserved_bytes_per_chip,
            "kv_layout": inputs.kv_layout,
        },
        "capacity_batch": cap,
        "critical_batch": plan["critical_batch"],
        "max_batch_meeting_target": d.max_batch_meeting_target(),
        "decode_batch": d.decode_batch,
        "decode_batch_note": d.decode_batch_note,
        "decode_step_s": d.decode_step.total_s,
        "decode_tokens_per_s": capacity.tokens_per_s(d.decode_batch, d.decode_step.total_s),
        "points": points,
    }
