"""quant_linear (kernels/quant_linear.cpp) against the plain-torch reference: dequantize, then matmul.

Two references: the exact one emulates the kernel's int8 compute format (x quantized per
row and block of 32, per super-block of 256 against the K-quants, the same rule) in float64, so only rounding order separates the two;
the float one is x·Wᵀ with W dequantized, which the int8 activations approximate. And the
batch-invariance rule: a row's bits never depend on the rows beside it.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from kvserve.kernels import cpu_ops, unavailable_reason
from kvserve.model import quant_formats as qf
from kvserve.model.linear_methods.cpu_quant import kernel_segments
from tests.support.kernel_cases import int8_reference, quantized_weight
from tests.support.kquants import random_k_blocks

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"CPU kernels unavailable: {unavailable_reason()}")


KINDS = ["q8", "int8-channel", "q4", "q4_min", "q8_min"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 70])
def test_matches_reference(kind, rows):
    w = quantized_weight(kind, 96, 576)
    x = (torch.randn(rows, 576, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    y = ops.quant_linear(x, kernel_segments(ops, w)).double()
    exact = int8_reference(x, w)
    # the kernel's only differences from `exact`: fp32 sums and the bf16 result's rounding
    torch.testing.assert_close(y, exact, rtol=2 ** -7, atol=1e-3 * exact.abs().max().item())
    float_ref = x.double() @ w.dequantize(torch.float64).T
    rel = (y - float_ref).norm() / float_ref.norm()
    assert rel < 0.02, f"int8 activations cost {rel:.4f} relative error"


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_does_not_depend_on_the_other_rows(kind):
    w = quantized_weight(kind, 64, 320)
    segs = kernel_segments(ops, w)
    x = torch.randn(130, 320, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    alone = torch.cat([ops.quant_linear(x[i : i + 1], segs) for i in range(x.shape[0])])
    for rows in (2, 7, 8, 9, 17, 64, 65, 130):
        together = torch.cat([ops.quant_linear(x[i : i + rows], segs) for i in range(0, x.shape[0], rows)])
        assert torch.equal(together, alone), f"{rows} rows per call changed some row's bits"


def test_mixed_segments_bias_and_fp32_input():
    a, b = quantized_weight("q4", 32, 256, seed=3), quantized_weight("q8", 48, 256, seed=4)
    both = qf.QuantizedWeight.cat([a, b])
    assert [s.kind for s in both.segments] == ["q4", "q8"]
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(80, generator=g).to(torch.bfloat16)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    y = ops.quant_linear(x, kernel_segments(ops, both), bias)
    parts = torch.cat([ops.quant_linear(x, kernel_segments(ops, a)), ops.quant_linear(x, kernel_segments(ops, b))], dim=1)
    torch.testing.assert_close(y.float(), parts.float() + bias.float(), rtol=2 ** -7, atol=2e-2)
    y32 = ops.quant_linear(x.float(), kernel_segments(ops, both))
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32, int8_reference(x, both).float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 4, 8, 50])  # 50: past avx2's 8-bit panel, which a row alone never takes
@pytest.mark.parametrize("float_x, float_out", [(False, False), (True, True)])
def test_each_row_on_its_own_weight_is_that_row_alone_bitwise(rows, float_x, float_out):
    """quant_linear_rows (a token's k routed experts' down projections): row r against W_r equals
    quant_linear(x[r:r+1], W_r), every format mixed in one call, a weight of two segments too."""
    k, n = 256, 48
    kinds = [KINDS[r % len(KINDS)] for r in range(rows)]
    weights = [quantized_weight(kind, n, k, seed=10 + r) for r, kind in enumerate(kinds)]
    weights[0] = qf.QuantizedWeight.cat([quantized_weight("q4", 32, k, seed=3), quantized_weight("q8", 16, k, seed=4)])
    if rows > 1:
        weights[1] = quantized_weight("Q4_K", n, k, seed=5)
    per_row = [kernel_segments(ops, w) for w in weights]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
    x = x if float_x else x.to(torch.bfloat16)
    y = ops.quant_linear_rows(x, per_row, float_out)
    assert y.shape == (rows, n) and y.dtype == (torch.float32 if float_out else torch.bfloat16)
    for r in range(rows):
        assert torch.equal(y[r : r + 1], ops.quant_linear(x[r : r + 1], per_row[r], None, float_out)), r


def test_rows_on_their_own_weights_refuse_mismatched_shapes():
    a, b = kernel_segments(ops, quantized_weight("q4", 48, 64)), kernel_segments(ops, quantized_weight("q4", 32, 64))
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="every row's weight needs 48 outputs, one has 32"):
        ops.quant_linear_rows(x, [a, b])
    with pytest.raises(RuntimeError, match="1 weights for 2 rows"):
        ops.quant_linear_rows(x, [a])


def test_stacked_weights_keep_their_segments_without_copying():
    a, b = quantized_weight("q4_min", 32, 64, seed=5), quantized_weight("q4_min", 16, 64, seed=6)
    both = qf.QuantizedWeight.cat([a, b])
    assert both.shape == (48, 64) and both.segments[0].codes is a.segments[0].codes
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


@pytest.mark.parametrize("kind", KINDS)
def test_embedding_rows_are_the_dequantized_rows(kind):
    w = quantized_weight(kind, 64, 96)
    ids = torch.tensor([0, 17, 63, 17])
    rows = ops.quant_embedding(ids, kernel_segments(ops, w), 96, torch.float32)
    assert torch.equal(rows, w.dequantize()[ids])


# ---- the K-quants, in GGUF's own bytes (K a multiple of 256) ----------------------------------

K_QUANTS = ["Q4_K", "Q6_K", "Q6_K-full-range"]


@pytest.mark.parametrize("name", K_QUANTS)
@pytest.mark.parametrize("rows", [1, 3, 9, 70])
def test_k_quants_match_reference(name, rows):
    w = quantized_weight(name, 48, 768)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = ops.quant_linear(x, kernel_segments(ops, w), None, True).double()
    exact = int8_reference(x, w)
    # the integer sums are exact; fp32 scaling and accumulation only
    torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


def test_q6_k_extremes_stay_exact_in_the_integer_sums():
    """The largest integer sum the Q6_K path forms: codes 0 (q = -32) under scales of -128, every
    activation at ±127: per half 16·32·127 = 65,024, scaled by -128, two halves: 16,646,144 a
    block, and the super-block's 8 blocks add up in int32 to 133,169,152 (< 2^31)."""
    raw = random_k_blocks("Q6_K", 16, 256, full_range=True)
    raw[:, :192] = 0  # every code 0: q = -32
    raw[:, 192:208] = 0x80  # every scale -128
    w = qf.from_gguf("Q6_K", raw, 16, 256)
    x = torch.full((2, 256), 3.0)
    x[1, 1::2] = -3.0
    y = ops.quant_linear(x, kernel_segments(ops, w), None, True).double()
    torch.testing.assert_close(y, int8_reference(x, w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", K_QUANTS)
def test_k_quants_rows_do_not_depend_on_the_other_rows(name):
    segs = kernel_segments(ops, quantized_weight(name, 32, 512))
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    alone = torch.cat([ops.quant_linear(x[i : i + 1], segs) for i in range(x.shape[0])])
    for rows in (3, 9, 64, 70):
        together = torch.cat([ops.quant_linear(x[i : i + rows], segs) for i in range(0, x.shape[0], rows)])
        assert torch.equal(together, alone), f"{rows} rows per call changed some row's bits"


@pytest.mark.parametrize("name", K_QUANTS)
def test_k_quant_embedding_rows_are_gguf_s_own(name):
    type_name = name.split("-")[0]
    raw = random_k_blocks(type_name, 32, 512, full_range=name.endswith("full-range"))
    w = qf.from_gguf(type_name, raw, 32, 512)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])).float()
    ids = torch.tensor([0, 31, 7, 7])
    assert torch.equal(ops.quant_embedding(ids, kernel_segments(ops, w), 512, torch.float32), expected[ids])


