"""The architecture families kvserve runs, one file each: what sets a family apart from the
shared decoder (model/llama.py, whose layers take every difference as a named option of
`ModelArchitecture`) and how to read it from a checkpoint.

A family (`Family`) says:

- which HF `model_type`s and GGUF `general.architecture`s it reads;
- `hf_options(config, model_type)`: the `ModelArchitecture` fields its config sets beyond the
  shape every family shares (arch.py reads those: sizes, heads, RoPE base and scaling, tokens);
- `gguf_options(meta)`: the same from a GGUF's metadata (`GGUFMeta`);
- `gguf_layer_tensors`: llama.cpp's names of the layer tensors beyond the common ones, mapped
  to the HF names the decoder loads;
- `prepare_weights(weights, arch, path)`: a rewrite of the loaded checkpoint into the
  decoder's names before it is built (Phi-3's fused projections), or None.

Adding an architecture (docs/design.md): a file here with its `FAMILY`, its entry in
`FAMILIES`, and, if its layer differs from every option the decoder has, a new named option
(arch.py's field, read by the layer in model/llama.py, and KernelSupport's verdict on it).
Torch-free at import: the planner reads shapes through it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from kvserve.errors import UnsupportedModelError


@dataclasses.dataclass(frozen=True)
class GGUFMeta:
    """A GGUF's metadata as a family reads it: `get("attention.sliding_window")` is the field
    under the file's architecture prefix (None if absent), with the dimensions already read."""

    prefix: str
    num_layers: int
    hidden_size: int
    num_heads: int
    head_dim: int
    fields: Callable[[str], Any]

    def get(self, key: str, default: Any = None) -> Any:
        value = self.fields(f"{self.prefix}.{key}")
        return default if value is None else value


def _no_options(*_args) -> dict[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    gguf_archs: dict[str, str]  # GGUF general.architecture -> model_type
    hf_options: Callable[[dict[str, Any], str], dict[str, Any]] = _no_options
    gguf_options: Callable[[GGUFMeta, str], dict[str, Any]] = _no_options
    gguf_layer_tensors: dict[str, str] = dataclasses.field(default_factory=dict)
    prepare_weights: Callable[[dict, Any, Any], None] | None = None


def uniform_window(config: dict[str, Any], by_default: bool) -> int | None:
    """A config's sliding window where it is on (`use_sliding_window`, on by default for the
    families whose configs leave it out), else None."""
    return config.get("sliding_window") if config.get("use_sliding_window", by_default) else None


def _families() -> tuple[Family, ...]:
    from kvserve.model.families import gemma, llama, phi3, qwen

    return (llama.FAMILY, qwen.FAMILY, phi3.FAMILY, gemma.FAMILY)


FAMILIES: tuple[Family, ...] = _families()
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(t for f in FAMILIES for t in f.model_types)
# GGUF general.architecture -> HF model_type, and the other way (the name llama.cpp gives each)
GGUF_TO_HF_ARCH: dict[str, str] = {g: t for f in FAMILIES for g, t in f.gguf_archs.items()}
HF_TO_GGUF_ARCH: dict[str, str] = {t: g for g, t in GGUF_TO_HF_ARCH.items()}


def family_of(model_type: str) -> Family:
    """The family of an HF model_type; UnsupportedModelError naming those kvserve runs."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise UnsupportedModelError(
        f"unsupported architecture {model_type!r}; kvserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
