"""Batched decode of requests of different lengths gives each the tokens it gets alone."""

from __future__ import annotations

from kvserve import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox",
    "What is the capital of France? The capital of France is Paris. Once upon a time",
    "hello",
    "Prefill computes the prompt; decode appends one token at a time to the KV cache. 0123",
]


def test_batched_equals_alone(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert together == alone
    assert all(len(t) == 12 for t in together)


def test_all_blocks_free_after_requests_end(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4, enable_prefix_caching=False)
    kv = llm.engine.kv_cache
    llm.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=20, seed=1))
    assert kv.num_free_blocks() == kv.num_blocks
    assert kv.usage() == 0.0
