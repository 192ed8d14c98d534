"""Attention over the paged KV cache, in plain torch (the reference path).

The K and V pools of a layer are `[num_blocks, block_size, N_kv, H]`; seen as
`[num_slots, N_kv * H]`, a request's history is gathered with one `index_select`
(far faster on CPU than advanced indexing). For decode, query heads are folded per KV
head, `[N_kv, g, H]`, so one SDPA call serves all g query heads of a KV head without
repeating K/V (the GQA read pattern of the seed's §3).

An int8 cache (`--kv-cache-dtype int8`) keeps int8 pools and, beside each, a scale pool
`[num_blocks, block_size, N_kv]` fp32: K/V are quantized as they are written and
dequantized as they are gathered (`quantize_kv`, `dequantize_kv`), so attention itself is
the float path. This is the reference the C++ kernels' int8 paths are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.cascade import cascade_decode_attention, cascade_decode_attention_kernels
from kvserve.attention.metadata import AttentionMetadata


# The int8 rule, shared by every writer (write_kv here, rope_and_cache_int8 in
# kernels/norm_rope_act.cpp): each (position, KV head) row of H values is quantized on its
# own, symmetrically: scale = max|x| / 127 (fp32), q = round(x / scale) (half to even)
# clamped to [-127, 127]; an all-zero row has scale 0 and q = 0. K is quantized after RoPE,
# so the cache holds rotated keys as the float cache does. A value reads back as q · scale.
# The scale is fp32 rather than fp16: exact for any row (no range or rounding question), and
# the kernels multiply by it without a conversion; it costs 4 bytes per H = 64 elements.
def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] → (int8 [..., H], fp32 scales [...])."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1) / 127
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)  # zero rows: 0 / 1 = 0
    return torch.round(x32 / divisor).clamp_(-127, 127).to(torch.int8), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., H] and scales [...] → values in `dtype` (the product in fp32, rounded once)."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def write_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Store the new positions' K/V ([T, N_kv, H]) in their slots before anyone attends;
    with scale pools (int8 pools), quantized (`quantize_kv`)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if k_scale is not None:
        k, ks = quantize_kv(k)
        v, vs = quantize_kv(v)
        k_scale.view(-1, num_kv_heads).index_copy_(0, slot_mapping, ks)
        v_scale.view(-1, num_kv_heads).index_copy_(0, slot_mapping, vs)
    k_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather(pool: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows of the pool at these slots: [..., N_kv, H]; with the pool's scales (int8),
    dequantized to `dtype`."""
    num_kv_heads, head_dim = pool.shape[-2], pool.shape[-1]
    flat = pool.view(-1, num_kv_heads * head_dim).index_select(0, slots.reshape(-1))
    rows = flat.view(*slots.shape, num_kv_heads, head_dim)
    if scales is None:
        return rows
    s = scales.view(-1, num_kv_heads).index_select(0, slots.reshape(-1)).view(*slots.shape, num_kv_heads)
    return dequantize_kv(rows, s, dtype)


def decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, N_q, H], one new position per request → [B, N_q, H]."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[-2]
    g = num_heads // num_kv_heads
    k = gather(k_pool, meta.decode_slots, k_scale, q.dtype).permute(0, 2, 1, 3)  # [B, N_kv, S, H]
    v = gather(v_pool, meta.decode_slots, v_scale, q.dtype).permute(0, 2, 1, 3)
    qg = q.view(batch, num_kv_heads, g, head_dim)  # g query heads of a KV head as g "rows"
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.decode_mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def prefill_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Each segment's m queries attend to its S0 cached + m new positions (rectangular mask).

    K/V heads are repeated to the query heads here: prefill is compute-bound, and SDPA's
    fused causal path (no mask tensor at all when S0 = 0) beats every masked variant.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pool.shape[-2]
    g = num_heads // num_kv_heads
    groups, alone = meta.prefill_groups()
    for grp in groups:
        n, m = grp.num_segments, grp.num_new
        rows = slice(grp.query_start, grp.query_start + n * m)
        qs = q[rows].view(n, m, num_heads, head_dim).transpose(1, 2)  # [n, N_q, m, H]
        k = gather(k_pool, grp.slots, k_scale, q.dtype).view(n, m, num_kv_heads, head_dim).transpose(1, 2)
        v = gather(v_pool, grp.slots, v_scale, q.dtype).view(n, m, num_kv_heads, head_dim).transpose(1, 2)
        if g > 1:
            k = k.repeat_interleave(g, dim=1)
            v = v.repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale)
        out[rows] = o.transpose(1, 2).reshape(n * m, num_heads, head_dim)
    # a shared cached prefix (meta.prefill_sharing) is gathered once, by its leader, and each
    # member gathers only its positions after it: the same K/V values, so the same result
    reads: dict[int, tuple[int, int]] = {}  # id(segment) -> (leader, shared_len), the leader's own included
    shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, (leader, length) in enumerate(meta.prefill_sharing or ()):
        if length:
            reads[id(meta.prefills[i])] = reads[id(meta.prefills[leader])] = (leader, length)
    for leader, length in set(reads.values()):
        slots = meta.prefills[leader].context_slots[:length]
        shared_kv[leader] = (gather(k_pool, slots, k_scale, q.dtype), gather(v_pool, slots, v_scale, q.dtype))
    for seg in alone:
        m = seg.num_new
        qs = q[seg.query_start : seg.query_start + m].transpose(0, 1).unsqueeze(0)  # [1, N_q, m, H]
        leader, length = reads.get(id(seg), (0, 0))
        if length:
            ks, vs = shared_kv[leader]
            own = seg.context_slots[length:]
            k = torch.cat([ks[:length], gather(k_pool, own, k_scale, q.dtype)]).transpose(0, 1)  # [N_kv, S0+m, H]
            v = torch.cat([vs[:length], gather(v_pool, own, v_scale, q.dtype)]).transpose(0, 1)
        else:
            k = gather(k_pool, seg.context_slots, k_scale, q.dtype).transpose(0, 1)  # [N_kv, S0+m, H]
            v = gather(v_pool, seg.context_slots, v_scale, q.dtype).transpose(0, 1)
        if g > 1:
            k = k.repeat_interleave(g, dim=0)
            v = v.repeat_interleave(g, dim=0)
        if seg.num_cached == 0:
            o = F.scaled_dot_product_attention(qs, k.unsqueeze(0), v.unsqueeze(0), is_causal=True, scale=scale)
        else:
            bias = seg.attn_bias if seg.attn_bias.dtype == q.dtype else seg.attn_bias.to(q.dtype)
            o = F.scaled_dot_product_attention(qs, k.unsqueeze(0), v.unsqueeze(0), attn_mask=bias, scale=scale)
        out[seg.query_start : seg.query_start + m] = o[0].transpose(0, 1)


