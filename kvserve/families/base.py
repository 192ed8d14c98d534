"""What a family file declares (`Family`), what it reads GGUF metadata through (`GGUFMeta`), and
the helpers the family files share."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


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
    # (weights, arch, cut): the checkpoint rewritten into the decoder's names; `cut(tensor, lo,
    # hi, name)` is the loader's row slice of a loaded tensor, whatever its format
    prepare_weights: Callable[[dict, Any, Callable], None] | None = None
    # an HF checkpoint's tensor name in the decoder's naming, applied as each tensor is read
    # (before quantization at load, which goes by the name): Mixtral's experts' w1/w2/w3
    hf_tensor_name: Callable[[str], str] | None = None


def uniform_window(config: dict[str, Any], by_default: bool) -> int | None:
    """A config's sliding window where it is on (`use_sliding_window`, on by default for the
    families whose configs leave it out), else None."""
    return config.get("sliding_window") if config.get("use_sliding_window", by_default) else None


def layer_kinds(config: dict[str, Any], window: int | None, fallback: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Each layer's attention kind where a window is on: the config's `layer_types` where it
    lists them, else the family's own rule (`fallback`); empty without a window (or where every
    layer slides alike)."""
    if window is None:
        return ()
    return tuple(config.get("layer_types") or fallback)
