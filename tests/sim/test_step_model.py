"""The step-time model: its fit, its file, its checks, its scaling, the datasheet model and TP."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from kvserve.errors import ConfigError
from kvserve.planner import hardware, models
from kvserve.planner.inputs import PlanInputs
from kvserve.planner.parallel import tp_comm_s_per_step
from kvserve.planner.plan import make_plan
from kvserve.sim.measure import Sample
from kvserve.sim.step_model import (
    COEFFICIENTS,
    MODEL_VERSION,
    StepTimeModel,
    TensorParallel,
    errors,
    fit,
    from_datasheet,
    load_step_model,
)
from kvserve.engine.step_shape import StepShape
from tests.sim.helpers import synthetic_model

TRUE = StepTimeModel(
    fixed=3e-3, per_row=4e-4, per_decode_row=1.5e-3, per_prefill_token=2e-4, per_mixed_prefill_token=5e-5,
    per_decode_kv=2e-6, per_prefill_kv=3e-7, per_pair=4e-9, per_sample=6e-4, per_arrival=2.5e-3,
)


def _chunks(rng, count: int) -> tuple[int, int, int]:
    """(positions, (query, key) pairs, KV positions read) of `count` prompt chunks over cached histories."""
    tokens = pairs = kv = 0
    for _ in range(count):
        m, start = int(rng.integers(2, 300)), int(rng.integers(0, 600))
        tokens += m
        pairs += m * start + m * (m + 1) // 2
        kv += start + m
    return tokens, pairs, kv


def _shapes(n: int, seed: int = 0) -> list[tuple[str, StepShape]]:
    """Varied steps of every kind: prompt chunks alone, decode rows alone, and both; some with arrivals."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        kind = ("prefill", "decode", "mixed")[i % 3]
        decode_rows = 0 if kind == "prefill" else int(rng.integers(1, 64))
        decode_kv = sum(int(rng.integers(16, 2000)) for _ in range(decode_rows))
        prefill_rows = 0 if kind == "decode" else int(rng.integers(1, 4))
        tokens, pairs, kv = _chunks(rng, prefill_rows)
        samples = decode_rows + int(rng.integers(0, prefill_rows + 1))  # a chunk that ends its prompt samples
        out.append((kind, StepShape(decode_rows, tokens, prefill_rows, samples, decode_kv, pairs, kv, int(rng.integers(0, 4)))))
    return out


def _samples(model: StepTimeModel, n: int = 60, seed: int = 0) -> list[Sample]:
    return [Sample(kind, shape, model.step_s(shape)) for kind, shape in _shapes(n, seed)]


def test_fit_recovers_known_coefficients():
    fitted = fit(_samples(TRUE))
    for name in COEFFICIENTS:
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert fitted.source == "fit" and fitted.weight_read == 0


def test_fit_passes_descriptive_fields_through():
    fitted = fit(_samples(TRUE), label="here", model_name="m", num_layers=3, kv_bytes_per_position=512.0, model_len=99)
    assert (fitted.label, fitted.model_name, fitted.num_layers, fitted.kv_bytes_per_position, fitted.model_len) == \
        ("here", "m", 3, 512.0, 99)  # fmt: skip


def test_fit_ignores_held_out_and_other_kinds():
    good = _samples(TRUE)
    wrong = [Sample(s.kind, s.shape, s.seconds * 5, held_out=True) for s in _samples(TRUE, 30, seed=1)]
    fitted = fit(good + wrong)
    assert fitted.per_decode_row == pytest.approx(TRUE.per_decode_row, rel=1e-6)
    # the decode samples alone say nothing of prompt chunks: those coefficients come out 0
    only_decode = fit([s for s in good if s.kind == "decode"] * 2, kinds=("decode",))
    assert only_decode.per_prefill_token == only_decode.per_pair == 0
    assert only_decode.step_s(good[1].shape) == pytest.approx(good[1].seconds, rel=1e-6)


