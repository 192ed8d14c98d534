"""OLMoE's whole-projection q/k norm (whole_projection_norm, qk_sum_squares) and a sparse
layer's router (moe_route) against the plain-torch paths they replace, at every level."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import cpu_ops, unavailable_reason
from kvserve.model.llama import WholeProjectionNorm

ops = cpu_ops()
pytestmark = pytest.mark.skipif(
    ops is None and unavailable_reason() is not None, reason=f"CPU kernels unavailable: {unavailable_reason()}"
)


def _route_reference(x, router, k, renormalise):
    """model/moe.py's torch route(), in float64 for the probabilities."""
    probs = torch.nn.functional.linear(x.double(), router.double()).softmax(dim=-1)
    weights, chosen = probs.topk(k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_size, kv_size", [(2048, 2048), (256, 64), (80, 40)])  # 80, 40: tails past the 32-wide loop
def test_whole_projection_norm_matches_the_torch_layer(dtype, q_size, kv_size):
    g = torch.Generator().manual_seed(q_size + kv_size)
    qkv = (torch.randn(9, q_size + 2 * kv_size, generator=g) * 3).to(dtype)
    q_w, k_w = torch.randn(q_size, generator=g).to(dtype), torch.randn(kv_size, generator=g).to(dtype)
    expected = WholeProjectionNorm(q_w, k_w, q_size, kv_size, 1e-6)(qkv)  # no ops: the torch path
    got = WholeProjectionNorm(q_w, k_w, q_size, kv_size, 1e-6, ops=ops)(qkv)
    assert got.dtype == dtype and got.shape == qkv.shape
    # fp32 statistics in another order: only the last-place rounding of 1/sqrt and of the products
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 8e-3)
    assert torch.equal(got[:, q_size + kv_size :], qkv[:, q_size + kv_size :]), "V is copied as it is"
    # a row's result is its own: alone, or among other rows
    assert torch.equal(ops.whole_projection_norm(qkv[4:5].contiguous(), q_w, k_w, q_size, kv_size,
                                                 q_size, kv_size, 1e-6), got[4:5])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_whole_norm_from_given_sums_is_the_rows_own_and_takes_the_whole_widths(dtype):
    """Tensor parallelism: a rank's partial sums (qk_sum_squares) AllReduced, then the norm over
    the whole projections' widths; with one rank's sums it is the one-pass call bit for bit."""
    g = torch.Generator().manual_seed(5)
    q_size, kv_size = 128, 64
    qkv = torch.randn(6, q_size + 2 * kv_size, generator=g).to(dtype)
    q_w, k_w = torch.randn(q_size, generator=g).to(dtype), torch.randn(kv_size, generator=g).to(dtype)
    sums = ops.qk_sum_squares(qkv, q_size, kv_size)
    q32, k32 = qkv.float()[:, :q_size], qkv.float()[:, q_size : q_size + kv_size]
    torch.testing.assert_close(sums, torch.stack([q32.pow(2).sum(-1), k32.pow(2).sum(-1)], -1), rtol=1e-5, atol=1e-5)
    own = ops.whole_projection_norm(qkv, q_w, k_w, q_size, kv_size, q_size, kv_size, 1e-6)
    assert torch.equal(ops.whole_projection_norm(qkv, q_w, k_w, q_size, kv_size, q_size, kv_size, 1e-6, sums), own)
    # as if this rank held half of each projection: the other half's sums are equal to its own
    doubled = ops.whole_projection_norm(qkv, q_w, k_w, q_size, kv_size, 2 * q_size, 2 * kv_size, 1e-6, sums * 2)
    torch.testing.assert_close(doubled.float(), own.float(), atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 8e-3)


def test_the_whole_norm_refuses_a_qkv_of_another_width():
    qkv = torch.randn(2, 100).bfloat16()
    w = torch.randn(32).bfloat16()
    with pytest.raises(RuntimeError, match="q_size"):
        ops.whole_projection_norm(qkv, w, w, 32, 32, 32, 32, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts, top_k, renormalise", [(64, 8, False), (8, 2, True), (60, 4, True)])
@pytest.mark.parametrize("d", [2048, 200])  # 200: a tail past the 32-wide loop
def test_moe_route_matches_torchs_softmax_and_top_k(dtype, experts, top_k, renormalise, d):
    g = torch.Generator().manual_seed(experts + d)
    x = torch.randn(33, d, generator=g).to(dtype)
    router = torch.randn(experts, d, generator=g) * 0.05
    weights, chosen = ops.moe_route(x, router, top_k, renormalise)
    assert weights.dtype == torch.float32 and chosen.dtype == torch.int64 and weights.shape == (33, top_k)
    want_w, want_e = _route_reference(x, router, top_k, renormalise)
    # random logits are far apart compared with fp32's rounding: the same experts, in rank order
    assert torch.equal(chosen, want_e)
    torch.testing.assert_close(weights.double(), want_w, rtol=2e-5, atol=1e-7)
    assert bool((weights[:, :-1] >= weights[:, 1:]).all()), "the largest first"
    if renormalise:
        torch.testing.assert_close(weights.sum(-1), torch.ones(33), rtol=1e-6, atol=1e-6)
    # a token's choice is its own: alone or among 33, and wherever the threads cut the experts
    for t in (0, 17, 32):
        w1, e1 = ops.moe_route(x[t : t + 1].contiguous(), router, top_k, renormalise)
        assert torch.equal(e1, chosen[t : t + 1]) and torch.equal(w1, weights[t : t + 1])


def test_moe_route_takes_the_lower_expert_on_a_tie():
    router = torch.zeros(6, 64)
    router[[1, 4]] = 1.0  # experts 1 and 4 score the same; the rest 0
    router[2] = 0.5
    weights, chosen = ops.moe_route(torch.ones(1, 64), router, 3, False)
    assert chosen.tolist() == [[1, 4, 2]]
    assert weights[0, 0] == weights[0, 1]


def test_moe_route_refuses_what_it_cannot_route():
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="top_k"):
        ops.moe_route(x, torch.randn(4, 64), 5, False)
    with pytest.raises(RuntimeError, match="router"):
        ops.moe_route(x, torch.randn(4, 32), 2, False)
    with pytest.raises(RuntimeError, match="router"):
        ops.moe_route(x, torch.randn(4, 64).bfloat16(), 2, False)
