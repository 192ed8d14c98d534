"""Gemma 2's attention-logit soft-capping in every attention kernel: scores capped to
cap · tanh(s / cap) before the softmax, against the plain-torch reference path
(kvserve/attention/reference.py, which caps the same way), for float and int8 pools, with a
row's bits independent of the other rows in its call. The cap here is low enough that it
changes every result (checked), so a kernel that ignored it would fail."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.kv_pool import quantize_kv
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.reference import decode_attention, prefill_attention
from kvserve.kernels import cpu_ops, unavailable_reason
from tests.support.kernel_cases import prefill_case

ops = cpu_ops()  # rebound per level by tests/kernels/conftest.py
pytestmark = pytest.mark.skipif(ops is None and unavailable_reason() is not None, reason=f"CPU kernels unavailable: {unavailable_reason()}")

CAP = 1.5  # scores of these random queries reach ±6 (queries ×3): the cap bites hard
BLOCK = 16


def _decode_case(dtype, num_heads, num_kv_heads, head_dim, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK) for n in lens) + 2
    k = torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim, generator=g).to(dtype)
    q = (3 * torch.randn(len(lens), num_heads, head_dim, generator=g)).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    width = -(-max(lens) // BLOCK)
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        tables[i, : -(-n // BLOCK)] = order[used : used + -(-n // BLOCK)]
        used += -(-n // BLOCK)
    ctx = torch.arange(max(lens))
    slots = tables[:, ctx // BLOCK].long() * BLOCK + ctx % BLOCK
    mask = (ctx.unsqueeze(0) < lens_t.unsqueeze(1)).view(len(lens), 1, 1, -1)
    return q, k, v, AttentionMetadata(None, len(lens), slots, mask, lens_t, tables, [])


DECODE_SHAPES = [
    (9, 3, 64, [1, 17, 200, 33]),  # SmolLM2's heads; partial tiles and whole ones
    (8, 4, 256, [40, 300]),  # Gemma-2-2B's head_dim and g = 2; two splits
    (16, 8, 128, [7, 64]),  # Gemma-2-9B's heads
]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, lens", DECODE_SHAPES)
def test_decode_attention_caps_scores_as_the_reference(dtype, tol, num_heads, num_kv_heads, head_dim, lens):
    q, k, v, meta = _decode_case(dtype, num_heads, num_kv_heads, head_dim, lens)
    scale = head_dim**-0.5
    expected = decode_attention(q.float(), k.float(), v.float(), meta, scale, softcap=CAP)
    args = (q, k, v, meta.decode_block_tables, meta.decode_context_lens, scale)
    got = ops.paged_decode_attention(*args, softcap=CAP)
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)
    assert (got.float() - ops.paged_decode_attention(*args).float()).abs().max() > 0.1  # the cap changed the result
    assert torch.equal(ops.paged_decode_attention(*args, softcap=0.0), ops.paged_decode_attention(*args))  # 0: none


def test_int8_decode_attention_caps_scores_as_the_reference():
    q, k, v, meta = _decode_case(torch.bfloat16, 9, 3, 64, [5, 90, 33])
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    scale = 64**-0.5
    expected = decode_attention(q.float(), kq, vq, meta, scale, ks, vs, softcap=CAP)
    got = ops.paged_decode_attention(q, kq, vq, meta.decode_block_tables, meta.decode_context_lens, scale, ks, vs, softcap=CAP)
    torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=1e-2)


def test_decode_attention_lse_over_a_range_caps_its_scores():
    """The ranged form (a window's rows, a suffix after a shared prefix): its lse is that of the
    capped scores, so merges of capped parts are the capped whole."""
    q, k, v, meta = _decode_case(torch.bfloat16, 8, 4, 256, [40, 300])
    scale = 256**-0.5
    starts = torch.tensor([9, 250], dtype=torch.int32)
    out, lse = ops.paged_decode_attention_lse(q, k, v, meta.decode_block_tables, meta.decode_context_lens, starts, scale,
                                              softcap=CAP)
    kf = k.float().reshape(-1, 4, 256)
    vf = v.float().reshape(-1, 4, 256)
    for b, (s0, n) in enumerate([(9, 40), (250, 300)]):
        slots = meta.decode_slots[b, s0:n]
        keys = kf[slots].repeat_interleave(2, dim=1)  # [S, N_q, H]
        scores = torch.einsum("hd,shd->hs", q[b].float(), keys) * scale
        scores = CAP * torch.tanh(scores / CAP)
        ref_lse = torch.logsumexp(scores, -1)
        ref_out = torch.einsum("hs,shd->hd", torch.softmax(scores, -1), vf[slots].repeat_interleave(2, dim=1))
        torch.testing.assert_close(lse[b], ref_lse, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(out[b], ref_out, atol=1e-2, rtol=1e-2)


def test_a_capped_decode_row_has_the_same_bits_alone_and_in_a_batch():
    q, k, v, meta = _decode_case(torch.bfloat16, 8, 4, 256, [40, 300, 129])
    scale = 256**-0.5
    batch = ops.paged_decode_attention(q, k, v, meta.decode_block_tables, meta.decode_context_lens, scale, softcap=CAP)
    for b in range(3):
        alone = ops.paged_decode_attention(q[b : b + 1], k, v, meta.decode_block_tables[b : b + 1],
                                           meta.decode_context_lens[b : b + 1], scale, softcap=CAP)
        assert torch.equal(alone[0], batch[b])


PREFILL_CASES = [
    (8, 4, 256, [(0, 70), (40, 9)]),  # Gemma-2-2B's heads; a chunk over cached history
    (9, 3, 64, [(0, 17), (33, 7), (5, 200)]),
]


def _prefill(q, k, v, prefills, scale, softcap, k_scale=None, v_scale=None):
    meta = AttentionMetadata(None, 0, None, None, None, None, prefills)
    got = torch.full_like(q, float("nan"))
    slots, segs, _ = meta.prefill_kernel_args()
    ops.paged_prefill_attention(q, k, v, slots, segs, scale, got, k_scale, v_scale, None, softcap)
    return got, meta


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, segments", PREFILL_CASES)
def test_prefill_attention_caps_scores_as_the_reference(num_heads, num_kv_heads, head_dim, segments):
    q, k, v, prefills = prefill_case(segments, num_heads, num_kv_heads, head_dim, BLOCK)
    q = (3 * q.float()).bfloat16()
    scale = head_dim**-0.5
    got, meta = _prefill(q, k, v, prefills, scale, CAP)
    expected = torch.empty(q.shape)
    prefill_attention(q.float(), k.float(), v.float(), meta, scale, expected, softcap=CAP)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
    plain, _ = _prefill(q, k, v, prefills, scale, 0.0)
    assert (got.float() - plain.float()).abs().max() > 0.1


def test_int8_prefill_attention_caps_scores_as_the_reference():
    q, k, v, prefills = prefill_case([(0, 40), (20, 30)], 9, 3, 64, BLOCK)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    scale = 64**-0.5
    got, meta = _prefill(q, kq, vq, prefills, scale, CAP, ks, vs)
    expected = torch.empty(q.shape)
    prefill_attention(q.float(), kq, vq, meta, scale, expected, ks, vs, softcap=CAP)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_a_capped_prompt_has_the_same_bits_alone_and_beside_others():
    q, k, v, prefills = prefill_case([(0, 70), (40, 9), (0, 33)], 8, 4, 256, BLOCK)
    scale = 256**-0.5
    together, _ = _prefill(q, k, v, prefills, scale, CAP)
    seg = prefills[1]
    rows = slice(seg.query_start, seg.query_start + seg.num_new)
    seg.query_start = 0
    alone, _ = _prefill(q[rows].contiguous(), k, v, [seg], scale, CAP)
    assert torch.equal(alone, together[rows])


def test_shared_prefix_attention_caps_scores_as_the_reference():
    q, k, v, meta = _decode_case(torch.bfloat16, 8, 4, 256, [300])
    blocks = meta.decode_block_tables[0]
    n, prefix_len, scale = 5, 280, 256**-0.5
    queries = (3 * torch.randn(n, 8, 256, generator=torch.Generator().manual_seed(3))).bfloat16()
    out, lse = ops.shared_prefix_attention(queries, k, v, blocks, prefix_len, scale, softcap=CAP)
    slots = meta.decode_slots[0, :prefix_len]
    keys = k.float().reshape(-1, 4, 256)[slots].repeat_interleave(2, dim=1)
    vals = v.float().reshape(-1, 4, 256)[slots].repeat_interleave(2, dim=1)
    for b in range(n):
        scores = CAP * torch.tanh(torch.einsum("hd,shd->hs", queries[b].float(), keys) * scale / CAP)
        torch.testing.assert_close(lse[b], torch.logsumexp(scores, -1), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(out[b], torch.einsum("hs,shd->hd", torch.softmax(scores, -1), vals), atol=1e-2, rtol=1e-2)


def test_a_negative_softcap_is_refused_by_name():
    q, k, v, meta = _decode_case(torch.bfloat16, 9, 3, 64, [5])
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        ops.paged_decode_attention(q, k, v, meta.decode_block_tables, meta.decode_context_lens, 0.125, softcap=-1.0)
