"""--deterministic's attention: every row of a step, decode or prompt, through the decode
kernel (AttentionMetadata.row_tables). A query's output bits then do not depend on how many
rows are in the call (1 to 1,024), on the other requests beside it, or on how its prompt's
positions were split into chunks (S0, m). Without the flag a prompt row computed by the
prefill kernel differs from the same position decoded, which is what the flag removes."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.paged import paged_attention
from kvserve.kernels import cpu_ops, unavailable_reason

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"CPU kernels: {unavailable_reason()}")

H, NKV, D, BS = 9, 3, 64, 16  # SmolLM2's attention shape
SCALE = D**-0.5


@pytest.fixture(scope="module")
def pools():
    g = torch.Generator().manual_seed(0)
    blocks = 160
    k = torch.randn(blocks, BS, NKV, D, generator=g).bfloat16()
    v = torch.randn(blocks, BS, NKV, D, generator=g).bfloat16()
    tables = [torch.randperm(blocks, generator=g)[:64].tolist() for _ in range(3)]  # three requests, 1,024 positions each
    q = {r: torch.randn(1024, H, D, generator=g).bfloat16() for r in range(3)}  # a query for every position
    return k, v, tables, q


def _rows(pools, rows: list[tuple[int, int]]) -> torch.Tensor:
    """(request, position) rows in one call, the way the runner lays out a deterministic step."""
    k, v, tables, q = pools
    width = max(-(-(p + 1) // BS) for _, p in rows)
    t = torch.tensor([tables[r][:width] for r, _ in rows], dtype=torch.int32)
    lens = torch.tensor([p + 1 for _, p in rows], dtype=torch.int32)
    qs = torch.stack([q[r][p] for r, p in rows])
    meta = AttentionMetadata(None, 0, None, None, None, None, prefills=[object()], row_tables=(t, lens))
    return paged_attention(qs, k, v, meta, SCALE, decode_ops=ops, prefill_ops=ops)


def test_a_row_has_the_same_bits_in_any_call(pools):
    alone = {(r, p): _rows(pools, [(r, p)])[0] for r in range(3) for p in (0, 15, 16, 200, 777, 1023)}
    # a prompt chunk (S0, m) of request 0 beside another request's decode and chunk, for several splits
    for s0, m in ((0, 1024), (15, 2), (16, 300), (700, 324), (1023, 1)):
        rows = [(1, 777)] + [(0, p) for p in range(s0, s0 + m)] + [(2, p) for p in range(0, 17)]
        out = _rows(pools, rows)
        for i, key in enumerate(rows):
            if key in alone:
                assert torch.equal(out[i], alone[key]), (s0, m, key)
    # the biggest call: 1,024 rows of one request
    full = _rows(pools, [(0, p) for p in range(1024)])
    for p in (0, 15, 16, 200, 777, 1023):
        assert torch.equal(full[p], alone[(0, p)])


def test_without_it_a_prompt_row_differs_from_the_same_position_decoded(pools):
    """What the flag is for: the prefill kernel's tiles sum in another order than the decode kernel."""
    k, v, tables, q = pools
    slots = torch.tensor([tables[0][p // BS] * BS + p % BS for p in range(256)], dtype=torch.long)
    segments = torch.tensor([[0, 256, 0, 0]], dtype=torch.long)
    prefill = torch.empty(256, H, D, dtype=torch.bfloat16)
    ops.paged_prefill_attention(q[0][:256].contiguous(), k, v, slots, segments, SCALE, prefill)
    decoded = _rows(pools, [(0, p) for p in range(256)])
    assert not torch.equal(prefill, decoded)
    torch.testing.assert_close(prefill.float(), decoded.float(), atol=2e-2, rtol=2e-2)  # the same attention, other roundings
