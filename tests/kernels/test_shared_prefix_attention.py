"""Shared-prefix decode attention kernels: shared_prefix_attention (a group's queries
against its common prefix blocks, read once), paged_decode_attention_lse (each row's own
suffix) and merge_attention_states, against an explicit fp32 reference (scores -> logsumexp
-> softmax @ V over the gathered positions)."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.attention.kv_pool import dequantize_kv, quantize_kv
from kvserve.kernels import cpu_ops, unavailable_reason

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"CPU kernels unavailable: {unavailable_reason()}")

BLOCK = 16
# bf16 queries and pools, probabilities rounded to bf16 for the PV product: the decode kernel's tolerance
TOL = 1e-2
SHAPES = [(9, 3, 64), (8, 2, 128), (32, 8, 128)]  # SmolLM2 (g = 3); Llama-like (g = 4)
SHAPE_IDS = ["g3-h64", "g4-h128", "g4-h128-kv8"]


def _pools(num_blocks, num_kv_heads, head_dim, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim, generator=g).to(dtype)
    return k, v


def _queries(n, num_heads, head_dim, dtype=torch.bfloat16, seed=1):
    return torch.randn(n, num_heads, head_dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _slots(blocks: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return blocks[positions // BLOCK].long() * BLOCK + positions % BLOCK


def reference(q, k_pool, v_pool, slots, scale):
    """One row's attention over the positions at `slots` in fp32: (out [N_q, H], lse [N_q])."""
    num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[2]
    if len(slots) == 0:
        return torch.zeros(num_heads, head_dim), torch.full((num_heads,), -math.inf)
    k = k_pool.reshape(-1, num_kv_heads, head_dim)[slots].float()  # [S, N_kv, H]
    v = v_pool.reshape(-1, num_kv_heads, head_dim)[slots].float()
    rep = num_heads // num_kv_heads
    k = k.repeat_interleave(rep, dim=1)  # [S, N_q, H]
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("hd,shd->hs", q.float(), k) * scale  # [N_q, S]
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hs,shd->hd", torch.exp(scores - lse[:, None]), v)
    return out, lse


