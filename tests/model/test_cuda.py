"""The engine on a CUDA device (skipped where torch sees none): the same model code and
scheduler, the plain-torch attention path, checked against transformers and the CPU engine."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from tests.support.paged_driver import assert_follows_reference
from tests.support.tiny_models import load_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

PROMPTS = ["The quick brown fox", "What is the capital of France? The capital of France is Paris. Once", "hello"]


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias", "llama-hd64"])
def test_cuda_logits_match_transformers(tiny_model_dirs, variant):
    path = tiny_model_dirs[variant]
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", device="cuda", kv_cache_memory="8MiB"))
    assert engine.kv_cache is not None and engine.runner.kv_pool.is_cuda
    ref = load_reference(path)
    prompt = engine.tokenizer.encode("What is the capital of France? The capital")
    assert_follows_reference(engine, ref, prompt, steps=4, atol=1e-3, rtol=1e-3)


def test_cuda_generation_equals_cpu(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    common = dict(dtype="float32", kv_cache_memory=80 * 1024, block_size=4, max_num_batched_tokens=8)
    cpu = LLM(tiny_llama, device="cpu", **common).generate(PROMPTS * 3, params)
    gpu_llm = LLM(tiny_llama, device="cuda", **common)
    gpu = gpu_llm.generate(PROMPTS * 3, params)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]
    kv = gpu_llm.engine.kv_cache
    assert kv.num_free_blocks() == kv.num_blocks


def test_cuda_bf16_runs(tiny_llama):
    llm = LLM(tiny_llama, device="cuda", dtype="auto", kv_cache_memory="8MiB")
    assert llm.engine.model.dtype == torch.bfloat16
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
