"""Each GGUF type's repacking against the `gguf` package's own dequantization, and the
quantizers of float weights (--quantization int8 / int4)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvserve.model import quant_formats as qf


def _w(n=64, k=512, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_exact_types_dequantize_bit_for_bit_as_gguf(type_name):
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = gguf.quants.quantize(_w().numpy(), qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).float()
    assert torch.equal(qf.from_gguf(type_name, raw, 64, 512).dequantize(), expected)


def _random_k_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random K-quant super-blocks with realistic fp16 scales (gguf-py cannot quantize K-quants)."""
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    def f16(value):
        return np.frombuffer(np.full(n * k // 256, value, np.float16).tobytes(), np.uint8).reshape(n, k // 256, 2)
    if type_name == "Q6_K":
        raw[..., -2:] = f16(0.001)
        # neighbouring 16-sub-blocks of real tensors have similar scales: int8 in [20, 40]
        raw[..., 192:208] = rng.integers(20, 40, size=(n, k // 256, 16), dtype=np.uint8)
    else:
        raw[..., 0:2], raw[..., 2:4] = f16(0.001), f16(0.0005)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
def test_k_quants_repack_with_exact_codes(type_name):
    raw = _random_k_blocks(type_name, 32, 512)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])).float()
    got = qf.from_gguf(type_name, raw, 32, 512)
    # the codes are exact; only each sub-block's d·sc and dmin·m are rounded to fp16
    err = (got.dequantize() - expected).abs()
    assert err.max() <= 2**-10 * expected.abs().max()
    assert got.segments[0].kind == {"Q4_K": "q4_min", "Q5_K": "q8_min"}[type_name]


def test_q6_k_requantizes_within_an_eighth_of_its_step():
    raw = _random_k_blocks("Q6_K", 32, 512)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K)).float()
    got = qf.from_gguf("Q6_K", raw, 32, 512).dequantize()
    step = 0.001 * 40  # the largest sub-block step d·sc of the fixture
    assert (got - expected).abs().max() <= step / 8 + 1e-6


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