def test_a_k_quant_segment_fused_with_a_plain_one_keeps_its_own_bits():
    """The K-quants read x quantized per super-block, the plain formats per block: a call that
    holds both quantizes it both ways, so fusing (a Q4_K_M file's Q4_K q/k beside a Q8_0 v)
    changes no segment's bits."""
    parts = [quantized_weight("Q4_K", 32, 512, seed=5), quantized_weight("q8", 16, 512, seed=6),
             quantized_weight("Q6_K", 16, 512, seed=7), quantized_weight("q4", 48, 512, seed=8)]  # fmt: skip
    fused = kernel_segments(ops, qf.QuantizedWeight.cat(parts))
    for rows in (1, 9, 70):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        alone = torch.cat([ops.quant_linear(x, kernel_segments(ops, p), None, True) for p in parts], dim=1)
        assert torch.equal(ops.quant_linear(x, fused, None, True), alone), f"{rows} rows"


def test_k_quants_refuse_depths_off_their_super_blocks():
    segs = kernel_segments(ops, quantized_weight("Q4_K", 16, 512))
    with pytest.raises(RuntimeError, match="codes must be"):
        ops.quant_linear(torch.zeros(1, 256, dtype=torch.bfloat16), segs)


def test_shapes_off_the_grid_are_refused():
    w = quantized_weight("q8", 32, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.quant_linear(torch.zeros(1, 48, dtype=torch.bfloat16), kernel_segments(ops, w))
    with pytest.raises(RuntimeError, match="codes must be"):
        ops.quant_linear(torch.zeros(1, 96, dtype=torch.bfloat16), kernel_segments(ops, w))
