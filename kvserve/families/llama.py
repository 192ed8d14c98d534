"""Llama (2, 3.x; SmolLM2) and Mistral: the shared decoder with no options. Mistral v0.1 attends
within a sliding window on every layer (`sliding_window`, on unless the config turns it off);
v0.2 and later have none."""

from __future__ import annotations

from typing import Any

from kvserve.families.base import Family, layer_kinds, uniform_window


def hf_options(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    window = uniform_window(config, by_default=model_type == "mistral")
    return {"sliding_window": window, "layer_types": layer_kinds(config, window)}


FAMILY = Family("llama", ("llama", "mistral"), {"llama": "llama", "mistral": "mistral"}, hf_options)
