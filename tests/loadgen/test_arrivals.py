"""Arrival processes: the mean rate holds, and burstiness sets the spread of the gaps."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvserve.loadgen.arrivals import interarrival_gaps_s, send_times_s


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_mean_gap_is_one_over_rate(burstiness):
    gaps = np.array(interarrival_gaps_s(40_000, rate_req_per_s=8.0, burstiness=burstiness, seed=1))
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_coefficient_of_variation_is_one_over_sqrt_shape(burstiness):
    gaps = np.array(interarrival_gaps_s(40_000, rate_req_per_s=2.0, burstiness=burstiness, seed=2))
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_poisson_gaps_are_exponential():
    gaps = np.array(interarrival_gaps_s(40_000, rate_req_per_s=1.0, burstiness=1.0, seed=3))
    # P(gap > 1/rate) = e^-1 for an exponential
    assert (gaps > 1.0).mean() == pytest.approx(math.exp(-1), abs=0.01)


def test_infinite_rate_sends_everything_at_once():
    assert send_times_s(interarrival_gaps_s(5, math.inf, 1.0, seed=0)) == [0.0] * 5


def test_same_seed_same_schedule():
    assert interarrival_gaps_s(10, 3.0, 0.5, seed=7) == interarrival_gaps_s(10, 3.0, 0.5, seed=7)
    assert send_times_s([0.5, 0.25, 1.0]) == [0.5, 0.75, 1.75]
