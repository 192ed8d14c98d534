"""Read a Hugging Face model directory: `config.json`, `*.safetensors`, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvserve.errors import ModelLoadError
from kvserve.model.arch import ModelArchitecture

# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_architecture(model_dir: Path) -> ModelArchitecture:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{model_dir}: missing config.json")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"{config_path}: not valid JSON ({exc})") from exc
    generation_path = model_dir / "generation_config.json"
    if generation_path.is_file():
        # generation_config often lists more end tokens than config.json (e.g. <|eot_id|>)
        gen_eos = json.loads(generation_path.read_text()).get("eos_token_id")
        if gen_eos is not None:
            base = config.get("eos_token_id")
            ids = (base if isinstance(base, list) else [base]) if base is not None else []
            for eos in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
                if eos not in ids:
                    ids.append(eos)
            config = {**config, "eos_token_id": ids}
    try:
        return ModelArchitecture.from_hf_config(config)
    except KeyError as exc:
        raise ModelLoadError(f"{config_path}: missing field {exc.args[0]!r}") from exc


def read_weights(model_dir: Path, dtype: torch.dtype, transform=None) -> dict:
    """Every tensor in `dtype`; `transform(name, tensor)` (e.g. quantization at load) applied to
    each as it is read, so the float model never exists whole."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files (pickle checkpoints are not loaded)")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                tensor = f.get_tensor(name).to(dtype)
                weights[name] = transform(name, tensor) if transform else tensor
    return weights


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ModelLoadError(f"{model_dir}: cannot load its tokenizer ({exc})") from exc
