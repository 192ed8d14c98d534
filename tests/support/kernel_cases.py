"""Kernel test cases shared by the torch-bound kernel tests (tests/kernels/test_*.py) and the
emulated core's cases (tests/kernels/core_fixtures.py): the same weights and pools for both."""

from __future__ import annotations

import gguf
import torch

from kvserve.attention.metadata import PrefillSegment, rectangular_causal_bias
from kvserve.kernels import layouts
from kvserve.model import quant_formats as qf
from tests.support.kquants import random_k_blocks


def quantized_weight(kind: str, n: int, k: int, seed: int = 0) -> qf.QuantizedWeight:
    """A random weight of `kind` (test_quant_linear.py's KINDS and K_QUANTS): kvserve's
    quantizers, GGUF's for Q4_0 / Q5_1, and random K-quant super-blocks in GGUF's own bytes."""
    if kind in ("Q4_K", "Q6_K", "Q6_K-full-range"):
        type_name = kind.split("-")[0]
        return qf.from_gguf(type_name, random_k_blocks(type_name, n, k, seed, full_range=kind.endswith("full-range")), n, k)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if kind == "int8-channel":
        return qf.quantize_int8_per_channel(w)
    if kind == "q8":
        return qf.quantize_q8_blocks(w, "test")
    if kind == "q4_min":
        return qf.quantize_int4_blocks(w)
    qtype = {"q4": "Q4_0", "q8_min": "Q5_1"}[kind]
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    return qf.from_gguf(qtype, raw, n, k)


def _quantized_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x as the kernel's int8 codes times their scale, one scale per row and `block` inputs."""
    m, k = x.shape
    blocks = x.float().view(m, k // block, block)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    # 127 / amax as one IEEE division, as the kernel computes it (torch's scalar / tensor is
    # reciprocal(tensor) · scalar, which can round differently)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv)  # round half to even, as the kernel's conversion
    return (q * (amax / 127)).view(m, k).double()


def int8_reference(x: torch.Tensor, w: qf.QuantizedWeight) -> torch.Tensor:
    """quant_linear's compute format in float64, segment by segment: x quantized per row and
    block of 32 against the plain formats (llama.cpp's Q8_0 activations), per super-block of
    256 against the K-quants (its Q8_K), so only rounding order separates it from the kernel."""
    outs = []
    for seg in w.segments:
        xq = _quantized_activations(x, layouts.SUPER if seg.k_quant else layouts.BLOCK)
        outs.append(xq @ qf.dequantize_segment(seg).double().T)
    return torch.cat(outs, dim=1)


def prefill_case(segments, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """Random pools and queries for prefill segments given as (S0, m), each on its own shuffled
    blocks, laid out in the flat batch one after another."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(s0 + m) // block_size) for s0, m in segments) + 3
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).bfloat16()
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).bfloat16()
    q = torch.randn(sum(m for _, m in segments), num_heads, head_dim, generator=g).bfloat16()
    order, used, start, prefills = torch.randperm(num_blocks, generator=g), 0, 0, []
    for s0, m in segments:
        n = -(-(s0 + m) // block_size)
        blocks = order[used : used + n]
        used += n
        slots = (blocks.unsqueeze(1) * block_size + torch.arange(block_size)).reshape(-1)[: s0 + m]
        prefills.append(PrefillSegment(start, m, s0, slots, rectangular_causal_bias(s0, m, torch.float32) if s0 else None))
        start += m
    return q, k, v, prefills
