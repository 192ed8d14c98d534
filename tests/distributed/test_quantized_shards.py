"""Quantized weights cut for tensor parallelism in their packed layout (quant_formats.slice_rows
/ slice_cols): the same values as cutting the dequantized weight, for every format's layout,
and a cut inside a packed group or block refused."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.quant_formats import (
    QuantizedWeight, quantize_int4_blocks, quantize_int8_per_channel, quantize_q8_blocks, slice_cols, slice_rows,
)  # fmt: skip

W = torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
FORMATS = {
    "q8-blocks": lambda w: quantize_q8_blocks(w, "test"),
    "int8-per-channel": quantize_int8_per_channel,  # one scale per row: kept whole by a column cut
    "int4-min": quantize_int4_blocks,
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuts_are_the_dequantized_weights_cuts(fmt):
    w = FORMATS[fmt](W)
    full = w.dequantize()
    for lo, hi in [(0, 32), (32, 96), (16, 48)]:
        assert torch.equal(slice_rows(w, lo, hi).dequantize(), full[lo:hi])
    for lo, hi in [(0, 128), (128, 256), (64, 96)]:
        cut = slice_cols(w, lo, hi)
        assert cut.shape == (96, hi - lo) and torch.equal(cut.dequantize(), full[:, lo:hi])


def test_rows_across_the_segments_of_a_fused_weight():
    a, b = quantize_q8_blocks(W[:48], "a"), quantize_int4_blocks(W[48:])
    fused = QuantizedWeight.cat([a, b])
    cut = slice_rows(fused, 32, 80)  # 16 rows of the first segment, 32 of the second
    assert [s.rows for s in cut.segments] == [16, 32]
    assert torch.equal(cut.dequantize(), fused.dequantize()[32:80])


def test_a_cut_inside_a_packed_group_or_block_is_refused():
    w = quantize_q8_blocks(W, "test")
    with pytest.raises(ValueError, match="groups of 16"):
        slice_rows(w, 8, 40)
    with pytest.raises(ValueError, match="blocks of 32"):
        slice_cols(w, 0, 48)
