"""When each request of a load run is sent: gaps drawn from a gamma distribution.

Shape 1 (`burstiness` 1) is a Poisson process: exponential gaps. Shape k keeps the mean
gap at 1/rate while the coefficient of variation becomes 1/√k: below 1 the arrivals come
in bursts, above 1 they come more evenly. An infinite rate sends everything at once.
"""

from __future__ import annotations

import math

import numpy as np


def interarrival_gaps_s(num_requests: int, rate_req_per_s: float, burstiness: float, seed: int) -> list[float]:
    """Gap before each request, in seconds; the first request waits its gap too (as a process would)."""
    if math.isinf(rate_req_per_s):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    # mean of gamma(shape, scale) is shape·scale; pick scale so the mean gap is 1/rate
    scale_s = 1.0 / (rate_req_per_s * burstiness)
    return rng.gamma(shape=burstiness, scale=scale_s, size=num_requests).tolist()


def send_times_s(gaps_s: list[float]) -> list[float]:
    """Offsets from the start of the run at which each request is sent."""
    return np.cumsum(gaps_s).tolist() if gaps_s else []
