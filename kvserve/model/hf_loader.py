"""Read a Hugging Face model directory: `config.json`, `*.safetensors`, tokenizer files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from kvserve.errors import ModelLoadError
from kvserve.families.experts import unstack_experts
from kvserve.memory import release_free_memory
from kvserve.arch import ModelArchitecture, read_hf_config

# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_architecture(model_dir: Path) -> ModelArchitecture:
    """The shape `config.json` describes (`read_hf_config`, the planner's reader too), with the
    end tokens `generation_config.json` adds: it often lists more than config.json (<|eot_id|>)."""
    arch = read_hf_config(model_dir)
    generation_path = model_dir / "generation_config.json"
    gen_eos = json.loads(generation_path.read_text()).get("eos_token_id") if generation_path.is_file() else None
    if gen_eos is None:
        return arch
    ids = list(arch.eos_token_ids)
    for eos in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
        if eos not in ids:
            ids.append(eos)
    return dataclasses.replace(arch, eos_token_ids=tuple(ids))


_SAFETENSORS_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def read_safetensors(file: Path):
    """(name, tensor) for each tensor of a .safetensors file, each read into fresh memory.
    Read, not mapped: safe_open maps the file, and the pages a load touches stay resident
    until it closes, which doubled the peak memory of a 2 GB shard's load."""
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as exc:
            raise ModelLoadError(f"{file}: not a safetensors file ({exc})") from exc
        base = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ModelLoadError(f"{file}: tensor {name!r} has dtype {info['dtype']}, which kvserve does not read")
            start, end = info["data_offsets"]
            f.seek(base + start)
            data = bytearray(end - start)
            f.readinto(data)
            yield name, torch.frombuffer(data, dtype=dtype).reshape(info["shape"]) if data else torch.empty(info["shape"], dtype=dtype)


def read_weights(model_dir: Path, dtype: torch.dtype, transform=None, rename=None) -> dict:
    """Every tensor in `dtype`; `transform(name, tensor)` (e.g. quantization at load) applied to
    each as it is read, so the float model never exists whole. `rename(name)`: the family's
    name for it in the decoder's naming (Family.hf_tensor_name), taken first."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files (pickle checkpoints are not loaded)")
    weights: dict = {}
    for file in files:
        for name, raw in read_safetensors(file):
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if rename is not None:
                name = rename(name)
            tensor = raw.to(dtype)
            del raw
            # transformers 5's stacked experts, one weight per expert (families/experts.py)
            for part, t in unstack_experts(name, tensor) or [(name, tensor)]:
                weights[part] = transform(part, t) if transform else t
            del tensor, t
            release_free_memory()  # the file's bytes (and a quantizer's transients) before the next tensor
    return weights


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ModelLoadError(f"{model_dir}: cannot load its tokenizer ({exc})") from exc
