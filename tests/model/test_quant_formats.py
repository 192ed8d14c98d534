"""Each GGUF type's repacking against the `gguf` package's own dequantization, and the
quantizers of float weights (--quantization int8 / int4)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvserve.model import quant_formats as qf
from tests.support.kquants import random_k_blocks


def _w(n=64, k=512, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_exact_types_dequantize_bit_for_bit_as_gguf(type_name):
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = gguf.quants.quantize(_w().numpy(), qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).float()
    assert torch.equal(qf.from_gguf(type_name, raw, 64, 512).dequantize(), expected)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("full_range", [False, True])
def test_k_quants_run_in_their_own_bytes_bit_for_bit_as_gguf(type_name, full_range):
    raw = random_k_blocks(type_name, 32, 512, full_range=full_range)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])).float()
    got = qf.from_gguf(type_name, raw, 32, 512)
    assert got.segments[0].kind == type_name.lower() and got.segments[0].source == f"{type_name} (native)"
    assert torch.equal(got.dequantize(), expected)
    # GGUF's bits per weight plus the layout's: Q4_K 4.5 → 4.625 (sc, mn a byte each), Q6_K 6.5625 as stored
    assert got.nbytes * 8 / (32 * 512) == {"Q4_K": 4.625, "Q6_K": 6.5625}[type_name]


def test_q5_k_repacks_with_exact_codes():
    raw = random_k_blocks("Q5_K", 32, 512)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_K)).float()
    got = qf.from_gguf("Q5_K", raw, 32, 512)
    # the codes are exact; only each sub-block's d·sc and dmin·m are rounded to fp16
    err = (got.dequantize() - expected).abs()
    assert err.max() <= 2**-10 * expected.abs().max()
    assert got.segments[0].kind == "q8_min"


def test_k_quant_shards_cut_on_super_blocks():
    w = qf.from_gguf("Q6_K", random_k_blocks("Q6_K", 32, 768), 32, 768)
    part = qf.slice_cols(w, 256, 768)
    assert torch.equal(part.dequantize(), w.dequantize()[:, 256:])
    assert torch.equal(qf.slice_rows(w, 16, 32).dequantize(), w.dequantize()[16:])
    with pytest.raises(ValueError, match="super-blocks of 256"):
        qf.slice_cols(w, 0, 384)


def test_int8_per_channel_and_int4_quantizers_round_to_nearest():
    w = _w(48, 256, seed=1)
    int8 = qf.quantize_int8_per_channel(w)
    assert int8.segments[0].scales.shape == (3, 1, 16)  # one scale per output channel
    d = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((int8.dequantize() - w).abs() <= d / 2 + 1e-6).all()
    int4 = qf.quantize_int4_blocks(w)
    blocks = w.view(48, 8, 32)
    step = (blocks.amax(2, keepdim=True) - blocks.amin(2, keepdim=True)) / 15
    assert ((int4.dequantize().view(48, 8, 32) - blocks).abs() <= step / 2 * 1.01 + 1e-6).all()
    assert int4.nbytes == 48 * 256 // 2 + 2 * 48 * 8 * 2  # 4 bits + fp16 scale and minimum per 32


def test_packable_shapes():
    assert qf.packable(16, 32) and not qf.packable(24, 32) and not qf.packable(16, 48)