def test_fit_never_returns_a_negative_coefficient():
    # steps that get faster the more KV they read: unconstrained least squares answers with a negative per_decode_kv
    rng = np.random.default_rng(3)
    samples = []
    for _ in range(40):
        rows, kv = int(rng.integers(1, 32)), int(rng.integers(100, 5000))
        shape = StepShape(decode_rows=rows, sample_rows=rows, decode_kv_positions=kv, arrivals=int(rng.integers(0, 3)))
        samples.append(Sample("decode", shape, 0.01 + 1e-3 * rows - 1e-6 * kv + 1e-4 * float(rng.random())))
    a = np.array([[1, s.shape.rows, s.shape.decode_rows, s.shape.decode_kv_positions, s.shape.sample_rows, s.shape.arrivals]
                  for s in samples], dtype=float)  # fmt: skip
    t = np.array([s.seconds for s in samples])
    unconstrained, *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
    assert unconstrained[3] < 0  # the data is what the test says it is
    fitted = fit(samples)
    assert all(getattr(fitted, name) >= 0 for name in COEFFICIENTS)
    assert fitted.per_decode_kv == 0


@pytest.mark.parametrize("held_out", [0, 5])
def test_fit_with_too_few_samples_is_a_config_error(held_out):
    samples = _samples(TRUE, len(COEFFICIENTS) - 1)
    samples += [Sample(s.kind, s.shape, s.seconds, held_out=True) for s in _samples(TRUE, held_out, seed=2)]
    with pytest.raises(ConfigError, match=f"{len(COEFFICIENTS) - 1} measured steps cannot fit {len(COEFFICIENTS)}"):
        fit(samples)


def test_errors_reports_kinds_and_held_out_apart():
    samples = _samples(TRUE, 30)
    held = [Sample(kind, shape, TRUE.step_s(shape) * 2, held_out=True) for kind, shape in _shapes(4, seed=9)]
    out = errors(TRUE, samples + held)
    assert set(out) == {"prefill", "decode", "mixed", "held_out"}
    assert out["decode"] == {"steps": 10, "median": pytest.approx(0, abs=1e-12), "max": pytest.approx(0, abs=1e-12)}
    assert out["held_out"]["steps"] == 4
    assert out["held_out"]["median"] == pytest.approx(0.5) and out["held_out"]["max"] == pytest.approx(0.5)


def test_errors_leaves_held_out_out_when_there_is_none():
    assert "held_out" not in errors(TRUE, _samples(TRUE, 6))


def _every_field_set() -> StepTimeModel:
    values = {name: 1e-4 * (i + 1) for i, name in enumerate(COEFFICIENTS)}
    return StepTimeModel(**values, weight_read=7e-3, request_overhead=4e-3, busy_request_overhead=9e-3,
                          busy_request_overhead_samples=(0.005, 0.009, 0.02), source="datasheet", label="a label",
                         model_name="a model", num_layers=5, d_model=96, num_kv_heads=3, kv_bytes_per_position=768.0,
                         model_len=2048, meta={"samples": [{"kind": "decode"}], "cpu": "x"})  # fmt: skip


def test_save_and_load_keep_every_field(tmp_path):
    model = _every_field_set()
    path = model.save(tmp_path / "deep" / "model.json")
    loaded = load_step_model(path)
    assert dataclasses.asdict(loaded) == dataclasses.asdict(model)  # meta included (it is left out of ==)
    assert json.loads(path.read_text())["kvserve_step_model_version"] == MODEL_VERSION


def test_load_of_a_missing_file_names_the_calibration(tmp_path):
    with pytest.raises(ConfigError, match="kvserve plan calibrate --engine") as info:
        load_step_model(tmp_path / "absent.json")
    assert "absent.json" in str(info.value)


def test_load_of_another_version_names_the_calibration(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**_every_field_set().as_dict(), "kvserve_step_model_version": MODEL_VERSION + 1}))
    with pytest.raises(ConfigError, match="kvserve plan calibrate --engine"):
        load_step_model(path)


def test_load_of_something_else_names_the_calibration(tmp_path):
    path = tmp_path / "junk.json"
    path.write_text("not json")
    with pytest.raises(ConfigError, match="kvserve plan calibrate --engine"):
        load_step_model(path)


@pytest.mark.parametrize("name", [*COEFFICIENTS, "weight_read", "request_overhead", "busy_request_overhead"])
@pytest.mark.parametrize("value", [-1e-9, math.nan, math.inf, "1"])
def test_an_invalid_coefficient_is_a_config_error(name, value):
    with pytest.raises(ConfigError, match=name):
        StepTimeModel(**{name: value})


