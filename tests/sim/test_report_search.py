"""What a simulated run reports (percentiles, SLOs, cost) and the search for the highest rate meeting SLOs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvserve.errors import ConfigError
from kvserve.loadgen.stats import SLO
from kvserve.sim.report import summary
from kvserve.sim.search import find_max_rate
from kvserve.sim.simulator import Simulator
from kvserve.sim.workload import Lengths, WorkloadSpec, build
from tests.sim.helpers import deployment, request, synthetic_model


def _spec(n: int = 10, rate: float = 5.0, output: int = 8) -> WorkloadSpec:
    return WorkloadSpec(n, rate, Lengths.parse("p", "32"), Lengths.parse("o", str(output)), seed=1)


def test_summary_fields():
    spec = _spec()
    run = Simulator(deployment(replicas=2), synthetic_model()).run(build(spec))
    out = summary(run, SLO(ttft_s=1.0, tpot_s=1.0), usd_per_chip_hour=3.6)
    duration = run.end_s - min(t.arrival_s for t in run.traces)
    assert (out["completed"], out["rejected"], out["preemptions"]) == (10, 0, 0)
    assert out["duration_s"] == pytest.approx(duration)
    assert out["request_throughput_req_per_s"] == pytest.approx(10 / duration)
    assert out["output_throughput_tok_per_s"] == pytest.approx(80 / duration)
    for key, count in (("ttft_ms", 10), ("tpot_ms", 10), ("e2e_ms", 10), ("itl_ms", 70)):
        stats = out[key]
        assert stats["count"] == count
        assert 0 < stats["min"] <= stats["median"] <= stats["p90"] <= stats["p99"] <= stats["max"]
    assert out["ttft_ms"]["median"] == pytest.approx(1e3 * float(np.median([t.ttft_s for t in run.traces])))
    assert out["slo_attainment"] == 1.0 and out["goodput_req_per_s"] == pytest.approx(10 / duration)
    dollars = 3.6 * 2 * duration / 3600  # every chip, the whole run
    assert out["cost_usd"] == pytest.approx(dollars)
    assert out["cost_per_million_output_tokens_usd"] == pytest.approx(dollars / 80 * 1e6)
    assert out["cost_per_request_usd"] == pytest.approx(dollars / 10)
    assert [i["name"] for i in out["instances"]] == ["replica-0", "replica-1"]
    assert all(0 < i["busy_fraction"] <= 1 and i["steps"] > 0 for i in out["instances"])


def test_summary_with_a_strict_slo_counts_nothing_as_good():
    run = Simulator(deployment(), synthetic_model()).run(build(_spec()))
    out = summary(run, SLO(ttft_s=1e-6))
    assert out["slo_attainment"] == 0.0 and out["goodput_req_per_s"] == 0.0


def test_summary_without_slo_or_price_leaves_those_out():
    out = summary(Simulator(deployment(), synthetic_model()).run(build(_spec())))
    assert not {"slo_attainment", "goodput_req_per_s", "cost_usd", "cost_per_million_output_tokens_usd"} & set(out)


def test_rejected_requests_count_against_slo_attainment():
    requests = [request(0, 5000, 4), *(request(i, 20, 4, arrival_s=0.1 * i) for i in range(1, 4))]  # 5000 > the 4096 context
    run = Simulator(deployment(), synthetic_model()).run(requests)
    out = summary(run, SLO(ttft_s=10.0))
    assert (out["completed"], out["rejected"]) == (3, 1)
    assert out["slo_attainment"] == pytest.approx(3 / 4)


def test_idle_chips_make_a_low_rate_dearer_per_token():
    sim = Simulator(deployment(), synthetic_model())
    low, high = (summary(sim.run(build(_spec(20, rate))), usd_per_chip_hour=2.0) for rate in (0.5, 20.0))
    assert low["cost_per_million_output_tokens_usd"] > 5 * high["cost_per_million_output_tokens_usd"]
    assert low["instances"][0]["busy_fraction"] < high["instances"][0]["busy_fraction"]


def test_find_max_rate_brackets_the_target():
    sim = Simulator(deployment(), synthetic_model())
    spec = _spec(40, output=32)
    slo = SLO(tpot_s=0.010)
    result = find_max_rate(sim, spec, slo, target=0.9, start_rate=1.0, usd_per_chip_hour=1.0)
    found = result.max_rate_req_per_s
    assert found is not None and found > 1.0
    assert result.at_max["slo_attainment"] >= 0.9 and "cost_per_million_output_tokens_usd" in result.at_max
    assert (found, result.at_max["slo_attainment"]) in result.trials
    assert any(rate > found and attained < 0.9 for rate, attained in result.trials)
    # the search's own runs are deterministic: the rate found meets the target again
    assert summary(sim.run(build(spec.with_rate(found))), slo)["slo_attainment"] >= 0.9


def test_find_max_rate_reports_none_when_nothing_meets_the_target():
    seen = []
    result = find_max_rate(Simulator(deployment(), synthetic_model()), _spec(5), SLO(ttft_s=1e-9),
                           on_trial=lambda rate, attained: seen.append(rate))  # fmt: skip
    assert result.max_rate_req_per_s is None and result.at_max is None
    assert seen == [rate for rate, _ in result.trials] and min(seen) < 1 / 1000


def test_find_max_rate_needs_an_slo():
    with pytest.raises(ConfigError, match="needs at least one SLO"):
        find_max_rate(Simulator(deployment(), synthetic_model()), _spec(), SLO())


@pytest.mark.parametrize("target", [0.0, 1.5, -0.1])
def test_find_max_rate_checks_the_target(target):
    with pytest.raises(ConfigError, match="slo_attainment"):
        find_max_rate(Simulator(deployment(), synthetic_model()), _spec(), SLO(tpot_s=1.0), target=target)


def test_infinite_rate_summary_is_finite():
    run = Simulator(deployment(), synthetic_model()).run(build(_spec(6, math.inf)))
    out = summary(run)
    assert out["completed"] == 6 and math.isfinite(out["request_throughput_req_per_s"])


def test_search_from_an_infinite_rate_is_refused():
    with pytest.raises(ConfigError, match="finite rate"):
        find_max_rate(Simulator(deployment(), synthetic_model()), _spec(), SLO(ttft_s=1.0), start_rate=math.inf)
