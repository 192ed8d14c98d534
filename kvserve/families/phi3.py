"""Phi-3, Phi-3.5 and Phi-4-mini: Q, K and V stored as one projection and gate and up as another
(cut into the decoder's names at load, `split_fused_projections`), partial rotary
(`partial_rotary_factor`, read by arch.py for every family) and LongRoPE (arch.py's RoPE scaling)."""

from __future__ import annotations

from typing import Any, Callable

from kvserve.families.base import Family


def split_fused_projections(weights: dict, arch: Any, cut: Callable[[Any, int, int, str], Any]) -> None:
    """`qkv_proj` and `gate_up_proj` cut into the Llama names (the layers join them again in
    their own fused layout). `cut(tensor, lo, hi, name)`: rows [lo, hi) of a loaded tensor,
    the loader's (a quantized weight is cut between its packed groups of rows)."""
    q, kv, ffn = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    for name in [n for n in weights if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]:
        fused = weights.pop(name)
        if name.endswith("qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            for part, (lo, hi) in zip("qkv", ((0, q), (q, q + kv), (q + kv, q + 2 * kv))):
                weights[f"{base}{part}_proj.weight"] = cut(fused, lo, hi, name)
        else:
            base = name.removesuffix("gate_up_proj.weight")
            weights[f"{base}gate_proj.weight"] = cut(fused, 0, ffn, name)
            weights[f"{base}up_proj.weight"] = cut(fused, ffn, 2 * ffn, name)
        del fused


FAMILY = Family(
    "phi3", ("phi3",), {"phi3": "phi3"},
    # llama.cpp's Phi-3 tensors: Q, K and V in one, and ffn_up holding gate and up (2·F rows)
    gguf_layer_tensors={"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
    prepare_weights=split_fused_projections,
)  # fmt: skip
