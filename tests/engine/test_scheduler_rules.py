"""The scheduling rule itself, model-free: a real Scheduler over a real KVCacheManager,
real Requests of token ids, and `update_from_output` with made-up samples to advance.

Each test names one rule of kvserve/engine/scheduler.py and fails if it is broken:
the token budget, running-before-waiting, which request is preempted and where it goes,
no admissions in a step that preempted, max_num_seqs, long_prefill_token_threshold
chunking, and prefix-cache hits (never the last token).
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from kvserve.request_state import RequestStatus
from tests.support.requests import advance, make_request, make_scheduler, step


def _ids(out) -> list[str]:
    return [s.request.request_id for s in out.scheduled]


def _chunks(out) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def _prompt(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


# ---- the budget, as a property ------------------------------------------------------------


@st.composite
def _workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    # prompts share prefixes of one base sequence (so prefix caching has hits) + own tails
    shapes = draw(
        st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30), st.integers(1, 6)), min_size=1, max_size=8)
    )
    prompts = [
        (list(range(1, shared + 1)) + [1000 * (i + 1) + j for j in range(tail)], max_tokens)
        for i, (shared, tail, max_tokens) in enumerate(shapes)
    ]
    longest = max(len(p) + m for p, m in prompts)
    # the pool always holds the longest request alone (the engine guarantees as much)
    num_blocks = -(-longest // block_size) + draw(st.integers(0, 24))
    return dict(
        block_size=block_size,
        prompts=prompts,
        num_blocks=num_blocks,
        budget=draw(st.integers(1, 48)),
        max_num_seqs=draw(st.integers(1, 6)),
        threshold=draw(st.integers(0, 12)),
        prefix=draw(st.booleans()),
        arrive_every=draw(st.integers(0, 3)),  # 0: all at once; k: one new request each k steps
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=_workloads())
def test_every_step_keeps_the_budget_and_limits(w):
    """Random prompts, budgets, pools and thresholds, run to completion: every step's
    scheduled tokens ≤ max_num_batched_tokens, each chunk ≤ long_prefill_token_threshold,
    running ≤ max_num_seqs, running requests come before admissions, nothing is admitted in a
    step that preempted, every scheduled token has a slot, and every request finishes."""
    bs = w["block_size"]
    sched = make_scheduler(
        w["num_blocks"],
        bs,
        enable_prefix_caching=w["prefix"],
        max_num_batched_tokens=w["budget"],
        max_num_seqs=w["max_num_seqs"],
        long_prefill_token_threshold=w["threshold"],
    )
    kv = sched.kv_cache
    pending = [make_request(f"r{i}", p, bs, max_tokens=m) for i, (p, m) in enumerate(w["prompts"])]
    requests = list(pending)
    for n_step in range(3000):
        if pending and (w["arrive_every"] == 0 or n_step % w["arrive_every"] == 0):
            for r in pending if w["arrive_every"] == 0 else pending[:1]:
                sched.add_request(r)
            pending = [] if w["arrive_every"] == 0 else pending[1:]
        if not sched.has_unfinished():
            if not pending:
                break
            continue
        running_before = list(sched.running)
        out = sched.schedule()
        chunks = [s.num_new_tokens for s in out.scheduled]
        assert sum(chunks) <= w["budget"], (chunks, w)
        assert all(n >= 1 for n in chunks), chunks
        if w["threshold"]:
            assert all(n <= w["threshold"] for n in chunks), (chunks, w["threshold"])
        assert len(sched.running) <= w["max_num_seqs"]
        assert len({id(s.request) for s in out.scheduled}) == len(out.scheduled)
        was_running = [s.request in running_before for s in out.scheduled]
        assert was_running == sorted(was_running, reverse=True), "an admission was scheduled before a running request"
        if out.preempted:
            assert all(was_running), "a request was admitted in a step that preempted"
        for s in out.scheduled:
            r = s.request
            assert r.status == RequestStatus.RUNNING
            assert 0 <= r.num_computed_tokens < r.num_computed_tokens + s.num_new_tokens <= r.num_tokens
            assert len(kv.block_ids(r.request_id)) * bs >= r.num_computed_tokens + s.num_new_tokens
            assert out.block_tables[r.request_id] == kv.block_ids(r.request_id)
        for r in out.preempted:
            assert r.num_computed_tokens == 0 and r not in sched.running and kv.block_ids(r.request_id) == []
        advance(sched, out)  # finishes a request at its max_tokens
    assert not sched.has_unfinished() and not pending, "requests still unfinished after 3000 steps"
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in requests)
    assert kv.num_free_blocks() == kv.num_blocks


def test_budget_smaller_than_the_decode_batch():
    """Five running decodes and a budget of 3: exactly the first three decode this step."""
    sched = make_scheduler(64, 4, max_num_batched_tokens=20)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", _prompt(4, 10 * i + 1), 4))
    assert sum(_chunks(step(sched)).values()) == 20
    sched.config.max_num_batched_tokens = 3
    out = step(sched)
    assert _chunks(out) == {"r0": 1, "r1": 1, "r2": 1}


def test_prompt_is_chunked_to_the_remaining_budget():
    """A prompt longer than what is left of the budget gets exactly the rest."""
    sched = make_scheduler(64, 4, max_num_batched_tokens=10)
    sched.add_request(make_request("a", _prompt(6), 4))
    sched.add_request(make_request("b", _prompt(20, 100), 4))
    assert _chunks(step(sched)) == {"a": 6, "b": 4}
    # a decodes (1), b continues with the remaining 9
    assert _chunks(step(sched)) == {"a": 1, "b": 9}


# ---- order --------------------------------------------------------------------------------


def test_running_requests_are_scheduled_before_waiting_ones():
    """A decoding request and one still in its chunked prefill take the budget before a
    waiting arrival gets any; the arrival is admitted only into what they leave, after them."""
    sched = make_scheduler(64, 4, max_num_batched_tokens=8)
    sched.add_request(make_request("a", _prompt(3), 4))
    sched.add_request(make_request("b", _prompt(20, 100), 4))
    assert _chunks(step(sched)) == {"a": 3, "b": 5}
    sched.add_request(make_request("c", _prompt(5, 200), 4))
    # a decodes (1) and b continues (7): the budget is full, c waits
    assert _chunks(step(sched)) == {"a": 1, "b": 7}
    assert _chunks(step(sched)) == {"a": 1, "b": 7}
    assert [r.request_id for r in sched.waiting] == ["c"]
    # b's last prompt token (1) leaves 6: c is admitted behind the running two
    out = step(sched)
    assert _ids(out) == ["a", "b", "c"]
    assert _chunks(out) == {"a": 1, "b": 1, "c": 5}


def test_waiting_requests_are_admitted_in_arrival_order():
    sched = make_scheduler(64, 4, max_num_batched_tokens=100)
    for name in "xyzw":
        sched.add_request(make_request(name, _prompt(5, ord(name)), 4))
    assert _ids(step(sched)) == list("xyzw")
    assert [r.request_id for r in sched.running] == list("xyzw")


# ---- preemption ---------------------------------------------------------------------------


def test_the_most_recently_admitted_request_is_preempted_to_the_front():
    """A, B, C take the pool's three blocks; then A (first in line) needs a second block.
    C, admitted last, is preempted, not B (which still fits its block). C goes to the front
    of the waiting queue, ahead of D that was waiting already, with its KV dropped
    (num_computed_tokens 0, no blocks) and its tokens kept."""
    sched = make_scheduler(3, 4, max_num_batched_tokens=100, max_num_seqs=3)
    sched.add_request(make_request("a", _prompt(4, 1), 4))  # 4 + 1 sampled: needs a 2nd block
    sched.add_request(make_request("b", _prompt(2, 11), 4))  # 2 + 1 sampled: still one block
    sched.add_request(make_request("c", _prompt(4, 21), 4))
    sched.add_request(make_request("d", _prompt(2, 31), 4))
    assert _ids(step(sched)) == ["a", "b", "c"]  # max_num_seqs keeps d waiting
    c = sched.running[2]
    assert sched.kv_cache.num_free_blocks() == 0
    out = step(sched)
    assert [r.request_id for r in out.preempted] == ["c"]
    assert _ids(out) == ["a", "b"]
    assert [r.request_id for r in sched.running] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    assert c.status == RequestStatus.PREEMPTED and sched.num_preemptions == 1
    assert c.num_computed_tokens == 0
    assert c.num_tokens == 5 and c.num_output_tokens == 1  # its sampled token survives
    assert sched.kv_cache.block_ids("c") == []
    assert len(sched.kv_cache.block_ids("a")) == 2


def test_preemption_walks_back_from_the_tail():
    """With no block left for the first request, the tail is preempted first, then the next
    from the tail; the two go back in their original order (B before C)."""
    sched = make_scheduler(3, 4, max_num_batched_tokens=100)
    for name, start in zip("abc", (1, 11, 21)):
        sched.add_request(make_request(name, _prompt(4, start), 4))
    step(sched)
    assert sched.kv_cache.num_free_blocks() == 0
    out = step(sched)  # a needs a block: c goes; b then needs one: b goes itself
    assert [r.request_id for r in out.preempted] == ["c", "b"]
    assert _ids(out) == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_no_admissions_in_a_step_that_preempted():
    """C is preempted (it needs a third block, none is free) and frees two; with
    long_prefill_token_threshold=4 its own re-admission would need only one, so only the
    rule keeps it (and anything behind it) out of this step."""
    sched = make_scheduler(4, 4, max_num_batched_tokens=100, long_prefill_token_threshold=4)
    sched.add_request(make_request("a", _prompt(4), 4))
    sched.add_request(make_request("c", _prompt(8, 100), 4))
    assert _chunks(step(sched)) == {"a": 4, "c": 4}
    assert _chunks(step(sched)) == {"a": 1, "c": 4}  # c's prompt done: it samples, 9 tokens
    sched.add_request(make_request("d", _prompt(1, 300), 4))
    out = step(sched)
    assert [r.request_id for r in out.preempted] == ["c"]
    assert _ids(out) == ["a"]
    assert sched.kv_cache.num_free_blocks() == 2  # room for c's first chunk and for d
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    # the next step, with nothing preempted, admits it again from position 0
    out = step(sched)
    assert out.preempted == []
    assert _chunks(out)["c"] == 4 and "c" in [r.request_id for r in sched.running]


# ---- limits -------------------------------------------------------------------------------


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(64, 4, max_num_batched_tokens=1000, max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", _prompt(3, 10 * i + 1), 4))
    for _ in range(3):
        out = step(sched)
        assert len(sched.running) == 2 and _ids(out) == ["r0", "r1"]
    sched.finish(sched.running[0], RequestStatus.FINISHED_LENGTH)
    out = step(sched)
    assert _ids(out) == ["r1", "r2"] and len(sched.running) == 2


def test_long_prefill_threshold_chunks_a_prompt_until_it_is_computed():
    """Prompt of 10 with threshold 4: chunks 4, 4, 2; only the last samples."""
    sched = make_scheduler(64, 4, max_num_batched_tokens=100, long_prefill_token_threshold=4)
    req = make_request("a", _prompt(10), 4)
    sched.add_request(req)
    seen = []
    for _ in range(3):
        out = step(sched)
        (s,) = out.scheduled
        seen.append((s.num_new_tokens, req.num_computed_tokens, req.num_output_tokens))
    assert seen == [(4, 4, 0), (4, 8, 0), (2, 10, 1)]
    assert req.num_tokens == 11
    out = step(sched)  # then decodes, one token at a time
    assert _chunks(out) == {"a": 1} and req.num_computed_tokens == 11


def test_long_prefill_threshold_is_per_request_within_the_shared_budget():
    sched = make_scheduler(64, 4, max_num_batched_tokens=6, long_prefill_token_threshold=4)
    sched.add_request(make_request("a", _prompt(10), 4))
    sched.add_request(make_request("b", _prompt(10, 100), 4))
    assert _chunks(step(sched)) == {"a": 4, "b": 2}
    assert _chunks(step(sched)) == {"a": 4, "b": 2}
    assert _chunks(step(sched)) == {"a": 2, "b": 4}


# ---- prefix caching -----------------------------------------------------------------------


def test_prefix_cache_hit_is_skipped():
    """B shares A's first two full blocks (8 tokens): it starts at 8 computed and is
    scheduled only its remaining tokens, on A's physical blocks."""
    sched = make_scheduler(64, 4, enable_prefix_caching=True, max_num_batched_tokens=100)
    shared = _prompt(8)
    sched.add_request(make_request("a", shared + [50, 51], 4))
    step(sched)
    b = make_request("b", shared + [60, 61, 62], 4)
    sched.add_request(b)
    out = step(sched)
    assert _chunks(out) == {"a": 1, "b": 3}
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 11
    kv = sched.kv_cache
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]


