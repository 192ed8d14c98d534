"""Attention over the paged KV cache in plain torch: the reference path the C++ kernels are tested against.

Each request's history is gathered from the pools (attention/kv_pool.py, dequantized for
int8 pools) and attended with SDPA. For decode, query heads are folded per KV head,
`[N_kv, g, H]`, so one SDPA call serves all g query heads of a KV head without repeating
K/V (the GQA read pattern of the seed's §3). A decode batch with a shared-prefix plan runs
in parts, each shared level gathered once for its group (`shared_prefix_decode_attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.kv_pool import gather
from kvserve.attention.merge import attention_with_lse, merge_attention_states
from kvserve.attention.metadata import AttentionMetadata, SharedPrefixTensors


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
    is_causal: bool = False, softcap: float | None = None,
) -> torch.Tensor:
    """torch's scaled_dot_product_attention; with `softcap` (Gemma 2's attention-logit soft-capping,
    which SDPA has no form of), written out as transformers' eager path computes it: scores
    · scale, capped to cap · tanh(s / cap), masked (a bool mask, or an additive bias), softmax
    in fp32, then · V. q [..., M, H], k and v [..., S, H] → [..., M, H] in q's dtype."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:  # the last M of S positions: query i sees keys up to S - M + i
        m, n = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(m, n, dtype=torch.bool, device=q.device).tril(n - m)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """q: [B, N_q, H], one new position per request → [B, N_q, H]."""
    return attend_rows(q, k_pool, v_pool, meta.decode_slots, meta.decode_mask, scale, k_scale, v_scale, softcap)


def attend_rows(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Each row of q ([B, N_q, H]) over the positions at its row of `slots` ([B, S]) that its
    row of `mask` ([B, 1, 1, S], True = visible) shows → [B, N_q, H]."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[-2]
    g = num_heads // num_kv_heads
    k = gather(k_pool, slots, k_scale, q.dtype).permute(0, 2, 1, 3)  # [B, N_kv, S, H]
    v = gather(v_pool, slots, v_scale, q.dtype).permute(0, 2, 1, 3)
    qg = q.reshape(batch, num_kv_heads, g, head_dim)  # g query heads of a KV head as g "rows"
    out = sdpa(qg, k, v, scale, mask, softcap=softcap)
    return out.reshape(batch, num_heads, head_dim)


def prefill_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, softcap: float | None = None,
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
        o = sdpa(qs, k, v, scale, is_causal=True, softcap=softcap)
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
            o = sdpa(qs, k.unsqueeze(0), v.unsqueeze(0), scale, is_causal=True, softcap=softcap)
        else:
            bias = seg.attn_bias if seg.attn_bias.dtype == q.dtype else seg.attn_bias.to(q.dtype)
            o = sdpa(qs, k.unsqueeze(0), v.unsqueeze(0), scale, bias, softcap=softcap)
        out[seg.query_start : seg.query_start + m] = o[0].transpose(0, 1)


def shared_prefix_decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, shared: SharedPrefixTensors, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """q: [B, N_q, H], one new position per decode row → [B, N_q, H] in q's dtype.

    Each level's shared K/V is gathered once (dequantized for int8 pools) and all its
    members' queries attend to it in one product: [N_kv, n·g, H] x [N_kv, H, S]. The
    suffixes run batched with a padding mask. Parts are merged through their lse.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[-2]
    g = num_heads // num_kv_heads
    qg = q.view(batch, num_kv_heads, g, head_dim)
    # the suffixes, every row: [B, N_kv, g, H] and lse [B, N_kv, g]
    k = gather(k_pool, shared.suffix_slots, k_scale, q.dtype).permute(0, 2, 1, 3)  # [B, N_kv, Ls, H]
    v = gather(v_pool, shared.suffix_slots, v_scale, q.dtype).permute(0, 2, 1, 3)
    acc_out, acc_lse = attention_with_lse(qg, k, v, scale, shared.suffix_mask, softcap)
    for slots, idx in zip(shared.level_slots, shared.level_members):
        n = idx.numel()
        ks = gather(k_pool, slots, k_scale, q.dtype).transpose(0, 1)  # [N_kv, S, H], read once for n rows
        vs = gather(v_pool, slots, v_scale, q.dtype).transpose(0, 1)
        qs = qg.index_select(0, idx).permute(1, 0, 2, 3).reshape(num_kv_heads, n * g, head_dim)
        o, lse = attention_with_lse(qs, ks, vs, scale, softcap=softcap)  # non-causal: all shared positions visible
        o = o.view(num_kv_heads, n, g, head_dim).permute(1, 0, 2, 3)
        lse = lse.view(num_kv_heads, n, g).permute(1, 0, 2)
        merged, merged_lse = merge_attention_states(acc_out.index_select(0, idx), acc_lse.index_select(0, idx), o, lse)
        acc_out.index_copy_(0, idx, merged)
        acc_lse.index_copy_(0, idx, merged_lse)
    return acc_out.to(q.dtype).reshape(batch, num_heads, head_dim)
