"""Percentiles, summaries and goodput: the arithmetic behind every reported latency."""

from __future__ import annotations

import pytest

from kvserve.loadgen.stats import SLO, goodput_req_per_s, summarize


def test_percentiles_interpolate_between_order_statistics():
    s = summarize(range(1, 101))  # 1..100
    assert s["mean"] == pytest.approx(50.5)
    assert s["median"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)  # 1 + 0.90·99
    assert s["p99"] == pytest.approx(99.01)  # 1 + 0.99·99
    assert (s["min"], s["max"], s["count"]) == (1, 100, 100)


def test_scale_converts_units_and_none_is_skipped():
    s = summarize([0.001, None, 0.003], scale=1e3)
    assert s["count"] == 2
    assert s["median"] == pytest.approx(2.0)


def test_empty_summary_has_no_figures():
    s = summarize([])
    assert s["count"] == 0 and s["mean"] is None and s["p99"] is None


def test_slo_needs_every_given_objective():
    slo = SLO(ttft_s=0.5, tpot_s=0.05)
    assert slo.met_by(0.4, 0.04, 10.0)  # e2e unchecked
    assert not slo.met_by(0.6, 0.04, 1.0)
    assert not slo.met_by(0.4, 0.06, 1.0)
    assert slo.met_by(0.4, None, 1.0)  # one output token: no TPOT to violate
    assert not SLO(e2e_s=1.0).met_by(0.1, 0.01, 1.5)


def test_goodput_counts_requests_meeting_slos_per_second():
    latencies = [(0.1, 0.01, 1.0), (0.2, 0.02, 2.0), (0.9, 0.01, 1.0), (0.1, 0.09, 1.0)]
    assert goodput_req_per_s(latencies, SLO(ttft_s=0.5, tpot_s=0.05), duration_s=2.0) == pytest.approx(1.0)
    assert goodput_req_per_s(latencies, SLO(), duration_s=4.0) == pytest.approx(1.0)  # no SLO: every request
