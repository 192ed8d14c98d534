"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs): each prompt token's logprob and
top-k, as transformers computes them, whatever the chunking, the prefix cache or a preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.support.tiny_models import load_reference

PROMPT = "Prefill computes the prompt; decode appends one token at a time to the KV cache."


def _reference(model_dir: str, ids: list[int], k: int) -> list[dict[int, float]]:
    with torch.no_grad():
        logits = load_reference(Path(model_dir))(torch.tensor([ids])).logits[0].float()
    logprobs = logits.log_softmax(dim=-1)
    out = []
    for p in range(len(ids) - 1):
        entry = {ids[p + 1]: float(logprobs[p, ids[p + 1]])}
        top = logprobs[p].topk(k)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            entry.setdefault(t, v)
        out.append(entry)
    return out


def _close(got: list[dict[int, float]], want: list[dict[int, float]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for t in g:
            assert g[t] == pytest.approx(w[t], abs=2e-4)


@pytest.mark.parametrize("chunk", [None, 7])
def test_prompt_logprobs_match_transformers(tiny_llama, chunk):
    extra = {"max_num_batched_tokens": chunk, "long_prefill_token_threshold": chunk} if chunk else {}
    llm = LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4, **extra)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    _close(out.prompt_logprobs, _reference(tiny_llama, out.prompt_token_ids, 3))


def test_a_cached_prefix_is_recomputed_for_them(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4)
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))  # warms the prefix cache
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    _close(out.prompt_logprobs, _reference(tiny_llama, out.prompt_token_ids, 0))
    # and a request without them still hits the cache
    assert llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))[0].num_cached_tokens > 0


def test_n_samples_and_preemption_score_the_prompt_once(tiny_llama):
    # a pool so small that the four requests preempt each other
    llm = LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_memory=40 * 1024, block_size=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, prompt_logprobs=1, n=2)
    outs = llm.generate([PROMPT, PROMPT[:40], PROMPT[10:], PROMPT[::-1]], params)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        _close(out.prompt_logprobs, _reference(tiny_llama, out.prompt_token_ids, 1))
