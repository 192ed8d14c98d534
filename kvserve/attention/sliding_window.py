"""Attention within a sliding window: a layer with window W (every layer of Mistral v0.1, Gemma
3's local layers, Qwen2's upper layers under use_sliding_window) lets the query at position p
see keys p - W + 1 .. p only, W positions with its own (transformers' sliding mask, llama.cpp's
n_swa).

A step whose every row's context fits in W runs a windowed layer exactly as a global one: the
window hides nothing, so the prefill kernel, the shared-prefix plan and the fused decode step
all apply unchanged. A step with a row past W carries `WindowedRows` for that window (built
once per step by the model runner, shared by the layers of that window), and those layers run
every row of the step, decode or prompt, over its own range [max(0, p + 1 - W), p + 1):

- on the CPU kernels, as one call of the decode kernel's ranged form
  (ops.paged_decode_attention_lse: the pool read in place through each row's block table; a
  row's bits depend on its own range only, so they are the same whichever step, chunk or
  batch it is in, which --deterministic relies on); a decode-only step makes the same call
  inside the fused decode step, from these start positions (kernels/fused_decode.cpp);
- on the reference path, decode rows gathered over their range (at most W positions each) and
  attended batched, prompt chunks in tiles of queries, each tile over the keys its rows see.

A prompt's rows on the kernels each read their W keys rather than sharing tiles as the prefill
kernel does: the windowed prefill costs O(m · W) reads where a tiled one would cost O(m + W),
a price paid only by steps whose context passes the window.
"""

from __future__ import annotations

import dataclasses

import torch

from kvserve.attention.kv_pool import gather
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.reference import attend_rows, sdpa

QUERY_TILE = 256  # the reference path's prompt queries per SDPA call


@dataclasses.dataclass(frozen=True)
class WindowedRows:
    """One window's view of a step's rows (decodes first, then prompt rows, the step's order)."""

    window: int
    # the kernels: every row as a decode query over [start, len)
    block_tables: torch.Tensor | None = None  # [T, max_blocks] int32
    context_lens: torch.Tensor | None = None  # [T] int32, position + 1
    start_positions: torch.Tensor | None = None  # [T] int32, max(0, len - W)
    # the reference path: the decode rows' ranges gathered (prompt chunks go by their segments)
    decode_slots: torch.Tensor | None = None  # [num_decodes, width] long, padded with each row's last slot
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, width] bool (True = visible)

    @classmethod
    def for_kernels(cls, window: int, block_tables: torch.Tensor, context_lens: torch.Tensor) -> "WindowedRows":
        """Every row's table and length (the runner's `row_tables` form) and its window's start."""
        starts = (context_lens - window).clamp_(min=0).to(torch.int32)
        return cls(window, block_tables=block_tables, context_lens=context_lens, start_positions=starts)

    @classmethod
    def for_reference(
        cls, window: int, decode_tables: list[list[int]], decode_lens: list[int], block_size: int, device: torch.device
    ) -> "WindowedRows":
        """The decode rows' last min(len, W) positions as slots, with their visibility."""
        if not decode_lens:
            return cls(window)
        lens = torch.tensor(decode_lens)
        width = min(window, int(lens.max()))
        starts = (lens - window).clamp(min=0)
        positions = starts.unsqueeze(1) + torch.arange(width)  # [B, width]
        visible = positions < lens.unsqueeze(1)
        positions = torch.minimum(positions, (lens - 1).unsqueeze(1))  # padding reads the row's last slot, masked
        width_blocks = max(len(t) for t in decode_tables)
        tables = torch.tensor([t + [0] * (width_blocks - len(t)) for t in decode_tables], dtype=torch.long)
        slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
        return cls(window, decode_slots=slots.to(device), decode_mask=visible.view(len(decode_lens), 1, 1, width).to(device))

    @property
    def on_kernels(self) -> bool:
        return self.block_tables is not None


def windowed_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata, rows: WindowedRows,
    scale: float, decode_ops=None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [T, N_q, H], the step's rows → [T, N_q, H] in q's dtype, each row within the window."""
    if rows.on_kernels and decode_ops is not None:
        out, _ = decode_ops.paged_decode_attention_lse(
            q, k_pool, v_pool, rows.block_tables, rows.context_lens, rows.start_positions, scale, k_scale, v_scale,
            softcap or 0.0,
        )
        return out.to(q.dtype)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if meta.num_decodes:
        out[: meta.num_decodes] = attend_rows(
            q[: meta.num_decodes], k_pool, v_pool, rows.decode_slots, rows.decode_mask, scale, k_scale, v_scale, softcap
        )
    for seg in meta.prefills:
        _windowed_segment(q, k_pool, v_pool, seg, rows.window, scale, out, k_scale, v_scale, softcap)
    return out


def _windowed_segment(q, k_pool, v_pool, seg, window: int, scale: float, out, k_scale, v_scale, softcap) -> None:
    """A prompt chunk's m queries (positions S0 .. S0 + m - 1) in tiles, each tile over the keys
    its rows see, [first row's position - W + 1, last row's position], masked per row."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pool.shape[-2]
    g = num_heads // num_kv_heads
    for a in range(0, seg.num_new, QUERY_TILE):
        b = min(a + QUERY_TILE, seg.num_new)
        first, last = seg.num_cached + a, seg.num_cached + b - 1  # the tile's positions
        lo = max(0, first - window + 1)
        slots = seg.context_slots[lo : last + 1]
        k = gather(k_pool, slots, k_scale, q.dtype).transpose(0, 1)  # [N_kv, keys, H]
        v = gather(v_pool, slots, v_scale, q.dtype).transpose(0, 1)
        if g > 1:
            k = k.repeat_interleave(g, dim=0)
            v = v.repeat_interleave(g, dim=0)
        pos = torch.arange(first, last + 1, device=q.device).unsqueeze(1)
        keys = torch.arange(lo, last + 1, device=q.device).unsqueeze(0)
        visible = (keys <= pos) & (keys > pos - window)
        rows = slice(seg.query_start + a, seg.query_start + b)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, N_q, tile, H]
        o = sdpa(qs, k.unsqueeze(0), v.unsqueeze(0), scale, visible, softcap=softcap)
        out[rows] = o[0].transpose(0, 1).reshape(b - a, num_heads, head_dim)
