"""The seed's §5–§7 figures through the public API (make_plan), not the examples table."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvserve.planner import make_plan


def test_section6_capacity_and_target_batch(seed_inputs):
    plan = make_plan(seed_inputs)
    assert plan["weight_bytes_per_chip"] == pytest.approx(4.375e9)
    assert plan["kv_bytes_per_request_per_chip"] == pytest.approx(0.16777216e9)
    assert plan["capacity_batch"] == 57
    assert plan["critical_batch"] == pytest.approx(120.12, abs=0.01)
    assert plan["max_batch_meeting_target"] == 32
    assert plan["step_s"] == pytest.approx(11.883e-3, abs=5e-7)
    assert round(plan["tokens_per_s"]) == 2693


def test_changing_history_rederives_every_dependent(seed_inputs):
    short = make_plan(replace(seed_inputs, history_positions=2048))
    assert short["capacity_batch"] == 229
    assert short["max_batch_meeting_target"] == 125
    assert short["projection_branch"] == "compute"
    assert short["step_s"] == pytest.approx(11.946e-3, abs=5e-7)
    assert round(short["tokens_per_s"]) == 10464


def test_section5_batch_64_does_not_fit(seed_inputs):
    plan = make_plan(replace(seed_inputs, batch=64))
    assert plan["kv_replication_factor"] == 2  # 16 chips, 8 KV heads
    assert plan["fits_memory"] is False
    assert plan["decode_batch"] == 64


def test_requests_layout_with_exchange_picks_48(seed_inputs):
    plan = make_plan(replace(seed_inputs, kv_layout="requests", exchange_s_per_step=0.8e-3))
    assert plan["max_batch_meeting_target"] == 48
    assert plan["kv_replication_factor"] == 1
    assert plan["tokens_per_s"] > make_plan(seed_inputs)["tokens_per_s"]


def test_section7_disaggregation_numbers(seed_inputs):
    from kvserve.planner import disagg

    decode = disagg.decode_rate_req_per_s(48, 0.011, 512)
    assert disagg.prefill_groups_to_feed(decode, 0.90) == 8
    handoff = make_plan(seed_inputs)["handoff_bytes_per_request"]
    assert handoff == 1_342_177_280
    rates = disagg.StageRates(disagg.prefill_rate_req_per_s(0.90, 8), decode, disagg.network_rate_req_per_s(10e9, handoff))
    assert rates.bottleneck == "network"
    assert rates.system_req_per_s == pytest.approx(7.45, abs=0.005)
    assert disagg.bandwidth_for_rate(8, handoff) == pytest.approx(10.737e9, rel=1e-4)


def test_explain_substitutes_the_numbers(seed_inputs):
    q = make_plan(seed_inputs).quantity("kv_bytes_per_position")
    assert q.formula == "c_kv = 2·L·N_kv·H·p_kv"
    assert q.substituted == "2·80·8·128·1 = 163840"
