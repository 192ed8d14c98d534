"""Read a Llama-family GGUF's weights in HF naming (quantized ones kept in a format the kernels
run, or dequantized), and its tokenizer.

The metadata (architecture) is read by the torch-free `kvserve.model.gguf_metadata`,
shared with the planner.

Weights leave here named as in a Hugging Face checkpoint (`model.layers.0.self_attn.q_proj.weight`)
so one model class serves both sources. llama.cpp's converter permutes the rows of the Q and K
projections of `llama` models to suit its interleaved RoPE; they are permuted back here so the
rotate-half RoPE of the HF layout applies.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.memory import release_free_memory
from kvserve.arch import ModelArchitecture
from kvserve.families import SUPPORTED_ARCHITECTURES, family_of
from kvserve.families.experts import GGUF_EXPERT_TENSORS

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
    # LongRoPE's divisors (Phi-3): the model takes the set its context calls for
    "rope_factors_long.weight": "rope_factors_long",
    "rope_factors_short.weight": "rope_factors_short",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


def _hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.match(gguf_name)
    own = family_of(architecture).gguf_layer_tensors if architecture in SUPPORTED_ARCHITECTURES else {}
    names = {**_LAYER_TENSORS, **GGUF_EXPERT_TENSORS, **own}
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}"
    return None


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head (pairs interleaved) row order of Q/K weights and biases."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


_FLOAT_TYPES = ("F32", "F16", "BF16")


def is_quantizable(name: str) -> bool:
    """The weights a quantized format applies to: projections, the LM head and the embedding
    table (norms, biases and RoPE factors stay float)."""
    return name.endswith("_proj.weight") or name in ("lm_head.weight", "model.embed_tokens.weight")


def _tensor_bytes(path: Path, tensor, rows: int | None = None) -> np.ndarray:
    """The tensor's raw bytes read into fresh memory ([rows, bytes per row], HF's row order
    not yet restored). Read, not mapped: pages of a mapping stay resident until the whole
    reader goes, which doubles the peak memory of a load. `rows`: all rows of a stack of
    experts; by default torch's first dimension (GGUF lists dims fastest-first)."""
    count = int(tensor.n_bytes)
    raw = np.fromfile(path, dtype=np.uint8, count=count, offset=int(tensor.data_offset))
    rows = rows or int(tensor.shape[-1])
    return raw.reshape(rows, count // rows)


def read_weights(
    reader, arch: ModelArchitecture, dtype: torch.dtype, quantization: str = "none", path: Path | None = None,
    notes: list[str] | None = None, transform=None,
) -> dict:
    """Weights in HF naming. `quantization` (resolved by the engine): "none" dequantizes every
    tensor to `dtype`; "native" keeps the quantized projections in a format quant_linear runs
    (kvserve.model.quant_formats: GGUF_NATIVE as they are, GGUF_REPACKED repacked) and
    dequantizes the other types, saying so in `notes`. `transform(name, tensor)` is applied to
    each float tensor as it is read (quantization at load)."""
    import gguf

    from kvserve.model import quant_formats

    path = Path(path or reader.path)
    weights: dict = {}
    permute = arch.architecture in ("llama", "mistral")
    dequantized: dict[str, int] = {}

    def read_one(name: str, type_name: str, shape: list[int], raw: np.ndarray, tensor) -> None:
        runnable = type_name in quant_formats.GGUF_NATIVE + quant_formats.GGUF_REPACKED
        if (
            quantization == "native" and runnable and is_quantizable(name) and len(shape) == 2
            and quant_formats.packable(*shape)
        ):  # fmt: skip
            weights[name] = quant_formats.from_gguf(type_name, raw, *shape)
            release_free_memory()  # a repack's transients sit between packed weights: hand them back now
            return
        if type_name not in _FLOAT_TYPES and is_quantizable(name):
            dequantized[type_name] = dequantized.get(type_name, 0) + 1
        try:
            array = gguf.quants.dequantize(raw, tensor.tensor_type)
        except NotImplementedError as exc:
            raise UnsupportedModelError(f"unsupported GGUF tensor type {type_name} (tensor {tensor.name!r})") from exc
        array = np.asarray(array, dtype=np.float32).reshape(shape)
        # RoPE frequency factors stay fp32: they scale angles, not activations; so do a mixture
        # of experts' routers (llama.cpp keeps them F32): their top k is chosen in fp32
        keep = name.startswith("rope_") or name.endswith((".mlp.gate.weight", "shared_expert_gate.weight"))
        value = torch.from_numpy(array).to(torch.float32 if keep else dtype)
        weights[name] = transform(name, value) if transform else value
        del array, value
        release_free_memory()

    for tensor in reader.tensors:
        name = _hf_name(tensor.name, arch.architecture)
        if name is None:
            raise UnsupportedModelError(f"unsupported GGUF tensor {tensor.name!r}")
        type_name = tensor.tensor_type.name  # open_gguf has refused types gguf does not know
        # GGUF lists dims fastest-first; torch's [out, in] is the reverse
        shape = [int(d) for d in reversed(tensor.shape)]
        if name.endswith("shared_expert_gate.weight"):
            shape = [1, shape[-1]]  # llama.cpp stores the shared expert's gate as a vector
        if "{e}" in name:  # a stack of experts [E, rows, cols]: each expert its own weight
            raw = _tensor_bytes(path, tensor, rows=shape[0] * shape[1])
            fused = name.endswith(".gate_up_proj.weight")  # ffn_gate_up_exps: gate rows, then up rows
            if fused and shape[1] % 2:
                raise UnsupportedModelError(f"GGUF tensor {tensor.name!r}: {shape[1]} rows per expert, not gate and up halves")
            for e, part in enumerate(np.split(raw, shape[0])):
                if fused:  # whole rows (each row's blocks intact), so a quantized stack cuts exactly
                    half = shape[1] // 2
                    for proj, rows in (("gate_proj", part[:half]), ("up_proj", part[half:])):
                        read_one(name.replace("gate_up_proj", proj).format(e=e), type_name, [half, shape[2]], rows, tensor)
                else:
                    read_one(name.format(e=e), type_name, shape[1:], part, tensor)
            del raw
            continue
        heads = arch.num_heads if ".q_proj." in name else arch.num_kv_heads if ".k_proj." in name else 0
        raw = _tensor_bytes(path, tensor)
        if permute and heads:
            raw = _unpermute_rows(raw, heads)
        read_one(name, type_name, shape, raw, tensor)
        del raw
    if quantization == "native" and dequantized and notes is not None:
        kinds = ", ".join(f"{n} x {t}" for t, n in sorted(dequantized.items()))
        notes.append(f"dequantized to {str(dtype).removeprefix('torch.')} at load (no kernel for their type): {kinds}")
    return weights


def quantized_projection_types(reader) -> list[str]:
    """The quantized (non-float) tensor types of the projections, embedding and LM head."""
    found = []
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        type_name = getattr(tensor.tensor_type, "name", str(tensor.tensor_type))
        if name and is_quantizable(name) and type_name not in _FLOAT_TYPES and type_name not in found:
            found.append(type_name)
    return found


def load_tokenizer(path: Path):
    """transformers builds a fast tokenizer (with the chat template) from GGUF metadata."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        try:
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except ValueError as exc:
            if "is not supported yet" not in str(exc):
                raise
            # transformers reads no config of this architecture (OLMoE): its tokenizer
            # converter needs none, only the file's tokenizer.ggml.* fields
            return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot build a tokenizer from its GGUF metadata ({exc})") from exc

