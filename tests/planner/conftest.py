"""Shared fixtures for planner tests: the seed's §6 setup and a throwaway cache dir."""

from __future__ import annotations

import pytest

from kvserve.planner.examples import seed_70b_inputs


@pytest.fixture
def seed_inputs():
    """§5–§6: 70B int8 on 16 seed chips, 2 GB reserved, S=8192, 12 ms target."""
    return seed_70b_inputs()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def transformers_param_count(tmp_path, family: str) -> int:
    """Write a tiny `family` (Llama, Qwen2) config.json to tmp_path; the parameter count of
    transformers' own model built from it (the reference P)."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{family}Config")(
        num_hidden_layers=2, hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=2,
        vocab_size=300, tie_word_embeddings=False,
    )
    config.save_pretrained(tmp_path)
    return sum(p.numel() for p in getattr(transformers, f"{family}ForCausalLM")(config).parameters())
