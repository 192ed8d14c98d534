"""The sampling settings a model ships with: HF `generation_config.json` or GGUF
`general.sampling.*` metadata, as kvserve's SamplingParams field names.

Only what the file states is returned; the server decides what an unset field falls back
to (kvserve/server/sampling_defaults.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from kvserve.errors import ModelLoadError
from kvserve.model import gguf_metadata

logger = logging.getLogger(__name__)

# HF generation_config.json field -> SamplingParams field
_HF_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# GGUF general.sampling.* key (llama.cpp's names) -> SamplingParams field
_GGUF_FIELDS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_INT_FIELDS = {"top_k", "max_tokens"}


def read_generation_config(source: Path) -> dict[str, float | int]:
    """The model's own sampling defaults, {} when it ships none. A malformed file is logged
    and ignored: it must not keep a model that loads from serving."""
    try:
        raw = _read_hf(source) if source.is_dir() else _read_gguf(source)
    except (OSError, ValueError, ModelLoadError) as exc:
        logger.warning("ignoring the generation config of %s: %s", source, exc)
        return {}
    out: dict[str, float | int] = {}
    for name, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[name] = int(value) if name in _INT_FIELDS else float(value)
    return out


def _read_hf(model_dir: Path) -> dict:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError("generation_config.json is not a JSON object")
    out = {ours: config[theirs] for theirs, ours in _HF_FIELDS.items() if theirs in config}
    if config.get("do_sample") is False:
        # transformers' generate() then ignores temperature/top-p/top-k: the model's own
        # behaviour is greedy, and that is what it should get here too
        out = {k: v for k, v in out.items() if k in ("repetition_penalty", "max_tokens")}
        out["temperature"] = 0.0
    return out


def _read_gguf(path: Path) -> dict:
    header = gguf_metadata.open_gguf(path)
    values = {ours: gguf_metadata.field(header, key) for key, ours in _GGUF_FIELDS.items()}
    return {k: v for k, v in values.items() if v is not None}