def test_an_unknown_source_is_a_config_error():
    with pytest.raises(ConfigError, match="source"):
        StepTimeModel(source="guess")


def test_scaled_scales_decode_and_prefill_costs_apart():
    model = _every_field_set()
    out = model.scaled(decode=2, prefill=3)
    prefill = {"per_prefill_token", "per_mixed_prefill_token", "per_prefill_kv", "per_pair", "request_overhead",
               "busy_request_overhead"}  # fmt: skip
    assert out.busy_request_overhead_samples == pytest.approx([3 * v for v in model.busy_request_overhead_samples])
    for name in (*COEFFICIENTS, "weight_read", "request_overhead", "busy_request_overhead"):
        assert getattr(out, name) == pytest.approx(getattr(model, name) * (3 if name in prefill else 2)), name
    for name in ("source", "label", "model_name", "num_layers", "d_model", "num_kv_heads", "kv_bytes_per_position", "model_len"):
        assert getattr(out, name) == getattr(model, name)
    assert model.scaled(1.5) == model.scaled(decode=1.5, prefill=1.5)


@pytest.mark.parametrize("factors", [(0, 1), (1, 0), (-2, None)])
def test_scaled_refuses_a_factor_not_above_zero(factors):
    with pytest.raises(ConfigError, match="scale factors"):
        _every_field_set().scaled(*factors)


def test_groups_sum_to_the_step_and_follow_the_formula():
    m = synthetic_model(weight_read=0.0, per_arrival=1e-3)
    shape = StepShape(decode_rows=3, prefill_tokens=50, prefill_rows=2, sample_rows=4, decode_kv_positions=300,
                      prefill_pairs=1000, prefill_kv_positions=80, arrivals=2)  # fmt: skip
    g = m.groups(shape)
    assert g["fixed"] == pytest.approx(m.fixed + m.per_row * 5)
    assert g["projections"] == pytest.approx(m.per_decode_row * 3 + (m.per_prefill_token + m.per_mixed_prefill_token) * 50)
    assert g["attention"] == pytest.approx(m.per_decode_kv * 300 + m.per_prefill_kv * 80 + m.per_pair * 1000)
    assert g["lm_head"] == pytest.approx(m.per_sample * 4) and g["serving"] == pytest.approx(2e-3)
    assert m.step_s(shape) == pytest.approx(sum(g.values()))
    # a step without decode rows pays no mixed-step premium; a weight-read floor caps projections from below
    assert m.groups(dataclasses.replace(shape, decode_rows=0))["projections"] == pytest.approx(m.per_prefill_token * 50)
    assert synthetic_model(weight_read=1.0).groups(shape)["projections"] == 1.0


# ---- the datasheet model against the planner ----------------------------------------------

def _planner(batch: int, history: int):
    inputs = PlanInputs(models.PRESETS["seed-8b"], hardware.PRESETS["h100"], history_positions=history,
                        prompt_positions=history, batch=batch)  # fmt: skip
    return inputs, make_plan(inputs).derived


@pytest.mark.parametrize("batch", [1, 8, 512])  # both sides of the critical batch (~295 on an H100 at bf16)
@pytest.mark.parametrize("history", [256, 8192])
def test_datasheet_decode_step_is_the_planners(batch, history):
    inputs, derived = _planner(batch, history)
    model = from_datasheet(inputs.model, inputs.chip, inputs.bytes_per_weight, derived.kv_bytes_per_position, inputs.utilisation)
    shape = StepShape(decode_rows=batch, sample_rows=batch, decode_kv_positions=batch * history)
    assert model.step_s(shape) == pytest.approx(derived.step(batch).total_s, rel=1e-9)


def test_datasheet_prompt_pass_is_the_planners_prefill_time():
    inputs, derived = _planner(1, 8192)
    model = from_datasheet(inputs.model, inputs.chip, inputs.bytes_per_weight, derived.kv_bytes_per_position, inputs.utilisation)
    shape = StepShape(prefill_tokens=8192, prefill_rows=1, sample_rows=1, prefill_pairs=8192 * 8193 // 2,
                      prefill_kv_positions=8192)  # fmt: skip
    assert model.step_s(shape) == pytest.approx(derived.prefill_s, rel=1e-9)


