"""What one forward step's attention needs to know, built once per step and shared by all layers.

The flat token batch is ordered decodes first (one new position each), then prefill segments
(a whole prompt, or a chunk over cached history). For every request, `S0` positions are
already cached and `m` are new; the new K/V go to `slot_mapping` before anything attends.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class PrefillSegment:
    query_start: int  # offset of this request's first new token in the flat batch
    num_new: int  # m
    num_cached: int  # S0
    context_slots: torch.Tensor  # [S0 + m] slot of every visible position, in order
    # [m, S0 + m] additive mask (0 visible, -inf hidden), built once per step for all layers;
    # None when S0 = 0, where the plain causal mask applies
    attn_bias: torch.Tensor | None


@dataclasses.dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decodes: int
    # Decode requests, batched: each row lists the slots of its S0 + 1 positions, padded to
    # the longest with slot 0 and masked out.
    decode_slots: torch.Tensor | None  # [num_decodes, max_context] long
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context] bool (True = visible)
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32, S0 + 1
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32, for in-place kernels
    prefills: list[PrefillSegment]


def context_slots(block_table: list[int], num_positions: int, block_size: int) -> torch.Tensor:
    """Physical slots of logical positions [0, num_positions): block_table[p // bs] * bs + p % bs."""
    positions = torch.arange(num_positions)
    blocks = torch.tensor(block_table, dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


def rectangular_causal_mask(num_cached: int, num_new: int) -> torch.Tensor:
    """[m, S0 + m]: history fully visible; in the new block only the strictly upper triangle is hidden."""
    cols = torch.arange(num_cached + num_new)
    rows = torch.arange(num_new).unsqueeze(1)
    return cols <= rows + num_cached


def rectangular_causal_bias(num_cached: int, num_new: int, dtype: torch.dtype) -> torch.Tensor:
    """The same mask as an additive bias: 0 where visible, -inf where hidden."""
    visible = rectangular_causal_mask(num_cached, num_new)
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
