"""Llama (2, 3.x; SmolLM2), Mistral and Mixtral: the shared decoder with no options. Mistral v0.1
attends within a sliding window on every layer (`sliding_window`, on unless the config turns
it off); v0.2 and later have none. Mixtral is Mistral's layer with 8 routed experts, the top 2
per token (softmax over all, then the two renormalised); llama.cpp writes it as `llama` with
`expert_count`, so a Llama GGUF may carry experts too."""

from __future__ import annotations

import re
from typing import Any

from kvserve.families.base import Family, GGUFMeta, layer_kinds, uniform_window
from kvserve.families.experts import gguf_moe_options, hf_moe_options


def hf_options(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    window = uniform_window(config, by_default=model_type == "mistral")
    options = {"sliding_window": window, "layer_types": layer_kinds(config, window)}
    if model_type == "mixtral":
        options.update(hf_moe_options(config, "intermediate_size"), norm_topk_prob=True)
    return options


def gguf_options(meta: GGUFMeta, model_type: str) -> dict[str, Any]:
    return gguf_moe_options(meta, norm_topk_prob=True)


_MIXTRAL = re.compile(r"\.block_sparse_moe\.(experts\.\d+\.)?(w1|w2|w3|gate)\.")
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "gate": "gate"}


def mixtral_tensor_name(name: str) -> str:
    """Mixtral's `block_sparse_moe.experts.{e}.w1|w3|w2` (gate, up, down) and its router
    `block_sparse_moe.gate` in the decoder's names (families/experts.py)."""
    return _MIXTRAL.sub(lambda m: f".mlp.{m.group(1) or ''}{_MIXTRAL_NAMES[m.group(2)]}.", name)


FAMILY = Family(
    "llama", ("llama", "mistral", "mixtral"), {"llama": "llama", "mistral": "mistral"}, hf_options, gguf_options,
    hf_tensor_name=mixtral_tensor_name,
)  # fmt: skip
