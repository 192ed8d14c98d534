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
- `prepare_weights(weights, arch, cut)`: a rewrite of the loaded checkpoint into the
  decoder's names before it is built (Phi-3's fused projections), or None.

Adding an architecture (docs/design.md): a file here with its `FAMILY`, its entry in
`FAMILIES`, and, if its layer differs from every option the decoder has, a new named option
(arch.py's field, read by the layer in model/llama.py, and KernelSupport's verdict on it).
Torch-free at import: the planner reads shapes through it.
"""

from __future__ import annotations

from kvserve.errors import UnsupportedModelError
from kvserve.families import gemma, llama, olmoe, phi3, qwen
from kvserve.families.base import Family, GGUFMeta, uniform_window  # noqa: F401 (the families' vocabulary)


FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen.FAMILY, phi3.FAMILY, gemma.FAMILY, olmoe.FAMILY)
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
