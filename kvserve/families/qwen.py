"""Qwen2 and Qwen3: Qwen2 always has a QKV bias and, under `use_sliding_window`, a window on its
layers from `max_window_layers` on; Qwen3 normalises each query and key head (`qk_norm`) and has
no bias."""

from __future__ import annotations

from typing import Any

from kvserve.families.base import Family, layer_kinds, uniform_window


def hf_options(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    window = uniform_window(config, by_default=False)
    # transformers' Qwen2 rule where the config lists no kinds: the layers from max_window_layers on slide
    first = int(config.get("max_window_layers", 28))
    rule = tuple("sliding_attention" if i >= first else "full_attention" for i in range(config["num_hidden_layers"]))
    options: dict[str, Any] = {"sliding_window": window, "layer_types": layer_kinds(config, window, rule)}
    if model_type == "qwen2":
        options["attention_bias"] = True
    else:
        options["qk_norm"] = True
    return options


FAMILY = Family("qwen", ("qwen2", "qwen3"), {"qwen2": "qwen2", "qwen3": "qwen3"}, hf_options)