def test_the_last_token_is_never_taken_from_the_cache():
    """B's prompt is exactly A's first two full blocks: only the first may hit, so the last
    token is computed (its logits are needed to sample)."""
    sched = make_scheduler(64, 4, enable_prefix_caching=True, max_num_batched_tokens=100)
    sched.add_request(make_request("a", _prompt(10), 4))
    step(sched)
    b = make_request("b", _prompt(8), 4)
    sched.add_request(b)
    out = sched.schedule()
    assert _chunks(out) == {"a": 1, "b": 4}
    assert b.num_computed_tokens == 4 and b.num_cached_tokens == 4
    (sb,) = [s for s in out.scheduled if s.request is b]
    assert sb.samples  # the step reaches its last token


def test_prefix_hit_then_threshold_chunks_the_rest():
    sched = make_scheduler(64, 4, enable_prefix_caching=True, max_num_batched_tokens=100, long_prefill_token_threshold=3)
    a = make_request("a", _prompt(9), 4)
    sched.add_request(a)
    for _ in range(3):  # 9 prompt tokens in chunks of 3; the last samples
        step(sched)
    assert a.num_output_tokens == 1
    b = make_request("b", _prompt(8) + _prompt(7, 500), 4)
    sched.add_request(b)
    out = step(sched)
    assert _chunks(out)["b"] == 3 and b.num_computed_tokens == 8 + 3


def test_no_prefix_hits_when_caching_is_off():
    sched = make_scheduler(64, 4, enable_prefix_caching=False, max_num_batched_tokens=100)
    sched.add_request(make_request("a", _prompt(10), 4))
    step(sched)
    b = make_request("b", _prompt(10), 4)
    sched.add_request(b)
    assert _chunks(step(sched))["b"] == 10 and b.num_cached_tokens == 0
