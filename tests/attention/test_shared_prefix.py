"""Shared-prefix attention (kvserve/attention/shared_prefix_plan.py, merge.py, reference.py):
the grouping, the lse merge, and the reference path against one softmax over each request's
whole history."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.attention.kv_pool import gather, write_kv
from kvserve.attention.merge import attention_with_lse, merge_attention_states
from kvserve.attention.metadata import AttentionMetadata, SharedPrefixTensors
from kvserve.attention.paged import paged_attention
from kvserve.attention.reference import decode_attention, shared_prefix_decode_attention
from kvserve.attention.shared_prefix_plan import SharedPrefixRule, find_shared_prefix_groups, shareable_blocks


def _softmax_ref(q, k, v, scale):
    """One softmax over all keys, fp64."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    return torch.softmax(scores, dim=-1) @ v.double()


# ---- merge math -------------------------------------------------------------------------


@pytest.mark.parametrize("split", [0, 1, 7, 19, 20])  # 0 and 20: one part is empty
def test_merge_equals_one_softmax_over_concatenated_keys(split):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 5, 16), torch.randn(3, 20, 16), torch.randn(3, 20, 16)
    scale = 16**-0.5
    out_a, lse_a = attention_with_lse(q, k[:, :split], v[:, :split], scale)
    out_b, lse_b = attention_with_lse(q, k[:, split:], v[:, split:], scale)
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref = _softmax_ref(q, k, v, scale)
    ref_lse = torch.logsumexp((q.double() @ k.double().transpose(-1, -2)) * scale, dim=-1)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_empty_part_has_lse_minus_inf_and_is_the_identity():
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 0, 8), torch.randn(2, 0, 8)
    out, lse = attention_with_lse(q, k, v, 1.0)
    assert out.shape == (2, 4, 8) and torch.all(out == 0)
    assert torch.all(lse == float("-inf"))
    # fully masked rows are empty parts too
    k2, v2 = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    mask = torch.zeros(2, 4, 6, dtype=torch.bool)
    out_m, lse_m = attention_with_lse(q, k2, v2, 1.0, mask)
    assert torch.all(out_m == 0) and torch.all(lse_m == float("-inf"))
    full, full_lse = attention_with_lse(q, k2, v2, 1.0)
    merged, merged_lse = merge_attention_states(out, lse, full, full_lse)
    torch.testing.assert_close(merged, full)
    torch.testing.assert_close(merged_lse, full_lse)
    both, both_lse = merge_attention_states(out, lse, out_m, lse_m)
    assert torch.all(both == 0) and torch.all(both_lse == float("-inf")) and not torch.isnan(both).any()


def test_merge_is_stable_with_large_scores():
    q = torch.full((1, 1, 4), 30.0)
    k = torch.full((1, 6, 4), 30.0)
    v = torch.randn(1, 6, 4)
    parts = [attention_with_lse(q, k[:, i : i + 2], v[:, i : i + 2], 1.0) for i in (0, 2, 4)]
    out, lse = parts[0]
    for o, s in parts[1:]:
        out, lse = merge_attention_states(out, lse, o, s)
    assert torch.isfinite(out).all()
    # lse ≈ 3600 carries fp32's absolute rounding there (~2e-4): stable, not exact
    torch.testing.assert_close(out, v.mean(dim=1, keepdim=True), rtol=1e-3, atol=1e-3)
    assert math.isclose(lse.item(), 3600 + math.log(6), rel_tol=1e-6)


# ---- grouping ------------------------------------------------------------------------------


def test_groups_nest_and_several_groups_per_batch():
    bs = 4
    tables, lens = [], []
    for r in range(16):  # 16 rows share 8 blocks; rows 0-3 also share the next 20
        t = list(range(8)) + (list(range(100, 120)) if r < 4 else []) + [1000 + 10 * r + i for i in range(3)]
        tables.append(t)
        lens.append(len(t) * bs - 1)
    for p in range(4):  # four more prompts round robin: 2 rows each on blocks 500+p
        for j in range(2):
            tables.append([500 + p, 600 + 2 * p + j])
            lens.append(2 * bs)
    plan = find_shared_prefix_groups(tables, lens, bs)
    spans = [(len(lv.members), lv.start, lv.end) for lv in plan.levels]
    # levels are made a depth at a time: the outer ones first
    assert spans == [(16, 0, 32), (2, 0, 4), (2, 0, 4), (2, 0, 4), (2, 0, 4), (4, 32, 112)]
    assert plan.request_levels[0] == [(0, 0, 32), (5, 32, 112)] and plan.suffix_start[0] == 112
    assert plan.request_levels[7] == [(0, 0, 32)] and plan.suffix_start[7] == 32
    assert plan.request_levels[16] == [(1, 0, 4)] and plan.levels[1].members == [16, 17]
    assert plan.levels[5].parent == 0 and plan.levels[0].parent is None
    assert plan.levels[5].block_ids == list(range(100, 120))
    assert plan.positions_read_once() == 32 + 80 + 4 * 4 + sum(n - s for n, s in zip(lens, plan.suffix_start))


