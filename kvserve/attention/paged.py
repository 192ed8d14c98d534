"""Attention over the paged KV cache for one layer's step: each part on the CPU kernels where
they are turned on for the model, else on the plain-torch reference (attention/reference.py).

The decode kernel reads the block pool in place through the block tables, and runs a
shared-prefix plan built for it in one call (`shared_prefix_decode_attention_kernels`);
the prefill kernel reads prompt tokens' K/V through their slots.
"""

from __future__ import annotations

import torch

from kvserve.attention.metadata import AttentionMetadata, SharedPrefixTensors
from kvserve.attention.reference import decode_attention, prefill_attention, shared_prefix_decode_attention
from kvserve.attention.sliding_window import windowed_attention


def shared_prefix_decode_attention_kernels(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, shared: SharedPrefixTensors, scale: float, ops,
    block_tables: torch.Tensor, context_lens: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """The same parts as `shared_prefix_decode_attention`, on the CPU kernels (bf16 queries;
    bf16 pools, or int8 ones with their scales), in one call (ops.shared_prefix_decode_attention,
    kernels/shared_prefix_decode.cpp, the function the fused decode step runs per layer): every
    row's suffix (`paged_decode_attention_lse` from its suffix start), then each level's
    members against the level's blocks (`shared_prefix_attention`: each block read once for
    all of them), merged in fp32 in the same order as the reference: suffix, then levels outer
    to inner. q: [B, N_q, H] → [B, N_q, H] in q's dtype."""
    return ops.shared_prefix_decode_attention(
        q, k_pool, v_pool, block_tables, context_lens, shared.kernel_plan, scale, k_scale, v_scale, softcap or 0.0
    )


def paged_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata, scale: float,
    decode_ops=None, prefill_ops=None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """q: [T, N_q, H] for the flat batch (decodes first) → [T, N_q, H].

    `decode_ops` / `prefill_ops`: the compiled module where KernelSupport turned that kernel
    on for this model (else None). The decode kernel reads the block pool in place through
    the block tables, the prefill kernel reads prompt tokens' K/V through their slots;
    without them, decodes and prompts gather and call SDPA (the reference path).
    `k_scale` / `v_scale`: the scale pools of int8 pools (None for float pools).
    A `meta.shared_prefix` plan runs the decodes in parts, each shared prefix read once per
    group: on the kernels where the plan was built for them (bf16 queries, bf16 or int8
    pools), else on the reference path. `meta.row_tables` (--deterministic)
    runs every row, decode or prompt, through the decode kernel. A layer with a sliding
    `window` that some row of the step sees past runs within it (attention/sliding_window.py).
    `softcap` (Gemma 2's soft-capped scores, cap · tanh(s / cap)) is applied by whichever
    path runs, kernel or reference.
    """
    cap = softcap or 0.0  # the kernels' 0: none
    rows = meta.windowed.get(window) if window is not None else None
    if rows is not None:
        return windowed_attention(q, k_pool, v_pool, meta, rows, scale, decode_ops, k_scale, v_scale, softcap)
    if meta.row_tables is not None and decode_ops is not None:  # --deterministic: one kernel for every row
        tables, lens = meta.row_tables
        return decode_ops.paged_decode_attention(q, k_pool, v_pool, tables, lens, scale, k_scale, v_scale, cap)
    plan = meta.shared_prefix
    on_kernels = decode_ops is not None and plan is not None and plan.on_kernels
    if meta.num_decodes and not meta.prefills and decode_ops is not None:
        if on_kernels:
            return shared_prefix_decode_attention_kernels(
                q, k_pool, v_pool, plan, scale, decode_ops, meta.decode_block_tables, meta.decode_context_lens,
                k_scale, v_scale, softcap,
            )
        return decode_ops.paged_decode_attention(
            q, k_pool, v_pool, meta.decode_block_tables, meta.decode_context_lens, scale, k_scale, v_scale, cap
        )
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if meta.num_decodes:
        if on_kernels:
            out[: meta.num_decodes] = shared_prefix_decode_attention_kernels(
                q[: meta.num_decodes], k_pool, v_pool, plan, scale, decode_ops, meta.decode_block_tables,
                meta.decode_context_lens, k_scale, v_scale, softcap,
            )
        elif decode_ops is not None:
            out[: meta.num_decodes] = decode_ops.paged_decode_attention(
                q[: meta.num_decodes], k_pool, v_pool, meta.decode_block_tables, meta.decode_context_lens, scale,
                k_scale, v_scale, cap,
            )  # fmt: skip
        elif plan is not None:  # shared prefixes read once per group, on the reference path
            out[: meta.num_decodes] = shared_prefix_decode_attention(
                q[: meta.num_decodes], k_pool, v_pool, plan, scale, k_scale, v_scale, softcap
            )
        else:
            out[: meta.num_decodes] = decode_attention(
                q[: meta.num_decodes], k_pool, v_pool, meta, scale, k_scale, v_scale, softcap
            )
    if meta.prefills:
        if prefill_ops is not None:
            slots, segments, shared = meta.prefill_kernel_args()
            prefill_ops.paged_prefill_attention(q, k_pool, v_pool, slots, segments, scale, out, k_scale, v_scale, shared, cap)
        else:
            prefill_attention(q, k_pool, v_pool, meta, scale, out, k_scale, v_scale, softcap)
    return out
