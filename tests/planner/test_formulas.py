"""Each formula module against an independent count or the seed's stated relation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.planner import attention, capacity, cost, disagg, kv, latency, parallel, roofline
from kvserve.planner.layout import place


@given(st.integers(0, 300), st.integers(1, 60), st.integers(1, 256))
@settings(max_examples=60, deadline=None)
def test_attention_flops_equal_sum_over_new_positions(cached, new, head_dim):
    brute = sum(4 * head_dim * (cached + t) for t in range(1, new + 1))
    assert attention.attention_flops(cached, new, head_dim) == brute


@given(st.integers(1, 5000), st.integers(1, 8))
@settings(max_examples=60, deadline=None)
def test_independent_pairs_count_a_block_diagonal_mask(positions, pieces):
    pieces = min(pieces, positions)
    lengths = [positions // pieces + (i < positions % pieces) for i in range(pieces)]
    assert attention.independent_sequences_pairs(positions, pieces) == sum(n * (n + 1) // 2 for n in lengths)


def test_physical_kv_adds_page_rounding_and_replication():
    c_kv = kv.kv_bytes_per_position(32, 8, 128, 2)
    assert kv.physical_kv_bytes(2, 17, c_kv, kv_block_positions=16) == 2 * 32 * c_kv
    assert kv.physical_kv_bytes(2, 16, c_kv, replication_factor=2) == 2 * kv.logical_kv_bytes(16, c_kv, 2)


def test_heads_layout_replicates_kv_past_the_kv_head_count():
    eight = place("heads", 8, 70e9, 1, 8, 1.0)
    sixteen = place("heads", 16, 70e9, 1, 8, 1.0)
    assert eight.kv_bytes_per_request_per_chip == sixteen.kv_bytes_per_request_per_chip == 1 / 8
    assert sixteen.kv_replication_factor == 2
    assert sixteen.weight_bytes_per_chip == eight.weight_bytes_per_chip / 2


def test_requests_layout_busiest_chip_holds_the_ceiling_share():
    p = place("requests", 16, 70e9, 1, 8, 1.0)
    assert p.requests_on_busiest_chip(48) == 3
    assert p.requests_on_busiest_chip(49) == 4


@given(st.integers(1, 64), st.floats(1e-4, 0.05), st.floats(0, 2e-3))
@settings(max_examples=40, deadline=None)
def test_bisection_finds_the_same_batch_as_a_scan(chips_exp, target_s, exchange_s):
    num_chips = [1, 2, 4, 8, 16][chips_exp % 5]
    layout = "requests" if chips_exp % 2 else "heads"
    p = place(layout, num_chips, 8e9, 2, 8, 2.0e8)
    limit = capacity.capacity_batch(80e9, 0, p)
    found = capacity.max_batch_meeting_target(p, limit, target_s, 9.89e14, 3.35e12, exchange_s)
    scan = [b for b in range(1, limit + 1) if roofline.step_time(p, b, 9.89e14, 3.35e12, exchange_s).total_s <= target_s]
    assert found == (max(scan) if scan else 0)


def test_step_time_is_stages_added_not_one_max():
    p = place("heads", 1, 1e9, 2, 8, 1e6)
    step = roofline.step_time(p, 10, 1e14, 1e12, exchange_s=1e-3)
    assert step.total_s == pytest.approx(max(2e10 / 1e14, 2e9 / 1e12) + 1e7 / 1e12 + 1e-3)


def test_critical_batch_is_where_the_projection_branches_cross():
    b_star = roofline.critical_batch(1.97e14, 8.2e11, 1)
    p = place("heads", 16, 70e9, 1, 8, 0.0)
    below, above = (roofline.step_time(p, b, 1.97e14, 8.2e11) for b in (int(b_star), int(b_star) + 1))
    assert (below.branch, above.branch) == ("weight-read", "compute")


def test_read_only_throughput_tends_to_beta_over_k():
    w, k, beta = 1e10, 1e8, 1e12
    big = 10**7
    assert big / roofline.read_only_step_s(w, k, big, beta) == pytest.approx(beta / k, rel=1e-3)


def test_prefill_and_total_time():
    assert latency.prefill_time_s(70e9, 8192, 16, 197e12, 0.4) == pytest.approx(0.90964, abs=1e-5)
    assert latency.total_time_s(0.4, 0.02, 101) == pytest.approx(2.4)


def test_collectives_scale_with_batch_not_chips():
    one = parallel.collective_time_s("allreduce", 8, 32, 8192, 2, 4.5e10, 0)
    assert parallel.collective_time_s("allreduce", 16, 32, 8192, 2, 4.5e10, 0) > one  # κ grows toward 2
    assert parallel.collective_time_s("reducescatter", 8, 32, 8192, 2, 4.5e10, 0) == pytest.approx(one / 2)
    assert parallel.collective_time_s("allreduce", 1, 32, 8192, 2, 4.5e10, 1e-6) == 0


def test_tp_beats_replicas_only_below_half_the_step():
    assert parallel.tp_vs_replicas(0.020, 0.011).winner == "replicas"
    assert parallel.tp_vs_replicas(0.020, 0.009).winner == "tp"
    assert parallel.tp_vs_replicas(0.020, 0.011).tp_step_needed_s == pytest.approx(0.010)


def test_cost_per_token_and_idle_cost():
    full = cost.cost_per_token_usd(1.0, 16, 0.012, 32)
    assert full == pytest.approx(16 * 0.012 / 32)
    assert cost.cost_per_token_at_rate_usd(1.0, 16, 0.012, 32, 32 / 0.012) == pytest.approx(full)
    assert cost.cost_per_token_at_rate_usd(1.0, 16, 0.012, 32, 32 / 0.012 / 4) == pytest.approx(4 * full)


def test_no_decode_steps_never_bottleneck():
    rates = disagg.StageRates(1.0, disagg.decode_rate_req_per_s(8, 0.01, 0), 2.0)
    assert rates.bottleneck == "prefill"


def test_ideal_capacity_formula():
    assert capacity.ideal_kv_capacity_bytes(16, 16e9, 2e9, 70e9) == pytest.approx(154e9)
