"""KV-cache bytes (seed §3): per position, logical vs physical, shared-prefix storage vs reads.

`c_kv = 2·L·N_kv·H·p_kv` bytes per request per position (K and V, every layer). A batch
holds `Σ_b S_b · c_kv` logically; what is physically allocated adds layout replication
and page rounding, and what a decode step reads can exceed what is stored when a
shared prefix is scanned once per request.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# c_kv = 2·L·N_kv·H·p_kv: one formula for engine and planner, kept with the architecture
from kvserve.arch import kv_bytes_per_position  # noqa: F401


def logical_kv_bytes(history_positions: Sequence[int] | int, kv_bytes_per_position: float, batch: int = 1) -> float:
    """Σ_b S_b · c_kv; an int S stands for `batch` equal requests (B·S·c_kv)."""
    if isinstance(history_positions, int):
        return batch * history_positions * kv_bytes_per_position
    return sum(history_positions) * kv_bytes_per_position


def held_positions(history_positions: int, layer_windows: Sequence[int | None]) -> float:
    """Positions of KV a request of S keeps per layer, averaged over the layers: S for a global
    layer, min(S, W) for one with a sliding window W (its older positions are never read
    again, and the engine gives their blocks back: engine/kv_groups.py). S without windows."""
    if not layer_windows or all(w is None for w in layer_windows):
        return float(history_positions)
    return sum(history_positions if w is None else min(history_positions, w) for w in layer_windows) / len(layer_windows)


def held_positions_paged(history_positions: int, layer_windows: Sequence[int | None], kv_block_positions: int) -> float:
    """`held_positions` in whole blocks of b: a global layer's ⌈S/b⌉·b, a windowed one's the
    blocks from position (S - W)'s on (engine/kv_groups.py `blocks_held`)."""
    b = kv_block_positions
    if not layer_windows or all(w is None for w in layer_windows):
        return float(paged_positions(history_positions, b))
    total = math.ceil(history_positions / b)
    held = [total if w is None else total - max(0, history_positions - w) // b for w in layer_windows]
    return sum(held) * b / len(layer_windows)


def paged_positions(history_positions: int, kv_block_positions: int) -> int:
    """Positions actually allocated when KV lives in blocks: the tail block is whole."""
    return math.ceil(history_positions / kv_block_positions) * kv_block_positions


def physical_kv_bytes(
    batch: int, history_positions: int, kv_bytes_per_position: float,
    kv_block_positions: int = 1, replication_factor: float = 1.0,
) -> float:
    """B · ⌈S/b⌉·b · c_kv · ρ: logical bytes plus page rounding and layout replication ρ."""
    return batch * paged_positions(history_positions, kv_block_positions) * kv_bytes_per_position * replication_factor


def shared_prefix_stored_bytes(num_requests: int, shared_positions: int, private_positions: int, kv_bytes_per_position: float) -> float:
    """(S_shared + B·S_private)·c_kv: the common prefix is stored once."""
    return (shared_positions + num_requests * private_positions) * kv_bytes_per_position


def shared_prefix_read_bytes(num_requests: int, shared_positions: int, private_positions: int, kv_bytes_per_position: float) -> float:
    """B·(S_shared + S_private)·c_kv: a kernel scanning history per request, with no on-chip
    reuse across requests, reads the shared prefix from HBM once per request."""
    return num_requests * (shared_positions + private_positions) * kv_bytes_per_position


def shared_prefix_read_once_bytes(num_requests: int, shared_positions: int, private_positions: int, kv_bytes_per_position: float) -> float:
    """(S_shared + B·S_private)·c_kv: shared-prefix attention loads each shared block once and
    lets every request's queries use it (kvserve/attention/shared_prefix_plan.py), so a step reads the
    prefix once plus each request's private part, the same bytes as are stored."""
    return (shared_positions + num_requests * private_positions) * kv_bytes_per_position


def gqa_intensity_flops_per_byte(queries_per_kv_head: int, bytes_per_kv_element: float) -> float:
    """4·g·S·H FLOPs over 2·S·H·p_kv bytes of K and V = 2g/p_kv (≈ g for bf16); independent of S."""
    return 2 * queries_per_kv_head / bytes_per_kv_element


def reusable_prefix_positions(cached: Sequence, new: Sequence) -> int:
    """Length of the exact common prefix: only it has reusable KV (abcdef vs abcxefg → 3)."""
    count = 0
    for a, b in zip(cached, new):
        if a != b:
            break
        count += 1
    return count
