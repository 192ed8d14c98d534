"""Continuous batching, chunked prefill, prefix caching and preemption keep greedy outputs exact."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.support.tiny_models import load_reference

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SHARED = "Once upon a time there was a small engine that served many requests at once. "
PROMPTS = [
    SHARED + "The quick brown fox",
    SHARED + "What is the capital of France?",
    "hello world",
    SHARED + SHARED + "Prefill computes the prompt",
    "0123456789 stop",
]


def _llm(path, **kw):
    base = dict(dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4)
    base.update(kw)
    return LLM(path, **base)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def expected(tiny_llama):
    """Greedy continuations from transformers, one prompt at a time."""
    ref = load_reference(tiny_llama)
    tok = _llm(tiny_llama).tokenizer
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            gen = ref.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def test_baseline_matches_transformers(tiny_llama, expected):
    llm = _llm(tiny_llama, enable_prefix_caching=False)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected


@pytest.mark.parametrize("budget", [3, 8, 17])
def test_chunked_prefill_mixed_with_decodes(tiny_llama, expected, budget):
    """A small token budget splits every prompt into chunks that share steps with decodes."""
    llm = _llm(tiny_llama, max_num_batched_tokens=budget)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected


def test_long_prefill_threshold(tiny_llama, expected):
    llm = _llm(tiny_llama, long_prefill_token_threshold=5)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected


def test_prefix_cache_hits_give_the_same_tokens(tiny_llama, expected):
    llm = _llm(tiny_llama)
    first = llm.generate(PROMPTS, GREEDY)
    again = llm.generate(PROMPTS, GREEDY)  # now most prompt blocks are cached
    assert _tokens(first) == _tokens(again) == expected
    assert sum(o.num_cached_tokens for o in again) > 0
    assert llm.engine.kv_cache.prefix_hit_rate() > 0


def test_preempted_requests_resume_exactly(tiny_llama, expected):
    # 2 layers x 2 KV heads x 16 dims x 2 x 4 bytes = 512 B/position: 80 KiB = 160 positions,
    # room for the longest request (~116) but not for 20 at once
    llm = _llm(tiny_llama, kv_cache_memory=80 * 1024)
    many = PROMPTS * 4
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    out = llm.generate(many, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(out) == expected * 4
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks() == kv.num_blocks


def test_second_request_computes_only_uncached_tokens(tiny_llama):
    llm = _llm(tiny_llama)
    engine = llm.engine
    tok = llm.tokenizer
    prompt = tok.encode(SHARED + SHARED)
    assert len(prompt) > 24
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompt, params)
    before = engine.counters.computed_tokens
    out = llm.generate(prompt[:-1] + [prompt[-1]], params)[0]
    full_blocks = (len(prompt) - 1) // 4  # the last token is always computed
    assert out.num_cached_tokens == full_blocks * 4
    assert engine.counters.computed_tokens - before == len(prompt) - full_blocks * 4


def test_shared_prefix_uses_the_same_physical_blocks(tiny_llama):
    llm = _llm(tiny_llama)
    engine = llm.engine
    tok = llm.tokenizer
    prefix = tok.encode(SHARED + SHARED)[:24]  # 6 full blocks
    a = prefix + tok.encode(" The quick brown fox")
    b = prefix + tok.encode(" hello world")
    changed = prefix[:9] + [prefix[9] + 1] + prefix[10:] + tok.encode(" hello world")
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", a, params)
    engine.step()  # a is prefilled; its full blocks are now in the prefix cache
    engine.add_request("b", b, params)
    engine.add_request("c", changed, params)
    engine.step()
    blocks_a, blocks_b, blocks_c = (engine.kv_cache.block_ids(r) for r in "abc")
    assert blocks_b[:6] == blocks_a[:6]
    # token 9 sits in block 2: only blocks 0 and 1 can be reused
    assert blocks_c[:2] == blocks_a[:2]
    assert not set(blocks_c[2:]) & set(blocks_a)
    for r in "abc":
        engine.abort_request(r)
    assert engine.kv_cache.num_free_blocks() == engine.kv_cache.num_blocks


def test_reset_prefix_cache_only_when_idle(tiny_llama):
    llm = _llm(tiny_llama)
    engine = llm.engine
    prompt = llm.tokenizer.encode(SHARED + SHARED)[:25]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], params)
    engine.add_request("busy", prompt, params)
    engine.step()
    assert engine.kv_cache.block_ids("busy")
    assert engine.reset_prefix_cache() is False  # a request holds blocks: nothing is forgotten
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache.pool.num_cached_blocks > 0
    assert engine.reset_prefix_cache() is True
    assert engine.kv_cache.pool.num_cached_blocks == 0
    assert llm.generate([prompt], params)[0].num_cached_tokens == 0


def test_n_samples_share_prompt_blocks(tiny_llama):
    llm = _llm(tiny_llama)
    engine = llm.engine
    prompt = llm.tokenizer.encode(SHARED + SHARED)
    before = engine.counters.computed_tokens
    out = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs) == 4 and all(len(o.token_ids) == 5 for o in out.outputs)
    computed = engine.counters.computed_tokens - before
    tail = len(prompt) - ((len(prompt) - 1) // 4) * 4
    # one full prefill, then each other sample recomputes only the partial last block
    assert computed == len(prompt) + 3 * tail + 4 * 4