def paged_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata, scale: float,
    decode_ops=None, prefill_ops=None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, N_q, H] for the flat batch (decodes first) → [T, N_q, H].

    `decode_ops` / `prefill_ops`: the compiled module where KernelSupport turned that kernel
    on for this model (else None). The decode kernel reads the block pool in place through
    the block tables, the prefill kernel reads prompt tokens' K/V through their slots;
    without them, decodes and prompts gather and call SDPA (the reference path).
    `k_scale` / `v_scale`: the scale pools of int8 pools (None for float pools).
    A `meta.cascade` plan runs the decodes in parts, each shared prefix read once per group
    (attention/cascade.py): on the kernels where the plan was built for them (bf16 queries,
    bf16 or int8 pools), else on the reference path. `meta.row_tables` (--deterministic)
    runs every row, decode or prompt, through the decode kernel.
    """
    if meta.row_tables is not None and decode_ops is not None:  # --deterministic: one kernel for every row
        tables, lens = meta.row_tables
        return decode_ops.paged_decode_attention(q, k_pool, v_pool, tables, lens, scale, k_scale, v_scale)
    plan = meta.cascade
    on_kernels = decode_ops is not None and plan is not None and plan.uses_kernels
    if meta.num_decodes and not meta.prefills and decode_ops is not None:
        if on_kernels:
            return cascade_decode_attention_kernels(
                q, k_pool, v_pool, plan, scale, decode_ops, meta.decode_block_tables, meta.decode_context_lens,
                k_scale, v_scale,
            )
        return decode_ops.paged_decode_attention(
            q, k_pool, v_pool, meta.decode_block_tables, meta.decode_context_lens, scale, k_scale, v_scale
        )
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if meta.num_decodes:
        if on_kernels:
            out[: meta.num_decodes] = cascade_decode_attention_kernels(
                q[: meta.num_decodes], k_pool, v_pool, plan, scale, decode_ops, meta.decode_block_tables,
                meta.decode_context_lens, k_scale, v_scale,
            )
        elif decode_ops is not None:
            out[: meta.num_decodes] = decode_ops.paged_decode_attention(
                q[: meta.num_decodes], k_pool, v_pool, meta.decode_block_tables, meta.decode_context_lens, scale,
                k_scale, v_scale,
            )  # fmt: skip
        elif meta.cascade is not None:  # shared prefixes read once per group (attention/cascade.py)
            out[: meta.num_decodes] = cascade_decode_attention(
                q[: meta.num_decodes], k_pool, v_pool, meta.cascade, scale, k_scale, v_scale
            )
        else:
            out[: meta.num_decodes] = decode_attention(q[: meta.num_decodes], k_pool, v_pool, meta, scale, k_scale, v_scale)
    if meta.prefills:
        if prefill_ops is not None:
            slots, segments, shared = meta.prefill_kernel_args()
            prefill_ops.paged_prefill_attention(q, k_pool, v_pool, slots, segments, scale, out, k_scale, v_scale, shared)
        else:
            prefill_attention(q, k_pool, v_pool, meta, scale, out, k_scale, v_scale)
    return out
