"""One decode step by the seed's staged model (§4, §6), and the critical batch.

Projections (≈ 2·P·B FLOPs over the chips) overlap their weight reads, so that stage
takes max(2·(P/N)·B/C, (W/N)/β); attention is timed after it, dominated by reading the
busiest chip's KV, K_chip(B)/β; an exchange time (the `requests` layout) is added
unoverlapped. The seed warns against one max over all FLOPs and all bytes: the stages
depend on each other, so their times add.

The projection stage turns compute-bound past B* = C·(W/N)/(2·(P/N)·β) = C·p_w/(2β):
halving p_w at fixed C halves B*; doubling C as well keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.planner.layout import Placement
from kvserve.planner.moe import ExpertShape


def critical_batch(peak_flops_per_s: float, hbm_bytes_per_s: float, bytes_per_weight: float) -> float:
    """B* = C·p_w/(2β): where 2·P·B/C overtakes P·p_w/β."""
    return peak_flops_per_s * bytes_per_weight / (2 * hbm_bytes_per_s)


@dataclass(frozen=True)
class StepTime:
    batch: int
    projection_compute_s: float  # 2·(P/N)·B/C
    weight_read_s: float  # (W/N)/β
    kv_read_s: float  # K_chip(B)/β
    exchange_s: float

    @property
    def projection_s(self) -> float:
        return max(self.projection_compute_s, self.weight_read_s)

    @property
    def branch(self) -> str:
        """Which side of the projection max binds."""
        return "compute" if self.projection_compute_s > self.weight_read_s else "weight-read"

    @property
    def total_s(self) -> float:
        return self.projection_s + self.kv_read_s + self.exchange_s


def step_time(
    placement: Placement, batch: int, peak_flops_per_s: float, hbm_bytes_per_s: float, exchange_s: float = 0.0,
    experts: ExpertShape | None = None,
) -> StepTime:
    """t_step(B) = max(2·(P/N)·B/C, (W/N)/β) + K_chip(B)/β + t_exchange. A mixture of experts
    (`experts`, planner/moe.py): 2·(P_active/N)·B/C and (W/N)·P_read(B)/P, each expert split over
    the chips as a dense FFN is."""
    active = 1.0 if experts is None else experts.active_params / experts.num_params
    read = 1.0 if experts is None else experts.read_fraction(batch)
    return StepTime(
        batch=batch,
        projection_compute_s=2 * placement.params_per_chip * active * batch / peak_flops_per_s,
        weight_read_s=placement.weight_bytes_per_chip * read / hbm_bytes_per_s,
        kv_read_s=placement.kv_read_bytes_on_busiest_chip(batch) / hbm_bytes_per_s,
        exchange_s=exchange_s,
    )


def step_read_bytes(weight_bytes: float, kv_bytes_per_request: float, batch: int) -> float:
    """W + B·K: what one decode step reads, every weight once and each request's KV."""
    return weight_bytes + batch * kv_bytes_per_request


def read_only_step_s(weight_bytes: float, kv_bytes_per_request: float, batch: int, hbm_bytes_per_s: float) -> float:
    """(W + B·K)/β, the §4 read-only view; its throughput B/t tends to β/K as B grows."""
    return step_read_bytes(weight_bytes, kv_bytes_per_request, batch) / hbm_bytes_per_s