def _group_case(n, num_heads, num_kv_heads, head_dim, prefix_len, suffix_lens, seed=0):
    """A group of n requests on shuffled blocks: a shared prefix of whole blocks (its last one
    partly used when prefix_len is off the block grid), then each request's private blocks."""
    prefix_blocks_n = -(-prefix_len // BLOCK) if prefix_len else 0
    private = [-(-s // BLOCK) for s in suffix_lens]
    num_blocks = prefix_blocks_n + sum(private) + 2
    k, v = _pools(num_blocks, num_kv_heads, head_dim, seed=seed)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + 7)).to(torch.int32)
    prefix_blocks = order[:prefix_blocks_n]
    used, tables = prefix_blocks_n, []
    for p in private:
        tables.append(torch.cat([prefix_blocks, order[used : used + p]]))
        used += p
    width = max(len(t) for t in tables)
    table = torch.zeros(n, max(width, 1), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    q = _queries(n, num_heads, head_dim, seed=seed + 1)
    return q, k, v, prefix_blocks, table


# ---- shared_prefix_attention -----------------------------------------------------------------


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("n, prefix_len", [(1, 16), (3, 40), (16, 256), (5, 257), (16, 2048), (2, 600), (40, 64)])
def test_shared_prefix_matches_reference(num_heads, num_kv_heads, head_dim, n, prefix_len):
    q, k, v, prefix_blocks, _ = _group_case(n, num_heads, num_kv_heads, head_dim, prefix_len, [0] * n)
    scale = head_dim**-0.5
    out, lse = ops.shared_prefix_attention(q, k, v, prefix_blocks, prefix_len, scale)
    assert out.shape == (n, num_heads, head_dim) and out.dtype == torch.float32
    assert lse.shape == (n, num_heads) and lse.dtype == torch.float32
    slots = _slots(prefix_blocks, torch.arange(prefix_len))
    for b in range(n):
        ref_out, ref_lse = reference(q[b], k, v, slots, scale)
        torch.testing.assert_close(out[b], ref_out, atol=TOL, rtol=TOL)
        torch.testing.assert_close(lse[b], ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES[:2], ids=SHAPE_IDS[:2])
@pytest.mark.parametrize("group", [2, 8, 16, 40])  # 40 x g rows: row groups in passes of 4 + more
@pytest.mark.parametrize("prefix_len", [16, 300, 2048])
def test_shared_prefix_row_does_not_depend_on_its_group(num_heads, num_kv_heads, head_dim, group, prefix_len):
    """A row alone and the same row among others of a group: bitwise the same output and lse."""
    q, k, v, prefix_blocks, _ = _group_case(group, num_heads, num_kv_heads, head_dim, prefix_len, [0] * group)
    scale = head_dim**-0.5
    out, lse = ops.shared_prefix_attention(q, k, v, prefix_blocks, prefix_len, scale)
    for b in {0, group // 2, group - 1}:
        alone_out, alone_lse = ops.shared_prefix_attention(q[b : b + 1], k, v, prefix_blocks, prefix_len, scale)
        assert torch.equal(alone_out[0], out[b]) and torch.equal(alone_lse[0], lse[b])
    perm = torch.randperm(group, generator=torch.Generator().manual_seed(3))
    p_out, p_lse = ops.shared_prefix_attention(q[perm].contiguous(), k, v, prefix_blocks, prefix_len, scale)
    assert torch.equal(p_out, out[perm]) and torch.equal(p_lse, lse[perm])


def test_shared_prefix_of_no_positions_is_empty():
    q, k, v, prefix_blocks, _ = _group_case(4, 9, 3, 64, 32, [0] * 4)
    out, lse = ops.shared_prefix_attention(q, k, v, prefix_blocks, 0, 0.125)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.all(lse == -math.inf))


def test_shared_prefix_refuses_a_length_past_its_blocks_and_int8_pools_without_scales():
    q, k, v, prefix_blocks, _ = _group_case(2, 9, 3, 64, 32, [0, 0])
    with pytest.raises(RuntimeError, match="past its"):
        ops.shared_prefix_attention(q, k, v, prefix_blocks, 33, 0.125)
    k8, v8 = k.to(torch.int8), v.to(torch.int8)
    with pytest.raises(RuntimeError, match="int8 pools need their contiguous float32 scales"):
        ops.shared_prefix_attention(q, k8, v8, prefix_blocks, 32, 0.125)
    with pytest.raises(RuntimeError, match="scales are for int8 pools only"):
        ops.shared_prefix_attention(q, k, v, prefix_blocks, 32, 0.125, torch.ones(k.shape[:3]), torch.ones(k.shape[:3]))


def _int8(k, v):
    """bf16 pools quantized by the engine's rule (attention/kv_pool.py quantize_kv), and the
    values they stand for (the reference reads these)."""
    (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    return k8, v8, ks, vs, dequantize_kv(k8, ks, torch.float32), dequantize_kv(v8, vs, torch.float32)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("n, prefix_len", [(1, 16), (16, 2048), (5, 300), (40, 64)])
def test_shared_prefix_on_int8_pools_matches_reference(num_heads, num_kv_heads, head_dim, n, prefix_len):
    """int8 pools: each chunk's codes widened once (exact), K scales on the scores, V scales on
    the probabilities; against the fp32 reference over the dequantized values."""
    q, k, v, prefix_blocks, _ = _group_case(n, num_heads, num_kv_heads, head_dim, prefix_len, [0] * n)
    k8, v8, ks, vs, kf, vf = _int8(k, v)
    scale = head_dim**-0.5
    out, lse = ops.shared_prefix_attention(q, k8, v8, prefix_blocks, prefix_len, scale, ks, vs)
    slots = _slots(prefix_blocks, torch.arange(prefix_len))
    for b in range(n):
        ref_out, ref_lse = reference(q[b], kf, vf, slots, scale)
        torch.testing.assert_close(out[b], ref_out, atol=TOL, rtol=TOL)
        torch.testing.assert_close(lse[b], ref_lse, atol=1e-4, rtol=1e-5)


# ---- paged_decode_attention_lse --------------------------------------------------------------


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, TOL), (torch.float32, 1e-5)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES, ids=SHAPE_IDS)
def test_lse_decode_matches_reference_over_each_rows_range(dtype, tol, num_heads, num_kv_heads, head_dim):
    ranges = [(0, 1), (16, 16), (32, 33), (7, 200), (64, 364), (0, 300), (48, 49), (160, 170)]  # (start, len); one empty
    B = len(ranges)
    max_blocks = -(-max(e for _, e in ranges) // BLOCK)
    k, v = _pools(B * max_blocks + 1, num_kv_heads, head_dim, dtype)
    g = torch.Generator().manual_seed(5)
    tables = torch.randperm(B * max_blocks + 1, generator=g)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    q = _queries(B, num_heads, head_dim, dtype)
    starts = torch.tensor([s for s, _ in ranges], dtype=torch.int32)
    lens = torch.tensor([e for _, e in ranges], dtype=torch.int32)
    scale = head_dim**-0.5
    out, lse = ops.paged_decode_attention_lse(q, k, v, tables, lens, starts, scale)
    assert out.dtype == torch.float32 and lse.shape == (B, num_heads)
    for b, (s, e) in enumerate(ranges):
        ref_out, ref_lse = reference(q[b], k, v, _slots(tables[b], torch.arange(s, e)), scale)
        torch.testing.assert_close(out[b], ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[b], ref_lse, atol=1e-4, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool(torch.all(lse[1] == -math.inf))


def test_lse_decode_from_zero_is_the_decode_kernel():
    """start 0: the same sums as paged_decode_attention, whose bf16 output is this fp32 one
    rounded (at every level, the `amx` level's tiles included)."""
    lens = [1, 17, 200, 33]
    k, v = _pools(64, 3, 64)
    tables = torch.randperm(64, generator=torch.Generator().manual_seed(2))[: 4 * 13].view(4, 13).to(torch.int32)
    q = _queries(4, 9, 64)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out, _ = ops.paged_decode_attention_lse(q, k, v, tables, lens_t, torch.zeros(4, dtype=torch.int32), 0.125)
    plain = ops.paged_decode_attention(q, k, v, tables, lens_t, 0.125)
    assert torch.equal(out.bfloat16(), plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-q", "fp32-q"])
def test_lse_decode_on_int8_pools_matches_reference_and_from_zero_is_the_int8_kernel(dtype):
    ranges = [(0, 1), (16, 16), (32, 33), (7, 200), (0, 300), (160, 170)]  # (start, len); one empty
    B = len(ranges)
    max_blocks = -(-max(e for _, e in ranges) // BLOCK)
    k, v = _pools(B * max_blocks + 1, 3, 64)
    k8, v8, ks, vs, kf, vf = _int8(k, v)
    tables = torch.randperm(B * max_blocks + 1, generator=torch.Generator().manual_seed(6))[: B * max_blocks]
    tables = tables.view(B, max_blocks).to(torch.int32)
    q = _queries(B, 9, 64, dtype)
    starts = torch.tensor([s for s, _ in ranges], dtype=torch.int32)
    lens = torch.tensor([e for _, e in ranges], dtype=torch.int32)
    out, lse = ops.paged_decode_attention_lse(q, k8, v8, tables, lens, starts, 0.125, ks, vs)
    for b, (s, e) in enumerate(ranges):
        ref_out, ref_lse = reference(q[b], kf, vf, _slots(tables[b], torch.arange(s, e)), 0.125)
        torch.testing.assert_close(out[b], ref_out, atol=TOL, rtol=TOL)
        torch.testing.assert_close(lse[b], ref_lse, atol=1e-4, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool(torch.all(lse[1] == -math.inf))
    # from 0: the int8 decode kernel's sums, whose output is this fp32 one rounded to q's dtype
    live = lens > 0
    zero_out, _ = ops.paged_decode_attention_lse(q[live], k8, v8, tables[live], lens[live],
                                                 torch.zeros(int(live.sum()), dtype=torch.int32), 0.125, ks, vs)  # fmt: skip
    plain = ops.paged_decode_attention(q[live], k8, v8, tables[live], lens[live], 0.125, ks, vs)
    assert torch.equal(zero_out.to(dtype), plain)


def test_lse_decode_refuses_a_start_past_the_length():
    k, v = _pools(4, 3, 64)
    with pytest.raises(RuntimeError, match="start"):
        ops.paged_decode_attention_lse(_queries(1, 9, 64), k, v, torch.zeros(1, 2, dtype=torch.int32),
                                       torch.tensor([5], dtype=torch.int32), torch.tensor([6], dtype=torch.int32), 0.1)  # fmt: skip


# ---- merge_attention_states and the whole plan --------------------------------------------


def _shared_prefix_decode(q, k, v, prefix_blocks, prefix_len, table, suffix_lens, scale, out_dtype=torch.bfloat16):
    n = q.shape[0]
    pre_out, pre_lse = ops.shared_prefix_attention(q, k, v, prefix_blocks, prefix_len, scale)
    lens = torch.tensor([prefix_len + s for s in suffix_lens], dtype=torch.int32)
    starts = torch.full((n,), prefix_len, dtype=torch.int32)
    suf_out, suf_lse = ops.paged_decode_attention_lse(q, k, v, table, lens, starts, scale)
    return ops.merge_attention_states(pre_out, pre_lse, suf_out, suf_lse, out_dtype)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize(
    "prefix_len, suffix_lens",
    [(16, [1]), (256, [0, 1, 17, 300]), (2048, [64] * 4 + [65, 0, 100, 3] * 3), (1024, [0] * 5), (32, [300, 2])],
)
def test_prefix_and_suffix_merged_are_one_softmax_over_the_whole_history(
    num_heads, num_kv_heads, head_dim, prefix_len, suffix_lens
):
    n = len(suffix_lens)
    q, k, v, prefix_blocks, table = _group_case(n, num_heads, num_kv_heads, head_dim, prefix_len, suffix_lens)
    scale = head_dim**-0.5
    out, lse = _shared_prefix_decode(q, k, v, prefix_blocks, prefix_len, table, suffix_lens, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    lens = torch.tensor([prefix_len + s for s in suffix_lens], dtype=torch.int32)
    plain = ops.paged_decode_attention(q, k, v, table, lens, scale)
    for b in range(n):
        ref_out, ref_lse = reference(q[b], k, v, _slots(table[b], torch.arange(prefix_len + suffix_lens[b])), scale)
        torch.testing.assert_close(out[b].float(), ref_out, atol=TOL, rtol=TOL)
        torch.testing.assert_close(lse[b], ref_lse, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(out[b].float(), plain[b].float(), atol=TOL, rtol=TOL)


def test_merge_is_one_softmax_over_the_concatenated_keys():
    """The merge math alone, in fp32: two parts of a row's keys, any split (empty parts too)."""
    g = torch.Generator().manual_seed(11)
    R, S, H = 6, 40, 64
    scores = torch.randn(R, S, generator=g) * 3
    values = torch.randn(S, H, generator=g)

    def part(lo, hi):
        if lo == hi:
            return torch.full((R, H), float("nan")), torch.full((R,), -math.inf)  # an empty part's output is never read
        lse = torch.logsumexp(scores[:, lo:hi], dim=-1)
        return torch.exp(scores[:, lo:hi] - lse[:, None]) @ values[lo:hi], lse

    whole_out, whole_lse = part(0, S)
    for split in [0, 1, 17, S - 1, S]:
        (oa, la), (ob, lb) = part(0, split), part(split, S)
        out, lse = ops.merge_attention_states(oa, la, ob, lb, torch.float32)
        torch.testing.assert_close(out, whole_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, whole_lse, atol=1e-5, rtol=1e-5)
        out16, _ = ops.merge_attention_states(oa, la, ob, lb, torch.bfloat16)
        assert out16.dtype == torch.bfloat16 and torch.equal(out16, out.bfloat16())
    # three parts, merged in two steps (a group within a group)
    (o1, l1), (o2, l2), (o3, l3) = part(0, 10), part(10, 25), part(25, S)
    o12, l12 = ops.merge_attention_states(o1, l1, o2, l2, torch.float32)
    out, lse = ops.merge_attention_states(o12, l12, o3, l3, torch.float32)
    torch.testing.assert_close(out, whole_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, whole_lse, atol=1e-5, rtol=1e-5)


def test_merge_of_two_empty_parts_is_zero():
    nan = torch.full((2, 3, 16), float("nan"))
    empty = torch.full((2, 3), -math.inf)
    out, lse = ops.merge_attention_states(nan, empty, nan, empty, torch.bfloat16)
    assert torch.equal(out, torch.zeros(2, 3, 16, dtype=torch.bfloat16)) and bool(torch.all(lse == -math.inf))


def test_merge_with_one_empty_part_is_the_other_bitwise():
    o = torch.randn(4, 9, 64)
    lse_o = torch.randn(4, 9)
    out, lse = ops.merge_attention_states(torch.full_like(o, float("inf")), torch.full_like(lse_o, -math.inf), o, lse_o,
                                          torch.float32)  # fmt: skip
    assert torch.equal(out, o) and torch.equal(lse, lse_o)


# ---- shared_prefix_decode_attention: a whole plan in one call ----------------------------------------


def _nested_plan_case(num_heads, num_kv_heads, head_dim, seed=3):
    """Seven rows: rows 0-5 share 4 blocks; rows 1, 2, 4 also share the next 3; row 6 shares
    nothing. Every row has its own suffix (lengths 1..40) after its deepest level."""
    outer, inner = 4, 3
    suffix = [1, 17, 40, 5, 16, 33, 20]
    private = [-(-s // BLOCK) for s in suffix]
    num_blocks = outer + inner + sum(private) + 1
    k, v = _pools(num_blocks, num_kv_heads, head_dim, seed=seed)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    outer_b, inner_b = order[:outer], order[outer : outer + inner]
    used, tables, starts = outer + inner, [], []
    for r, p in enumerate(private):
        shared = [] if r == 6 else [outer_b] + ([inner_b] if r in (1, 2, 4) else [])
        start = sum(len(t) for t in shared) * BLOCK
        tables.append(torch.cat(shared + [order[used : used + p]]))
        starts.append(start)
        used += p
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    lens = torch.tensor([s + n for s, n in zip(starts, suffix)], dtype=torch.int32)
    q = _queries(len(tables), num_heads, head_dim, seed=seed + 1)
    levels = [(torch.tensor([0, 1, 2, 3, 4, 5]), outer_b, outer * BLOCK), (torch.tensor([1, 2, 4]), inner_b, inner * BLOCK)]
    return q, k, v, table, lens, torch.tensor(starts, dtype=torch.int32), levels


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES, ids=SHAPE_IDS)
def test_shared_prefix_plan_in_one_call_is_its_parts_bitwise(num_heads, num_kv_heads, head_dim):
    """ops.shared_prefix_decode_attention (what the fused decode step runs per layer) gives the bits of
    its parts called one by one and merged in the same order (suffix, then levels outer to
    inner), and each row agrees with one softmax over its whole history."""
    q, k, v, table, lens, starts, levels = _nested_plan_case(num_heads, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    plan = ops.SharedPrefixDecodePlan(
        suffix_start=starts,
        levels=[ops.SharedPrefixLevel(members=m, blocks=b, num_positions=p) for m, b, p in levels],
    )
    out = ops.shared_prefix_decode_attention(q, k, v, table, lens, plan, scale)
    acc, acc_lse = ops.paged_decode_attention_lse(q, k, v, table, lens, starts, scale)
    for members, blocks, positions in levels:
        o, lse = ops.shared_prefix_attention(q[members], k, v, blocks, positions, scale)
        merged, merged_lse = ops.merge_attention_states(acc[members], acc_lse[members], o, lse, torch.float32)
        acc[members], acc_lse[members] = merged, merged_lse
    assert out.dtype == torch.bfloat16 and torch.equal(out, acc.bfloat16())
    for b in range(q.shape[0]):
        ref_out, _ = reference(q[b], k, v, _slots(table[b], torch.arange(int(lens[b]))), scale)
        torch.testing.assert_close(out[b].float(), ref_out, atol=TOL, rtol=TOL)


def test_shared_prefix_plan_on_int8_pools_agrees_with_one_softmax():
    q, k, v, table, lens, starts, levels = _nested_plan_case(9, 3, 64)
    k8, v8, ks, vs, kf, vf = _int8(k, v)
    plan = ops.SharedPrefixDecodePlan(
        suffix_start=starts,
        levels=[ops.SharedPrefixLevel(members=m, blocks=b, num_positions=p) for m, b, p in levels],
    )
    out = ops.shared_prefix_decode_attention(q, k8, v8, table, lens, plan, 0.125, ks, vs)
    for b in range(q.shape[0]):
        ref_out, _ = reference(q[b], kf, vf, _slots(table[b], torch.arange(int(lens[b]))), 0.125)
        torch.testing.assert_close(out[b].float(), ref_out, atol=TOL, rtol=TOL)


def test_shared_prefix_plan_refuses_rows_outside_the_batch_or_out_of_order():
    q, k, v, table, lens, starts, levels = _nested_plan_case(9, 3, 64)
    members, blocks, positions = levels[0]
    for bad in (torch.tensor([0, 7]), torch.tensor([2, 1])):
        plan = ops.SharedPrefixDecodePlan(suffix_start=starts, levels=[ops.SharedPrefixLevel(members=bad, blocks=blocks, num_positions=positions)])
        with pytest.raises(RuntimeError, match="ascending rows"):
            ops.shared_prefix_decode_attention(q, k, v, table, lens, plan, 0.125)
    with pytest.raises(RuntimeError, match="one suffix start per row"):
        ops.shared_prefix_decode_attention(q, k, v, table, lens, ops.SharedPrefixDecodePlan(suffix_start=starts[:3], levels=[]), 0.125)
