"""Our Llama-family forward over the paged cache matches transformers on the same weights."""

from __future__ import annotations

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from tests.support.tiny_models import TINY_VARIANTS
from tests.support.paged_driver import assert_follows_reference
from tests.support.tiny_models import load_reference

ATOL = 2e-4


def _engine(path: str, cpu_kernels: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, dtype="float32", device="cpu", kv_cache_memory="8MiB", cpu_kernels=cpu_kernels))


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch-path", "kernels"])
@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_prefill_and_each_decode_step_match_transformers(tiny_model_dirs, variant, cpu_kernels):
    path = tiny_model_dirs[variant]
    engine = _engine(path, cpu_kernels)
    ref = load_reference(path)
    prompt = engine.tokenizer.encode("What is the capital of France? The capital")
    assert_follows_reference(engine, ref, prompt, steps=6, atol=ATOL, rtol=1e-4)


def test_qwen2_bias_is_used(tiny_model_dirs):
    """The Qwen2 variant's QKV biases are non-zero, so a match above means they are applied."""
    engine = _engine(tiny_model_dirs["qwen2-bias"])
    assert engine.model.layers[0].self_attn.qkv.bias.abs().sum() > 0


def test_gqa_shapes(tiny_model_dirs):
    engine = _engine(tiny_model_dirs["qwen2-bias"])
    assert engine.arch.queries_per_kv_head == 3
    # K/V pool holds N_kv heads, not N_q: c_kv = 2·L·N_kv·H·p_kv
    assert engine.layout.kv_bytes_per_position == 2 * engine.arch.num_layers * 2 * engine.arch.head_dim * 4