def test_only_full_history_blocks_are_shared():
    bs = 4
    # both rows hold block 7 second, but for row 1 it holds the new position: not shareable
    tables = [[3, 7, 9], [3, 7]]
    lens = [11, 6]  # row 1: positions 0..5, the new one (5) sits in block 7
    assert shareable_blocks(6, bs) == 1
    plan = find_shared_prefix_groups(tables, lens, bs)
    assert [(lv.start, lv.end) for lv in plan.levels] == [(0, 4)]
    lens = [11, 9]  # now block 7 is all history for both
    plan = find_shared_prefix_groups(tables, lens, bs)
    assert [(lv.start, lv.end) for lv in plan.levels] == [(0, 8)]


def test_minimum_sizes_and_short_levels_handed_down():
    bs = 2
    tables = [[1, 2, 3, 50], [1, 2, 3, 51], [1, 9, 9, 52], [1, 8, 8, 53]]
    lens = [8, 8, 8, 8]
    plan = find_shared_prefix_groups(tables, lens, bs, min_shared_blocks=2)
    # the 4-row level is 1 block (too short): its block goes down to the 2-row level below
    assert [(lv.members, lv.start, lv.end) for lv in plan.levels] == [([0, 1], 0, 6)]
    assert plan.suffix_start == [6, 6, 0, 0]
    assert find_shared_prefix_groups(tables, lens, bs, min_group_size=3).levels[0].members == [0, 1, 2, 3]
    assert not find_shared_prefix_groups(tables, lens, bs, min_shared_blocks=4).levels
    assert SharedPrefixRule().plan([[1, 2], [3, 4]], [5, 5], bs) is None
    assert SharedPrefixRule(min_group_size=5).plan(tables, lens, bs) is None


# ---- the reference path ---------------------------------------------------------------------


def _pools(num_blocks, bs, n_kv, hd, dtype, int8):
    k_pool = torch.zeros(num_blocks, bs, n_kv, hd, dtype=torch.int8 if int8 else dtype)
    v_pool = torch.zeros_like(k_pool)
    if not int8:
        return k_pool, v_pool, None, None
    return k_pool, v_pool, torch.zeros(num_blocks, bs, n_kv), torch.zeros(num_blocks, bs, n_kv)


def _fill(k_pool, v_pool, k_scale, v_scale, slots, dtype):
    n_kv, hd = k_pool.shape[-2], k_pool.shape[-1]
    k = torch.randn(len(slots), n_kv, hd, dtype=dtype)
    v = torch.randn(len(slots), n_kv, hd, dtype=dtype)
    write_kv(k_pool, v_pool, torch.tensor(slots), k, v, k_scale, v_scale)


def _batch(bs, dtype, int8):
    """16 rows sharing 3 blocks, 4 of them 2 more; two rows sharing another prompt; one alone."""
    torch.manual_seed(1)
    n_kv, hd = 2, 16
    k_pool, v_pool, ks, vs = _pools(200, bs, n_kv, hd, dtype, int8)
    nxt = iter(range(20, 200))
    common, deeper, other = [1, 2, 3], [4, 5], [6, 7]
    tables, lens = [], []
    for r in range(19):
        head = common + (deeper if r < 4 else []) if r < 16 else (other if r < 18 else [])
        own = [next(nxt) for _ in range(2 + r % 3)]
        tables.append(head + own)
        lens.append(len(head) * bs + 1 + (r * 5) % (len(own) * bs - 1))
    used = sorted({b for t in tables for b in t})
    _fill(k_pool, v_pool, ks, vs, [b * bs + i for b in used for i in range(bs)], dtype)
    return k_pool, v_pool, ks, vs, tables, lens


