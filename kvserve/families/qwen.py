"""Qwen2 and Qwen3, and their mixtures of experts: Qwen2 always has a QKV bias and, under
`use_sliding_window`, a window on its layers from `max_window_layers` on; Qwen3 normalises each
query and key head (`qk_norm`) and has no bias. Qwen2-MoE (Qwen1.5-MoE) is Qwen2's layer with
routed experts beside one shared expert under a sigmoid gate; Qwen3-MoE is Qwen3's with routed
experts only; in both the top k are renormalised where `norm_topk_prob` says, and the layers in
`mlp_only_layers` or off `decoder_sparse_step` keep a dense FFN."""

from __future__ import annotations

from typing import Any

from kvserve.families.base import Family, GGUFMeta, layer_kinds, uniform_window
from kvserve.families.experts import gguf_moe_options, hf_moe_options, qwen_dense_layers


def hf_options(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    window = uniform_window(config, by_default=False)
    # transformers' Qwen2 rule where the config lists no kinds: the layers from max_window_layers on slide
    first = int(config.get("max_window_layers", 28))
    rule = tuple("sliding_attention" if i >= first else "full_attention" for i in range(config["num_hidden_layers"]))
    options: dict[str, Any] = {"sliding_window": window, "layer_types": layer_kinds(config, window, rule)}
    if model_type in ("qwen2", "qwen2_moe"):
        options["attention_bias"] = True
    else:
        options["qk_norm"] = True
    if model_type.endswith("_moe"):
        options.update(hf_moe_options(config, "moe_intermediate_size", qwen_dense_layers(config)))
    return options


def gguf_options(meta: GGUFMeta, model_type: str) -> dict[str, Any]:
    # llama.cpp renormalises Qwen3-MoE's top k and not Qwen2-MoE's (the released models' configs)
    return gguf_moe_options(meta, norm_topk_prob=model_type == "qwen3_moe")


FAMILY = Family(
    "qwen", ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"),
    {"qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}, hf_options, gguf_options,
)  # fmt: skip
