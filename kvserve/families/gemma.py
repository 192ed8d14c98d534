"""Gemma 2 and Gemma 3 (text): embeddings scaled by √hidden, RMSNorm applied as (1 + w), a norm
after attention and after the MLP as well as before (`sandwich_norms`), GeGLU with tanh GELU,
attention scaled by `query_pre_attn_scalar`^-1/2, local sliding-window layers among global
ones. Gemma 2: every other layer local, one RoPE base, attention scores and final logits
soft-capped. Gemma 3: every 6th layer global, q/k norms, the local layers' own RoPE base."""

from __future__ import annotations

from typing import Any

from kvserve.errors import UnsupportedModelError
from kvserve.families.base import Family, GGUFMeta, layer_kinds, uniform_window

# a global layer every this many (transformers' sliding_window_pattern; llama.cpp fixes them)
GLOBAL_EVERY = {"gemma2": 2, "gemma3_text": 6}


def gemma_layer_types(num_layers: int, every: int = 6) -> tuple[str, ...]:
    """Every `every`-th layer global, the others local."""
    return tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers))


def _common(hidden: int) -> dict[str, Any]:
    return dict(embedding_scale=float(hidden) ** 0.5, sandwich_norms=True, hidden_act="gelu_tanh")


def hf_options(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """transformers' Gemma2Config / Gemma3TextConfig: their norms store w and apply 1 + w."""
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"unsupported Gemma hidden_activation {act!r} (kvserve runs gelu_pytorch_tanh)")
    window = uniform_window(config, by_default=True)
    layers = config["num_hidden_layers"]
    every = int(config.get("sliding_window_pattern") or GLOBAL_EVERY[model_type])
    options: dict[str, Any] = dict(
        **_common(config["hidden_size"]), norm_weight_offset=1.0, sliding_window=window,
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 256),
        attn_logit_softcapping=_positive_or_none(config.get("attn_logit_softcapping")),
        final_logit_softcapping=_positive_or_none(config.get("final_logit_softcapping")),
        layer_types=layer_kinds(config, window, gemma_layer_types(layers, every)),
    )  # fmt: skip
    if model_type == "gemma3_text":
        per_type = config.get("rope_parameters") or {}
        local = (per_type.get("sliding_attention") or {}).get("rope_theta") or config.get("rope_local_base_freq") or 10000.0
        options.update(qk_norm=True, rope_local_theta=float(local))
    return options


def gguf_options(meta: GGUFMeta, model_type: str) -> dict[str, Any]:
    """As llama.cpp reads a Gemma GGUF: the norms' weights already hold 1 + w (its converter
    adds the 1), the layer pattern fixed per version, the local layers' RoPE base 10,000
    (Gemma 3), attention scaled by head_dim^-1/2, or hidden / heads for the 27B (46 layers of
    Gemma 2, 62 of Gemma 3)."""
    window = meta.get("attention.sliding_window")
    n = meta.num_layers
    big = n == (46 if model_type == "gemma2" else 62)
    options: dict[str, Any] = dict(
        **_common(meta.hidden_size),
        query_pre_attn_scalar=float(meta.hidden_size // meta.num_heads if big else meta.head_dim),
        layer_types=gemma_layer_types(n, GLOBAL_EVERY[model_type]) if window is not None else ("full_attention",) * n,
        sliding_window=None if window is None else int(window),
    )  # fmt: skip
    if model_type == "gemma3_text":
        options["rope_local_theta"] = 10000.0
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        options[key] = _positive_or_none(meta.get(key))
    return options


def _positive_or_none(value: Any) -> float | None:
    """A soft-capping value as configs write it: a positive float, or null / 0 for none."""
    return float(value) if value else None


FAMILY = Family(
    "gemma", ("gemma2", "gemma3_text"), {"gemma2": "gemma2", "gemma3": "gemma3_text"}, hf_options, gguf_options,
    # the four norms: ffn_norm is the one before the MLP, the other two follow each branch
    gguf_layer_tensors={
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
)  # fmt: skip
