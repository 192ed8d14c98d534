"""Summary statistics of latency samples, and goodput under service-level objectives (SLOs).

Percentiles interpolate linearly between order statistics (numpy's default), so p50 of
[1, 2, 3, 4] is 2.5. Goodput counts only requests that met every SLO given, per second
of the run: the rate at which the server did useful work, not just any work.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


def summarize(values: Iterable[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """mean, median, p90, p99, min, max and count of `values` × `scale` (e.g. 1e3 for s → ms)."""
    data = np.asarray([v for v in values if v is not None], dtype=np.float64) * scale
    if data.size == 0:
        return {"mean": None, "median": None, "p90": None, "p99": None, "min": None, "max": None, "count": 0}
    p50, p90, p99 = np.percentile(data, PERCENTILES)
    return {
        "mean": float(data.mean()),
        "median": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "min": float(data.min()),
        "max": float(data.max()),
        "count": int(data.size),
    }


@dataclasses.dataclass(frozen=True)
class SLO:
    """Per-request latency objectives in seconds; None leaves that figure unchecked."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.tpot_s, self.e2e_s))

    def met_by(self, ttft_s: float | None, tpot_s: float | None, e2e_s: float | None) -> bool:
        if self.ttft_s is not None and (ttft_s is None or ttft_s > self.ttft_s):
            return False
        # a request with a single output token has no TPOT: nothing there to violate
        if self.tpot_s is not None and tpot_s is not None and tpot_s > self.tpot_s:
            return False
        if self.e2e_s is not None and (e2e_s is None or e2e_s > self.e2e_s):
            return False
        return True

    def to_dict(self) -> dict[str, float | None]:
        return dataclasses.asdict(self)


def goodput_req_per_s(
    latencies: Sequence[tuple[float | None, float | None, float | None]], slo: SLO, duration_s: float
) -> float:
    """Requests (given as successful (ttft_s, tpot_s, e2e_s)) that met every SLO, per second."""
    if duration_s <= 0:
        return 0.0
    return sum(slo.met_by(*lat) for lat in latencies) / duration_s
