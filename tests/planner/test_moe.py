"""A mixture of experts in the planner (planner/moe.py): the weights a step reads grow with the
batch as E·(1 − (1 − k/E)^B) experts per layer, compute follows the active parameters, and the
critical batch, step time and cost move with them; the presets count as the released models.
The engine's own counter against the formula: tests/model/test_moe.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvserve.cli import main
from kvserve.planner import CHIP_PRESETS, MODEL_PRESETS, PlanInputs, make_plan
from kvserve.planner.moe import ExpertShape, expert_shape


@pytest.mark.parametrize("name, total, active", [
    ("qwen3-30b-a3b", 30.5e9, 3.35e9), ("olmoe-1b-7b", 6.92e9, 1.28e9), ("mixtral-8x7b", 46.7e9, 12.9e9),
])  # fmt: skip
def test_presets_count_as_the_released_models(name, total, active):
    shape = expert_shape(MODEL_PRESETS[name].arch)
    assert shape.num_params == pytest.approx(total, rel=0.01)
    assert shape.active_params == pytest.approx(active, rel=0.01)


def test_experts_touched_from_k_to_e_and_its_bound():
    s = ExpertShape(num_params=1e9, num_sparse_layers=2, num_experts=64, top_k=8, expert_params=1e6)
    assert s.experts_touched(1) == pytest.approx(8)
    assert s.experts_touched(2) == pytest.approx(64 * (1 - (56 / 64) ** 2))
    assert s.experts_touched(10_000) == pytest.approx(64)
    assert s.experts_touched(3, bound=True) == 24 and s.experts_touched(100, bound=True) == 64
    assert s.params_read(1) == pytest.approx(1e9 - 2 * 64 * 1e6 + 2 * 8 * 1e6)
    assert s.params_read(10_000) == pytest.approx(1e9)


def test_critical_batch_balances_compute_and_the_read():
    s = expert_shape(MODEL_PRESETS["qwen3-30b-a3b"].arch)
    C, beta, pw = 989e12, 3.35e12, 2.0
    b = s.critical_batch(C, beta, pw)
    assert 2 * s.active_params * b / C == pytest.approx(s.params_read(b) * pw / beta, rel=1e-6)
    dense = C * pw / (2 * beta)
    assert b > dense  # the read grows with the batch, so compute overtakes it later


def test_a_plan_of_a_mixture_reads_the_experts_its_batch_touches(capsys):
    """`kvserve plan run` on Qwen3-30B-A3B at batch 1 and 64: the step's weight read and the
    batch-1 figures, against the same total parameters read whole (a dense model's)."""
    moe = MODEL_PRESETS["qwen3-30b-a3b"]
    shape = expert_shape(moe.arch)
    for batch in (1, 64):
        plan = make_plan(PlanInputs(moe, CHIP_PRESETS["h100"], batch=batch))
        read = plan["moe_weight_bytes_read_per_step"]
        assert read == pytest.approx(shape.params_read(batch) * 2)
        assert plan["moe_experts_touched"] == pytest.approx(shape.experts_touched(batch))
        step = plan.derived.decode_step  # the §4 step time reads that much, and computes the active parameters
        assert step.weight_read_s == pytest.approx(read / CHIP_PRESETS["h100"].hbm_bytes_per_s)
        assert step.projection_compute_s == pytest.approx(2 * shape.active_params * batch / CHIP_PRESETS["h100"].peak_flops_per_s)
    dense = dataclasses.replace(moe, arch=dataclasses.replace(moe.arch, num_experts=0))
    assert "moe_experts_touched" not in json.dumps(make_plan(PlanInputs(dense, CHIP_PRESETS["h100"], batch=1)).as_json())
    b1 = make_plan(PlanInputs(moe, CHIP_PRESETS["h100"], batch=1))
    assert b1["moe_batch1_weight_bytes_read"] < 0.25 * moe.num_params * 2  # ~3.3B of 30.5B parameters
    assert main(["plan", "run", "--model", "qwen3-30b-a3b", "--chip", "h100", "--batch", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "moe_critical_batch" in json.dumps(out)


def test_under_a_step_target_the_mixture_batches_more_and_costs_less_than_its_dense_equal():
    """§6 and §8 for Qwen3-30B-A3B beside a dense model of the same 30.5B parameters (one H100,
    S = 4096): at a 20 ms step target the mixture's smaller read admits more requests, so each
    token costs less; at 10 ms the dense one meets the target with no batch at all."""
    moe = MODEL_PRESETS["qwen3-30b-a3b"]
    dense = dataclasses.replace(moe, arch=dataclasses.replace(moe.arch, num_experts=0, intermediate_size=98304))

    def plan(model, target_ms):
        return make_plan(PlanInputs(model, CHIP_PRESETS["h100"], history_positions=4096, step_target_s=target_ms / 1e3))

    m20, d20 = plan(moe, 20), plan(dense, 20)
    assert m20["max_batch_meeting_target"] > 2 * d20["max_batch_meeting_target"] > 0
    assert m20["cost_per_token_usd"] < 0.5 * d20["cost_per_token_usd"]
    assert plan(dense, 10)["max_batch_meeting_target"] == 0 < plan(moe, 10)["max_batch_meeting_target"]
    # the step at the mixture's batch meets the target, one request more does not
    b = m20["max_batch_meeting_target"]
    assert m20.derived.step(b).total_s <= 0.020 < m20.derived.step(b + 1).total_s


def test_the_simulators_datasheet_step_reads_as_the_planners():
    """The simulator's datasheet step model of Qwen3-30B-A3B: a decode step of B rows takes the
    planner's staged projection time at B (the experts its batch touches), and serialises."""
    from kvserve.engine.step_shape import StepShape
    from kvserve.sim.step_model import StepTimeModel, from_datasheet

    inputs = PlanInputs(MODEL_PRESETS["qwen3-30b-a3b"], CHIP_PRESETS["h100"], history_positions=4096)
    plan = make_plan(inputs)
    sim = from_datasheet(inputs.model, inputs.chip, inputs.bytes_per_weight, plan.derived.kv_bytes_per_position, inputs.utilisation)
    for batch in (1, 16, 64):
        planned = plan.derived.step(batch)
        assert sim.groups(StepShape(decode_rows=batch))["projections"] == pytest.approx(planned.projection_s, rel=1e-9)
    assert StepTimeModel.from_dict(sim.as_dict()) == sim
