"""Prefill chunks over a shared cached prefix (several new prompts hitting the same system
prompt in one step): the grouping (attention/shared_prefix_plan.py find_shared_prefill_prefixes), the
plain-torch path gathering the shared K/V once, and the prefill kernel reading a leader's
packed tiles. Reading once must give the same bits as reading per segment."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.kv_pool import quantize_kv
from kvserve.attention.metadata import AttentionMetadata, PrefillSegment, rectangular_causal_bias
from kvserve.attention.reference import prefill_attention
from kvserve.attention.shared_prefix_plan import PREFILL_SHARE_MULTIPLE, find_shared_prefill_prefixes, prefill_positions_read_once
from kvserve.kernels import cpu_ops, unavailable_reason

ops = cpu_ops()
BLOCK = 16


def test_grouping_takes_the_outer_shared_level_cut_to_whole_tile_groups():
    # rows 0, 1, 3 share 9 blocks (144 positions -> 128 shared); row 2 its own; rows 4 and 5
    # share 3 blocks (48 positions: under one tile group, no sharing)
    shared = list(range(100, 109))
    tables = [shared + [1], shared + [2, 3], [50, 51, 52], shared + [4], [60, 61, 62, 9], [60, 61, 62, 10]]
    cached = [150, 170, 40, 144, 50, 49]
    sharing = find_shared_prefill_prefixes(tables, cached, BLOCK)
    assert sharing == [(0, 0), (0, 128), (2, 0), (0, 128), (4, 0), (5, 0)]
    assert prefill_positions_read_once(sharing) == 256
    # only history counts: a block still being written this step is never shared
    assert find_shared_prefill_prefixes([shared, shared], [63, 200], BLOCK) is None
    assert find_shared_prefill_prefixes([shared, shared], [64, 200], BLOCK) == [(0, 0), (0, 64)]
    assert find_shared_prefill_prefixes([shared], [144], BLOCK) is None
    assert PREFILL_SHARE_MULTIPLE % BLOCK == 0


def _shared_case(num_heads, num_kv_heads, head_dim, shared_len, members, seed=0):
    """Pools and queries for prefill segments (S0, m) whose first shared_len positions are the
    same blocks (a cached system prompt), the rest each on its own shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    shared_blocks = -(-shared_len // BLOCK)
    own = [-(-(s0 + m) // BLOCK) - shared_blocks for s0, m in members]
    num_blocks = shared_blocks + sum(own) + 2
    k = torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim, generator=g).bfloat16()
    v = torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim, generator=g).bfloat16()
    q = torch.randn(sum(m for _, m in members), num_heads, head_dim, generator=g).bfloat16()
    order = torch.randperm(num_blocks, generator=g)
    prefix, used, start, prefills, tables = order[:shared_blocks], shared_blocks, 0, [], []
    for (s0, m), n in zip(members, own):
        blocks = torch.cat([prefix, order[used : used + n]])
        used += n
        tables.append(blocks.tolist())
        slots = (blocks.unsqueeze(1) * BLOCK + torch.arange(BLOCK)).reshape(-1)[: s0 + m]
        prefills.append(PrefillSegment(start, m, s0, slots, rectangular_causal_bias(s0, m, torch.float32)))
        start += m
    sharing = find_shared_prefill_prefixes(tables, [s0 for s0, _ in members], BLOCK)
    return q, k, v, prefills, sharing


def _meta(prefills, sharing=None):
    return AttentionMetadata(None, 0, None, None, None, None, prefills, prefill_sharing=sharing)


MEMBERS = [(128, 40), (130, 17), (200, 64), (128, 64), (140, 5)]  # all past the 128 shared positions


def test_plain_torch_path_reads_the_shared_prefix_once_with_the_same_bits():
    q, k, v, prefills, sharing = _shared_case(9, 3, 64, 128, MEMBERS)
    assert sharing is not None and prefill_positions_read_once(sharing) == 4 * 128
    per_segment, once = torch.empty(q.shape), torch.empty(q.shape)
    prefill_attention(q.float(), k.float(), v.float(), _meta(prefills), 0.125, per_segment)
    prefill_attention(q.float(), k.float(), v.float(), _meta(prefills, sharing), 0.125, once)
    assert torch.equal(per_segment, once)


needs_kernels = pytest.mark.skipif(ops is None, reason=f"CPU kernels unavailable: {unavailable_reason()}")


@needs_kernels
@pytest.mark.parametrize("int8", [False, True], ids=["bf16-kv", "int8-kv"])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 2, 128)], ids=["g3-h64", "g4-h128"])
def test_kernel_reads_the_leaders_tiles_with_the_same_bits(int8, num_heads, num_kv_heads, head_dim):
    """At every level (the `amx` level's bf16 tiles included)."""
    q, k, v, prefills, sharing = _shared_case(num_heads, num_kv_heads, head_dim, 192, [(192, 30), (250, 70), (200, 3)])
    assert sharing == [(0, 0), (0, 192), (0, 192)]
    scales = (None, None)
    if int8:
        (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
        scales = (ks, vs)
    meta = _meta(prefills, sharing)
    slots, segs, shared = meta.prefill_kernel_args()
    assert shared.tolist() == [[0, 0], [0, 192], [0, 192]]
    alone, together = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    ops.paged_prefill_attention(q, k, v, slots, segs, head_dim**-0.5, alone, *scales)
    ops.paged_prefill_attention(q, k, v, slots, segs, head_dim**-0.5, together, *scales, shared)
    assert torch.isfinite(together.float()).all() and torch.equal(alone, together)


@needs_kernels
def test_kernel_refuses_a_share_that_is_not_the_leaders_or_off_the_tile_grid():
    q, k, v, prefills, sharing = _shared_case(9, 3, 64, 128, [(128, 8), (128, 8)])
    slots, segs, _ = _meta(prefills, sharing).prefill_kernel_args()
    out = torch.empty_like(q)
    for bad, match in [
        ([[0, 0], [0, 96]], "multiple of 64"),
        ([[0, 0], [0, 192]], "multiple of 64 within both histories"),  # past the member's 128 cached positions
        ([[1, 64], [0, 64]], "a leader sharing nothing itself"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            ops.paged_prefill_attention(q, k, v, slots, segs, 0.125, out, None, None, torch.tensor(bad))
    wrong = slots.clone()
    wrong[136] += 1  # the member's 0th slot no longer the leader's
    with pytest.raises(RuntimeError, match="are not segment 0's"):
        ops.paged_prefill_attention(q, k, v, wrong, segs, 0.125, out, None, None, torch.tensor([[0, 0], [0, 64]]))
