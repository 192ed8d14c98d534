"""Requests that cannot fit get clear errors, and a too-small pool is a config error."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import ConfigError, InvalidRequestError, PromptTooLongError


@pytest.fixture(scope="module")
def small_pool_llm(tiny_llama):
    # 2 layers x 2 KV heads x 16 dims x 2 (K,V) x 4 bytes = 512 B/position; 16 KiB = 32 positions
    return LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_memory=16 * 1024, block_size=4)


def test_pool_caps_max_model_len(small_pool_llm):
    engine = small_pool_llm.engine
    assert engine.layout.num_tokens == 32
    assert engine.max_model_len == 32


def test_prompt_longer_than_pool_is_rejected(small_pool_llm):
    long_prompt = list(range(3, 43))  # 40 tokens
    with pytest.raises(PromptTooLongError, match="40 tokens.*max_model_len=32"):
        small_pool_llm.generate(long_prompt, SamplingParams(max_tokens=4))
    engine = small_pool_llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks() == engine.kv_cache.num_blocks


def test_generation_stops_at_max_model_len(small_pool_llm):
    out = small_pool_llm.generate(list(range(3, 23)), SamplingParams(max_tokens=100, ignore_eos=True, temperature=0))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 32


def test_empty_and_out_of_vocab_prompts(small_pool_llm):
    with pytest.raises(InvalidRequestError, match="prompt must not be empty"):
        small_pool_llm.generate("")
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        small_pool_llm.generate([1, 2, 10**6])


def test_too_small_pool_and_too_long_max_model_len(tiny_llama):
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_memory=100)
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_memory=16 * 1024, block_size=4, max_model_len=64)
