"""A request's status and its timestamps.

The engine's scheduler writes them (engine/request.py, engine/scheduler.py); the outputs
hand the timestamps to the user (outputs.py) and a constrained request's grammar may end
it with a status (structured/advance.py). Below all three, so none imports the engine.
"""

from __future__ import annotations

import dataclasses
import enum


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclasses.dataclass
class RequestTiming:
    """Monotonic timestamps (seconds); the latency figures the server and benchmarks report."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    finished: float | None = None

    @property
    def queue_time_s(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival
