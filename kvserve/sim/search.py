"""The highest arrival rate a deployment serves within its SLOs, found by simulating.

Attainment (the share of requests meeting every SLO) falls as the rate rises, though not
strictly (a different rate draws other gaps). The search doubles the rate until attainment
drops below the target, then bisects between the last rate that met it and the first that
did not, to a relative width of `tolerance`. Every trial uses the same seed, so the
requests' lengths and gap pattern are the same, only scaled in time.
"""

from __future__ import annotations

import dataclasses

from kvserve.errors import ConfigError
from kvserve.loadgen.stats import SLO
from kvserve.sim.report import summary
from kvserve.sim.simulator import Simulator
from kvserve.sim.workload import WorkloadSpec, build


@dataclasses.dataclass
class RateSearch:
    max_rate_req_per_s: float | None  # None: not even the lowest rate tried met the target
    trials: list[tuple[float, float]]  # (rate, attainment), in the order run
    at_max: dict | None  # the summary of the run at the rate found


def find_max_rate(sim: Simulator, spec: WorkloadSpec, slo: SLO, target: float = 0.9, start_rate: float = 1.0,
                  tolerance: float = 0.05, max_trials: int = 30, usd_per_chip_hour: float | None = None,
                  on_trial=None) -> RateSearch:  # fmt: skip
    if not slo.is_set:
        raise ConfigError("slo", "the rate search needs at least one SLO (--slo-ttft-ms, --slo-tpot-ms, --slo-e2e-ms)")
    if not (0 < start_rate < float("inf")):
        raise ConfigError("rate", f"the search starts from a finite rate > 0, got {start_rate}")
    if not 0 < target <= 1:
        raise ConfigError("slo_attainment", f"must be in (0, 1], got {target}")
    trials: list[tuple[float, float]] = []
    summaries: dict[float, dict] = {}

    def attainment(rate: float) -> float:
        out = summary(sim.run(build(spec.with_rate(rate))), slo, usd_per_chip_hour)
        summaries[rate] = out
        trials.append((rate, out["slo_attainment"]))
        if on_trial is not None:
            on_trial(rate, out["slo_attainment"])
        return out["slo_attainment"]

    good, bad, rate = None, None, start_rate
    while len(trials) < max_trials:  # bracket
        if attainment(rate) >= target:
            good, rate = rate, rate * 2
        else:
            bad, rate = rate, rate / 2
        if good is not None and bad is not None:
            break
        if good is None and rate < start_rate / 1024:
            return RateSearch(None, trials, None)
    while good is not None and bad is not None and bad / good - 1 > tolerance and len(trials) < max_trials:
        mid = (good * bad) ** 0.5
        if attainment(mid) >= target:
            good = mid
        else:
            bad = mid
    return RateSearch(good, trials, summaries.get(good))