def test_datasheet_model_says_it_is_not_measured():
    inputs, derived = _planner(1, 256)
    model = from_datasheet(inputs.model, inputs.chip, 2.0, derived.kv_bytes_per_position, 0.4, model_len=4096)
    assert model.source == "datasheet" and "not measured" in model.label and "h100" in model.label
    assert (model.num_layers, model.d_model, model.num_kv_heads, model.model_len) == (32, 4096, 8, 4096)
    assert model.kv_bytes_per_position == derived.kv_bytes_per_position == 131072


# ---- tensor parallelism -----------------------------------------------------------------------

SHAPE = StepShape(decode_rows=6, prefill_tokens=40, prefill_rows=1, sample_rows=7, decode_kv_positions=900,
                  prefill_pairs=2000, prefill_kv_positions=100, arrivals=1)  # fmt: skip


def test_tensor_parallel_of_one_is_the_model():
    model = synthetic_model(per_arrival=1e-3, weight_read=1e-4)
    assert TensorParallel(1).step_s(model, SHAPE) == model.step_s(SHAPE)


@pytest.mark.parametrize(("size", "kv_heads", "split"), [(2, 2, 2), (4, 2, 2), (8, 8, 8), (4, 0, 4)])
def test_tensor_parallel_divides_projections_and_attention(size, kv_heads, split):
    model = synthetic_model(per_arrival=1e-3, num_kv_heads=kv_heads)
    g = model.groups(SHAPE)
    tp = TensorParallel(size, include_comm=False)
    assert tp.attention_split(model) == split
    expected = g["fixed"] + g["serving"] + (g["projections"] + g["lm_head"]) / size + g["attention"] / split
    assert tp.step_s(model, SHAPE) == pytest.approx(expected, rel=1e-12)


def test_tensor_parallel_communication_is_the_planners():
    model = synthetic_model()
    tp = TensorParallel(4, link_bytes_per_s=5e10, link_latency_s=2e-5, bytes_per_activation=2.0)
    comm = tp_comm_s_per_step(model.num_layers, 4, SHAPE.tokens, model.d_model, 2.0, 5e10, 2e-5)
    assert comm > 0
    without = dataclasses.replace(tp, include_comm=False).step_s(model, SHAPE)
    assert tp.step_s(model, SHAPE) - without == pytest.approx(comm, rel=1e-9)


def test_load_of_json_that_is_not_an_object_is_a_config_error(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[]")
    with pytest.raises(ConfigError, match="kvserve plan calibrate --engine"):
        load_step_model(path)


def test_overhead_is_the_busy_one_while_stepping_and_idle_without_a_busy_figure():
    model = StepTimeModel(request_overhead=0.004, busy_request_overhead=0.011)
    assert (model.overhead_s(busy=False), model.overhead_s(busy=True)) == (0.004, 0.011)
    older = StepTimeModel(request_overhead=0.004)  # a model fitted before the busy figure existed
    assert older.overhead_s(busy=True) == older.overhead_s(busy=False) == 0.004


def test_overhead_draws_from_the_measured_ones_given_a_random_source():
    import random

    model = StepTimeModel(request_overhead=0.004, busy_request_overhead=0.011, request_overhead_samples=(0.003, 0.004, 0.006),
                          busy_request_overhead_samples=(-0.0001, 0.011, 0.03))  # fmt: skip
    rng = random.Random(0)
    idle = {model.overhead_s(False, rng) for _ in range(200)}
    busy = {model.overhead_s(True, rng) for _ in range(200)}
    assert idle == {0.003, 0.004, 0.006} and busy == {0.0, 0.011, 0.03}  # every one drawn; none below 0
    assert model.overhead_s(True) == 0.011  # without a random source: the median


@pytest.mark.parametrize("values", [(math.nan,), ("1",), 0.5])
def test_overhead_samples_must_be_finite_numbers(values):
    with pytest.raises(ConfigError, match="busy_request_overhead_samples"):
        StepTimeModel(busy_request_overhead_samples=values)


def test_overhead_samples_survive_the_file(tmp_path):
    model = StepTimeModel(request_overhead_samples=[0.001, 0.002], kv_bytes_per_position=8, model_len=64)
    assert model.request_overhead_samples == (0.001, 0.002)  # a list in (as JSON gives it), a tuple kept
    assert load_step_model(model.save(tmp_path / "m.json")) == model
