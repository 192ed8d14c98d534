"""Read a Llama-family GGUF: its architecture, dequantized weights in HF naming, its tokenizer.

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
from kvserve.model.arch import ModelArchitecture

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
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.match(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    return None


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head (pairs interleaved) row order of Q/K weights and biases."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def read_weights(reader, arch: ModelArchitecture, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    import gguf

    weights: dict[str, torch.Tensor] = {}
    permute = arch.architecture in ("llama", "mistral")
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            raise UnsupportedModelError(f"unsupported GGUF tensor {tensor.name!r}")
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise UnsupportedModelError(
                f"unsupported GGUF tensor type {tensor.tensor_type.name} (tensor {tensor.name!r})"
            ) from exc
        # GGUF lists dims fastest-first; numpy's shape is the reverse, i.e. torch's [out, in]
        array = np.array(array, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])
        if permute and ".q_proj." in name:
            array = _unpermute_rows(array, arch.num_heads)
        elif permute and ".k_proj." in name:
            array = _unpermute_rows(array, arch.num_kv_heads)
        # RoPE frequency factors stay fp32: they scale angles, not activations
        weights[name] = torch.from_numpy(array).to(torch.float32 if name == "rope_freqs" else dtype)
    return weights


def load_tokenizer(path: Path):
    """transformers builds a fast tokenizer (with the chat template) from GGUF metadata."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot build a tokenizer from its GGUF metadata ({exc})") from exc

