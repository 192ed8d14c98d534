"""Llama (2, 3.x; SmolLM2) and Mistral: the shared decoder with no options. Mistral v0.1 attends
within a sliding window on every layer (`sliding_window`, on unless the config turns it off);
v0.2 and later have none."""

from __future__ import annotations

from typing import Any

from kvserve.families.base import Family, uniform_window


def hf_options(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    return {"sliding_window": uniform_window(config, by_default=model_type == "mistral")}


FAMILY = Family("llama", ("llama", "mistral"), {"llama": "llama", "mistral": "mistral"}, hf_options)