def _reference_rows(q, k_pool, v_pool, ks, vs, tables, lens, bs, scale):
    """Each row alone, one softmax over its whole history (dequantized as the path does)."""
    n_kv, hd = k_pool.shape[-2], k_pool.shape[-1]
    g = q.shape[1] // n_kv
    rows = []
    for r, (t, n) in enumerate(zip(tables, lens)):
        pos = torch.arange(n)
        slots = torch.tensor(t)[pos // bs] * bs + pos % bs
        k = gather(k_pool, slots, ks, q.dtype).transpose(0, 1)  # [N_kv, n, H]
        v = gather(v_pool, slots, vs, q.dtype).transpose(0, 1)
        rows.append(_softmax_ref(q[r].view(n_kv, g, hd), k, v, scale).reshape(-1, hd))
    return torch.stack(rows)


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("bs", [4, 16])
def test_shared_prefix_decode_equals_per_request_softmax(bs, int8):
    k_pool, v_pool, ks, vs, tables, lens = _batch(bs, torch.float32, int8)
    plan = find_shared_prefix_groups(tables, lens, bs)
    assert [(len(lv.members), lv.parent) for lv in plan.levels] == [(16, None), (2, None), (4, 0)]  # nested, and a second group
    shared = SharedPrefixTensors.for_reference(plan, tables, torch.device("cpu"))
    q = torch.randn(len(tables), 8, 16)
    scale = 16**-0.5
    out = shared_prefix_decode_attention(q, k_pool, v_pool, shared, scale, ks, vs)
    assert out.dtype == q.dtype and out.shape == q.shape
    ref = _reference_rows(q, k_pool, v_pool, ks, vs, tables, lens, bs, scale)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def _meta(tables, lens, bs, shared_prefix=None):
    lens_t = torch.tensor(lens)
    max_len = int(lens_t.max())
    max_blocks = -(-max_len // bs)
    padded = torch.tensor([t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in tables])
    ctx = torch.arange(max_len)
    return AttentionMetadata(
        slot_mapping=torch.zeros(len(tables), dtype=torch.long), num_decodes=len(tables),
        decode_slots=None if shared_prefix else padded[:, ctx // bs] * bs + ctx % bs,
        decode_mask=None if shared_prefix else (ctx.unsqueeze(0) < lens_t.unsqueeze(1)).view(len(tables), 1, 1, max_len),
        decode_context_lens=lens_t.int(), decode_block_tables=padded.int(), prefills=[], shared_prefix=shared_prefix,
        kv_positions_read=sum(lens),
    )


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_paged_attention_hook_matches_the_plain_decode_path(int8):
    bs = 4
    k_pool, v_pool, ks, vs, tables, lens = _batch(bs, torch.float32, int8)
    q = torch.randn(len(tables), 8, 16)
    plan = SharedPrefixTensors.for_reference(SharedPrefixRule().plan(tables, lens, bs), tables, torch.device("cpu"))
    meta_on, meta_off = _meta(tables, lens, bs, plan), _meta(tables, lens, bs)
    on = paged_attention(q, k_pool, v_pool, meta_on, 0.25, k_scale=ks, v_scale=vs)
    off = paged_attention(q, k_pool, v_pool, meta_off, 0.25, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(off, decode_attention(q, k_pool, v_pool, meta_off, 0.25, ks, vs))
    assert meta_on.kv_positions_read_with_sharing() < meta_on.kv_positions_read == sum(lens)
    assert meta_off.kv_positions_read_with_sharing() == sum(lens)


def test_bf16_parts_agree_with_sdpa_within_bf16_tolerance():
    bs = 16
    k_pool, v_pool, ks, vs, tables, lens = _batch(bs, torch.bfloat16, False)
    q = torch.randn(len(tables), 8, 16, dtype=torch.bfloat16)
    plan = SharedPrefixTensors.for_reference(SharedPrefixRule().plan(tables, lens, bs), tables, torch.device("cpu"))
    on = paged_attention(q, k_pool, v_pool, _meta(tables, lens, bs, plan), 0.25)
    off = paged_attention(q, k_pool, v_pool, _meta(tables, lens, bs), 0.25)
    assert on.dtype == torch.bfloat16
    torch.testing.assert_close(on.float(), off.float(), rtol=2e-2, atol=2e-2)


def test_a_kernel_path_ignores_a_plan_not_built_for_it():
    """The decode kernel given a plan without its kernel plan runs the plain kernel. The
    counters never meet that case: the runner builds a plan only in the form the step's
    attention runs (none for fp32 queries on the kernels: tests/engine/
    test_shared_prefix_engine.py test_on_the_cpu_kernels counts every history there), so a
    plan in the metadata is a plan that ran."""
    bs = 4
    k_pool, v_pool, ks, vs, tables, lens = _batch(bs, torch.float32, False)
    plan = SharedPrefixTensors(SharedPrefixRule().plan(tables, lens, bs))  # no tensors: not built for any path

    class FakeKernel:
        def paged_decode_attention(self, q, *args):
            return torch.zeros_like(q)

    meta = _meta(tables, lens, bs, plan)
    out = paged_attention(torch.randn(len(tables), 8, 16), k_pool, v_pool, meta, 0.25, decode_ops=FakeKernel())
    assert not out.any()
