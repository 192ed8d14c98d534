"""Writing and reading the paged KV pools, in plain torch; int8 pools quantized on the way in.

The K and V pools of a layer are `[num_blocks, block_size, N_kv, H]`; seen as
`[num_slots, N_kv * H]`, a request's history is gathered with one `index_select`
(far faster on CPU than advanced indexing).

An int8 cache (`--kv-cache-dtype int8`) keeps int8 pools and, beside each, a scale pool
`[num_blocks, block_size, N_kv]` fp32: K/V are quantized as they are written and
dequantized as they are gathered (`quantize_kv`, `dequantize_kv`), so attention itself is
the float path. The rule here is the one the C++ kernels' int8 paths are tested against.
"""

from __future__ import annotations

import torch


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
