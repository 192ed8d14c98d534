"""The seed's §2: m new queries over S0 cached positions with the rectangular causal mask."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.metadata import AttentionMetadata, PrefillSegment, rectangular_causal_mask
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.model_runner import StepBatch
from tests.support.paged_driver import PagedDriver

PROMPT = "Once upon a time there was a small engine that served many requests at once. The quick brown fox"


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4))


def test_mask_shape_and_content():
    # cached "abc", new "xefg": Q has 4 rows, K/V 7; history visible, strict upper triangle hidden
    mask = rectangular_causal_mask(3, 4)
    expected = torch.tensor(
        [
            [1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def _whole(engine, prompt):
    driver = PagedDriver(engine)
    req = driver.new_request(prompt)
    out = driver.prefill(req)
    driver.free(req)
    return out


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_equals_whole(engine, chunk):
    prompt = engine.tokenizer.encode(PROMPT)
    assert len(prompt) > 16
    whole = _whole(engine, prompt)
    driver = PagedDriver(engine)
    req = driver.new_request(prompt)
    chunked = driver.prefill(req, chunk=chunk)
    driver.free(req)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


def test_prefill_then_decode_equals_whole(engine):
    prompt = engine.tokenizer.encode(PROMPT)
    whole = _whole(engine, prompt)
    driver = PagedDriver(engine)
    req = driver.new_request(prompt[:-3])
    driver.prefill(req)
    for token in prompt[-3:]:
        out = driver.decode(req, token)
    driver.free(req)
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=1e-5)


def test_chunks_run_without_history_then_concatenated_differ(engine):
    """The seed's warning: running each chunk through all layers with an empty history and
    concatenating the caches misses the cross-chunk work; the next token's logits differ."""
    prompt = engine.tokenizer.encode(PROMPT)
    whole = _whole(engine, prompt)
    driver = PagedDriver(engine)
    req = driver.new_request(prompt[:-1])
    kv = engine.kv_cache
    assert kv.allocate_slots(req, len(prompt))
    table = kv.block_ids(req.request_id)
    bs = engine.config.block_size
    chunk = 8
    for start in range(0, len(prompt) - 1, chunk):
        end = min(start + chunk, len(prompt) - 1)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(start, end)])
        m = end - start
        # the right positions and slots, but attention sees only this chunk (S0 = 0)
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decodes=0,
            decode_slots=None,
            decode_mask=None,
            decode_context_lens=None,
            decode_block_tables=None,
            prefills=[PrefillSegment(0, m, 0, slots, None)],
        )
        batch = StepBatch(
            input_ids=torch.tensor(prompt[start:end]),
            positions=torch.arange(start, end),
            meta=meta,
            logits_indices=torch.tensor([], dtype=torch.long),
            sampling=[],
        )
        engine.runner.execute(batch)
    req.num_computed_tokens = len(prompt) - 1
    concatenated = driver.decode(req, prompt[-1])
    driver.free(req)
    assert (concatenated - whole).abs().max() > 1e-2


def test_equal_length_prompts_batched_in_one_step_equal_each_alone(engine):
    """Whole prompts of one length in one step share one batched SDPA call (a FreshGroup);
    a chunk over history and a prompt of another length in the same step run alone."""
    tok = engine.tokenizer
    prompts = [tok.encode(f"{PROMPT} {w}")[:20] for w in ("red", "green", "blue")]
    assert {len(p) for p in prompts} == {20}
    other = tok.encode(PROMPT)[:13]
    history = tok.encode(PROMPT)[:24]
    alone = {i: _whole(engine, p) for i, p in enumerate(prompts + [other, history])}

    driver = PagedDriver(engine)
    resumed = driver.new_request(history)
    driver.step([(resumed, 16)])  # 16 cached, 8 still to compute over that history
    reqs = [driver.new_request(p) for p in prompts + [other]]
    out = driver.step([(r, r.num_tokens) for r in reqs[:2]] + [(resumed, 8)] + [(r, r.num_tokens) for r in reqs[2:]])
    for i, r in enumerate(reqs):
        torch.testing.assert_close(out[r.request_id], alone[i], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[resumed.request_id], alone[4], atol=1e-5, rtol=1e-5)
    for r in [*reqs, resumed]:
        driver.free(r)


def test_prefill_groups_join_only_adjacent_fresh_prompts_of_one_length():
    def seg(start, m, cached=0):
        return PrefillSegment(start, m, cached, torch.arange(start, start + cached + m), None)

    segs = [seg(0, 4), seg(4, 4), seg(8, 4, cached=2), seg(12, 4), seg(16, 4), seg(20, 5), seg(25, 4)]
    meta = AttentionMetadata(torch.arange(29), 0, None, None, None, None, segs)
    groups, alone = meta.prefill_groups()
    assert [(g.query_start, g.num_segments, g.num_new) for g in groups] == [(0, 2, 4), (12, 2, 4)]
    assert torch.equal(groups[0].slots, torch.arange(0, 8))
    assert [s.query_start for s in alone] == [8, 20, 25]
    assert meta.prefill_groups() is meta.prefill_groups()  # built once per step, shared by the layers
