from __future__ import annotations

import os

import pytest
import torch

from tests.tiny_models import make_tiny_model

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TINY_VARIANTS = {
    "llama-gqa": dict(model_type="llama", num_heads=4, num_kv_heads=2),
    "llama-tied": dict(model_type="llama", num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
    "qwen2-bias": dict(model_type="qwen2", num_heads=6, num_kv_heads=2, hidden_size=96),
    # head_dim 64, as the default model: the fused RoPE kernel's path (the others run torch's)
    "llama-hd64": dict(model_type="llama", num_heads=4, num_kv_heads=2, hidden_size=256),
}


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: str(make_tiny_model(root / name, **kw)) for name, kw in TINY_VARIANTS.items()}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama-gqa"]
