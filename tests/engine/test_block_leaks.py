"""After any mix of finished, aborted and preempted requests, no KV block is leaked."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # 160 positions in blocks of 4: small enough that a dozen requests preempt each other
    return LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_memory=80 * 1024, block_size=4, max_num_batched_tokens=24)


def _assert_no_leak(engine):
    kv = engine.kv_cache
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks() == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)  # free, or cached and unreferenced
    assert kv._req_blocks == {}


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    num_requests=st.integers(1, 14),
    abort_fraction=st.floats(0, 0.6),
)
def test_random_workloads_leak_nothing(llm, seed, num_requests, abort_fraction):
    engine = llm.engine
    rng = random.Random(seed)
    vocab = engine.arch.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(rng.randrange(0, 30))]
    ids = []
    for i in range(num_requests):
        prompt = shared + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(
            n=rng.choice([1, 1, 2]),
            temperature=rng.choice([0.0, 1.0]),
            max_tokens=rng.randrange(1, 30),
            seed=rng.randrange(100),
            ignore_eos=rng.random() < 0.5,
        )
        ids.append(engine.add_request(None, prompt, params))
    to_abort = {i for i in ids if rng.random() < abort_fraction}
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        for request_id in list(to_abort):
            if rng.random() < 0.3:
                engine.abort_request(request_id)
                to_abort.discard(request_id)
        assert steps < 2000
    _assert_no_leak(engine)


def test_preemption_happened_somewhere(llm):
    """The workload above is sized to preempt; check it really does on a dense case."""
    engine = llm.engine
    before = engine.scheduler.num_preemptions
    llm.generate([[5 + i] * 60 for i in range(8)], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert engine.scheduler.num_preemptions > before
    _assert_no_leak(engine)
