"""What batch fits, and the largest that meets a step target (seed §5, §6, §8).

Capacity is per chip: W/N + K_alloc,chip(B) ≤ H_mem − R on the busiest chip. Comparing
the whole machine's memory with the unique logical bytes misses layout replication,
so both are reported: the ideal N·H_mem − N·R − W of §8 and the per-chip limit.

Where the model's full shape is known, W/N here is the busiest chip's exact share
(`Placement.weight_bytes_in_memory`, weight_shares.py): memory is a hard limit, so a
batch said to fit must fit the bytes the chip really holds. Without it, the seed's W/N.
"""

from __future__ import annotations

import math

from kvserve.planner.layout import Placement
from kvserve.planner.roofline import step_time

# floor() of a ratio that is an exact integer in real arithmetic must not lose one
_ROUNDING_SLACK = 1e-9


def free_bytes_per_chip(hbm_bytes: float, reserved_bytes_per_chip: float, placement: Placement) -> float:
    """H_mem − R − W/N (W_chip, the exact share, where known): what is left on a chip for KV."""
    return hbm_bytes - reserved_bytes_per_chip - placement.weight_bytes_in_memory


def capacity_batch(hbm_bytes: float, reserved_bytes_per_chip: float, placement: Placement) -> int:
    """Largest B whose busiest-chip KV fits; 0 when the weights alone do not fit."""
    free = free_bytes_per_chip(hbm_bytes, reserved_bytes_per_chip, placement)
    per_request = placement.kv_bytes_per_request_allocated * placement.kv_fraction_per_chip
    if free < 0:
        return 0
    requests_per_chip = math.floor(free / per_request + _ROUNDING_SLACK)
    return requests_per_chip if placement.layout == "heads" else requests_per_chip * placement.num_chips


def fits(hbm_bytes: float, reserved_bytes_per_chip: float, placement: Placement, batch: int) -> bool:
    used = placement.weight_bytes_in_memory + placement.kv_allocated_bytes_on_busiest_chip(batch)
    return used <= hbm_bytes - reserved_bytes_per_chip


def ideal_kv_capacity_bytes(num_chips: int, hbm_bytes: float, reserved_bytes_per_chip: float, weight_bytes: float) -> float:
    """N·H_mem − N·R − W: KV room with no replication and perfectly even shards (§8)."""
    return num_chips * hbm_bytes - num_chips * reserved_bytes_per_chip - weight_bytes


def max_batch_meeting_target(
    placement: Placement, limit: int, step_target_s: float, peak_flops_per_s: float, hbm_bytes_per_s: float, exchange_s: float = 0.0,
    experts=None,
) -> int:
    """Largest integer B ≤ `limit` with t_step(B) ≤ target; 0 if even B=1 misses it.

    t_step is non-decreasing in B, so a bisection finds the boundary; every candidate's
    KV read is recomputed at its own B (the seed's warning not to reuse an old batch's), and a
    mixture of experts' weight read too (`experts`, planner/moe.py: it grows with B).
    """
    def meets(batch: int) -> bool:
        return step_time(placement, batch, peak_flops_per_s, hbm_bytes_per_s, exchange_s, experts).total_s <= step_target_s

    low, high = 0, limit  # invariant: meets(low) or low == 0; the answer is in [low, high]
    while low < high:
        mid = (low + high + 1) // 2
        if meets(mid):
            low = mid
        else:
            high = mid - 1
    return low


def tokens_per_s(batch: int, step_s: float) -> float:
    """B/t: one token per request per step."""
    return batch / step_s


def tokens_per_s_per_chip(batch: int, step_s: float, num_chips: int) -> float:
    """B/(N·t)."""
    return batch / (num_chips * step_s)
