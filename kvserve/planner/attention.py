"""Attention work (seed §2, §4): history term plus triangle, causal pairs.

One Query head reading S sources costs ≈ 4·S·H FLOPs (Q·Kᵀ and A·V). New position t of
a block of T appended to S0 cached positions reads S0 + t sources, so the block costs
4H·Σ_{t=1..T}(S0 + t) = 4H·(T·S0 + T(T+1)/2): a history term that grows with S0 and
a triangle among the new positions.
"""

from __future__ import annotations


def attention_history_flops(cached_positions: int, new_positions: int, head_dim: int) -> float:
    """4·H·T·S0 per layer per Query head: every new position reads all S0 cached ones."""
    return 4 * head_dim * new_positions * cached_positions


def attention_triangle_flops(new_positions: int, head_dim: int) -> float:
    """4·H·T(T+1)/2 per layer per Query head: new positions reading themselves causally."""
    return 4 * head_dim * causal_pairs(new_positions)


def attention_flops(cached_positions: int, new_positions: int, head_dim: int, num_layers: int = 1, num_query_heads: int = 1) -> float:
    """L·N_q·4H·(T·S0 + T(T+1)/2)."""
    per_head = attention_history_flops(cached_positions, new_positions, head_dim) + attention_triangle_flops(new_positions, head_dim)
    return num_layers * num_query_heads * per_head


def causal_pairs(positions: int) -> int:
    """S(S+1)/2 allowed (query, source) pairs of one causal sequence, diagonal included."""
    return positions * (positions + 1) // 2


def independent_sequences_pairs(positions: int, num_sequences: int) -> int:
    """The same positions cut into k independent sequences: k·(S/k)(S/k+1)/2 pairs."""
    base, extra = divmod(positions, num_sequences)
    return extra * causal_pairs(base + 1) + (num_sequences - extra) * causal_pairs(base)


def attention_weight_shape(cached_positions: int, new_positions: int) -> tuple[int, int]:
    """[m, S0+m]: m new Query rows against S0 history plus m new sources."""
    return (new_positions, cached_positions + new_positions)
