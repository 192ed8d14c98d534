"""The kernels' int8 KV paths (rope_and_cache_int8, decode and prefill attention over int8
pools, the fused decode step) agree with the plain-torch int8 reference (kvserve/attention/reference.py)."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.kv_pool import quantize_kv
from kvserve.attention.reference import decode_attention, prefill_attention
from kvserve.kernels import cpu_ops, unavailable_reason
from kvserve.kernels.support import KernelSupport
from kvserve.arch import ModelArchitecture
from tests.kernels.test_bindings import _tiny_model
from tests.kernels.test_kernels import _decode_case, _prefill_case, decode_steps

ops = cpu_ops()
pytestmark = pytest.mark.skipif(
    ops is None and unavailable_reason() is not None, reason=f"CPU kernels unavailable: {unavailable_reason()}"
)


def _quantized(k: torch.Tensor, v: torch.Tensor):
    kq, ks = quantize_kv(k)
    vq, vs = quantize_kv(v)
    return kq, vq, ks, vs


def test_quantize_kv_is_symmetric_per_row_with_zero_rows_kept_at_zero():
    x = torch.tensor([[[1.0, -2.0, 0.5, 127.0]], [[0.0, 0.0, 0.0, 0.0]], [[-3.0, 1.5, 0.0, 0.0]]])
    q, s = quantize_kv(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (3, 1)
    assert q[0, 0].tolist() == [1, -2, 0, 127] and s[0, 0] == 1.0  # 0.5 rounds half to even
    assert q[1].abs().sum() == 0 and s[1, 0] == 0
    assert q[2, 0].tolist() == [-127, 64, 0, 0]  # 63.5 rounds half to even
    assert (q.float() * s.unsqueeze(-1) - x).abs().max() <= s.max() / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_int8_stores_what_quantize_kv_makes_of_the_float_cache(dtype):
    """The same rule in C++ and torch: the int8 kernel's bytes and scales are quantize_kv of the
    K/V the float kernel writes (K after RoPE), bit for bit; Q is the float kernel's."""
    g = torch.Generator().manual_seed(0)
    T, nq, nkv, hd, blocks, bs = 7, 4, 2, 64, 4, 4
    qkv = (torch.randn(T, (nq + 2 * nkv) * hd, generator=g) * 3).to(dtype)
    qkv[2, nq * hd : (nq + 1) * hd] = 0  # an all-zero K row: scale 0
    positions = torch.tensor([0, 1, 2, 3, 9, 10, 40])
    slots = torch.randperm(blocks * bs, generator=g)[:T]
    angles = torch.arange(64).float()[:, None] * torch.rand(hd // 2, generator=g)[None]
    cos, sin = angles.cos(), angles.sin()
    k_f, v_f = torch.zeros(blocks, bs, nkv, hd, dtype=dtype), torch.zeros(blocks, bs, nkv, hd, dtype=dtype)
    q_f = ops.rope_and_cache(qkv, positions, cos, sin, k_f, v_f, slots, nq, nkv, hd)
    k8, v8 = torch.zeros(blocks, bs, nkv, hd, dtype=torch.int8), torch.zeros(blocks, bs, nkv, hd, dtype=torch.int8)
    ks, vs = torch.full((blocks, bs, nkv), -1.0), torch.full((blocks, bs, nkv), -1.0)
    q8 = ops.rope_and_cache_int8(qkv, positions, cos, sin, k8, v8, ks, vs, slots, nq, nkv, hd)
    assert torch.equal(q8, q_f)
    for pool, scales, float_pool in ((k8, ks, k_f), (v8, vs, v_f)):
        want_q, want_s = quantize_kv(float_pool.view(-1, nkv, hd)[slots])
        assert torch.equal(pool.view(-1, nkv, hd)[slots], want_q)
        assert torch.equal(scales.view(-1, nkv)[slots], want_s)
    assert ks.view(-1, nkv)[slots[2], 0] == 0 and (k8.view(-1, nkv, hd)[slots[2], 0] == 0).all()
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert (ks.view(-1, nkv)[untouched] == -1).all() and (k8.view(-1, nkv, hd)[untouched] == 0).all()


DECODE_SHAPES = [
    (9, 3, 64, [1, 17, 200, 33], 16),  # SmolLM2's shape; partial and whole blocks
    (4, 4, 32, [5, 16, 48], 4),  # g = 1, one chunk, blocks of 4 slots
    (8, 2, 128, [100], 32),  # four chunks
    (16, 1, 64, [40], 16),  # g = 16
    (14, 2, 64, [90, 7], 16),  # g = 7: V-pass groups of 4 + 3
    (5, 1, 96, [33, 64], 8),  # three chunks
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, lens, block_size", DECODE_SHAPES)
def test_int8_decode_attention_matches_the_torch_int8_reference(dtype, num_heads, num_kv_heads, head_dim, lens, block_size):
    q, k, v, meta = _decode_case(dtype, len(lens), num_heads, num_kv_heads, head_dim, lens, block_size=block_size)
    kq, vq, ks, vs = _quantized(k, v)
    scale = head_dim**-0.5
    expected = decode_attention(q.float(), kq, vq, meta, scale, ks, vs)
    # int8 pools never take AMX tiles: the same vector path at every AVX512-BF16 level
    got = ops.paged_decode_attention(q, kq, vq, meta.decode_block_tables, meta.decode_context_lens, scale, ks, vs)
    assert got.dtype == dtype
    # K/V are exact (widened int8 times fp32 scales), probabilities stay fp32: only the fp32
    # summation order differs, and a bf16 output's one rounding
    torch.testing.assert_close(got.float(), expected, atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 2**-8)
    # against the unquantized cache: int8's error, ~1/254 of each row's largest value
    torch.testing.assert_close(got.float(), decode_attention(q.float(), k.float(), v.float(), meta, scale), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_decode_attention_gives_a_query_the_same_bits_alone_and_in_a_batch(dtype):
    lens = [1, 17, 200, 33, 64, 5, 129]
    q, k, v, meta = _decode_case(dtype, len(lens), 9, 3, 64, lens)
    kq, vq, ks, vs = _quantized(k, v)
    tables, ctx = meta.decode_block_tables, meta.decode_context_lens
    together = ops.paged_decode_attention(q, kq, vq, tables, ctx, 0.125, ks, vs)
    for i in range(len(lens)):
        alone = ops.paged_decode_attention(q[i : i + 1], kq, vq, tables[i : i + 1], ctx[i : i + 1], 0.125, ks, vs)
        assert torch.equal(alone[0], together[i]), i
    # and in another order, with a neighbour of its own length
    order = [6, 0, 3, 3, 1]
    again = ops.paged_decode_attention(q[order], kq, vq, tables[order], ctx[order], 0.125, ks, vs)
    assert all(torch.equal(again[j], together[i]) for j, i in enumerate(order))


def test_int8_decode_attention_refuses_int8_pools_without_scales():
    q, k, v, meta = _decode_case(torch.bfloat16, 1, 4, 2, 64, [5])
    kq, vq, ks, vs = _quantized(k, v)
    with pytest.raises(RuntimeError, match="int8 pools need"):
        ops.paged_decode_attention(q, kq, vq, meta.decode_block_tables, meta.decode_context_lens, 0.125)
    with pytest.raises(RuntimeError, match="scales are for int8 pools"):
        ops.paged_decode_attention(q, k, v, meta.decode_block_tables, meta.decode_context_lens, 0.125, ks, vs)


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size, segments",
    [
        (9, 3, 64, 16, [(0, 40)] * 3),  # SmolLM2's shape, equal prompts
        (9, 3, 64, 16, [(0, 17), (33, 7), (100, 1), (5, 200)]),  # partial blocks, cached history
        (4, 4, 32, 4, [(0, 5), (20, 50)]),  # g = 1, one chunk, blocks of 4 slots
        (8, 2, 128, 32, [(0, 77), (64, 64)]),  # four chunks
    ],
)
def test_int8_prefill_attention_matches_the_torch_int8_reference(num_heads, num_kv_heads, head_dim, block_size, segments):
    q, k, v, meta = _prefill_case(segments, num_heads, num_kv_heads, head_dim, block_size)
    kq, vq, ks, vs = _quantized(k, v)
    scale = head_dim**-0.5
    expected = torch.empty(q.shape)
    prefill_attention(q.float(), kq, vq, meta, scale, expected, ks, vs)
    got = torch.full_like(q, float("nan"))
    slots, segs, _ = meta.prefill_kernel_args()
    ops.paged_prefill_attention(q, kq, vq, slots, segs, scale, got, ks, vs)
    # K/V exact in the bf16 tiles; the probabilities (times the V scale) and the output are
    # each rounded to bf16 once, as with bf16 pools
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
    unquantized = torch.empty(q.shape)
    prefill_attention(q.float(), k.float(), v.float(), meta, scale, unquantized)
    torch.testing.assert_close(got.float(), unquantized, atol=6e-2, rtol=6e-2)


def test_decode_layers_over_int8_pools_is_the_bindings_layer_by_layer_bitwise():
    fused, stepwise = _tiny_model(int8=True), _tiny_model(int8=True)
    assert len(fused.k_scales) == 2 and fused.k_scales[0].dtype == torch.float32
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    lens = torch.tensor([5, 17, 30], dtype=torch.int32)
    tables = torch.arange(6, dtype=torch.int32).view(3, 2)
    positions = (lens - 1).long()
    slots = tables[torch.arange(3), positions // 16].long() * 16 + positions % 16
    m, x, residual = stepwise, h.clone(), None
    for layer, k, v, ks, vs in zip(m.layers, m.k_pools, m.v_pools, m.k_scales, m.v_scales):
        y = ops.rms_norm(x, layer.input_norm, m.eps, residual)
        residual = x if residual is None else residual
        q = ops.rope_and_cache_int8(ops.linear(y, layer.qkv), positions, m.cos_half, m.sin_half, k, v, ks, vs, slots,
                                    m.num_heads, m.num_kv_heads, m.head_dim)  # fmt: skip
        attn = ops.paged_decode_attention(q, k, v, tables, lens, m.scale, ks, vs)
        y = ops.rms_norm(ops.linear(attn.view(3, -1), layer.o), layer.post_attention_norm, m.eps, residual)
        x = ops.linear(ops.linear_silu_mul(y, layer.gate_up), layer.down)
    expected = residual.add_(x)
    assert torch.equal(ops.decode_layers(fused, h.clone(), positions, [slots], [tables], lens), expected)
    for a, b in zip(fused.k_pools + fused.v_pools + fused.k_scales + fused.v_scales,
                    stepwise.k_pools + stepwise.v_pools + stepwise.k_scales + stepwise.v_scales):  # fmt: skip
        assert torch.equal(a, b)


def test_decode_layers_refuses_int8_scales_off_the_layer_count():
    m = _tiny_model(int8=True)
    short = ops.DecodeModel(layers=m.layers, k_pools=m.k_pools, v_pools=m.v_pools, cos_half=m.cos_half,
                            sin_half=m.sin_half, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                            head_dim=m.head_dim, eps=m.eps, scale=m.scale, k_scales=m.k_scales[:1],
                            v_scales=m.v_scales)  # fmt: skip
    lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="scale pool per layer"):
        ops.decode_layers(short, torch.zeros(1, 64, dtype=torch.bfloat16), (lens - 1).long(), [(lens - 1).long()],
                          [torch.zeros(1, 1, dtype=torch.int32)], lens)  # fmt: skip


def _arch(**changes) -> ModelArchitecture:
    import dataclasses

    base = ModelArchitecture("llama", 320, 256, 512, 2, 4, 2, 64, 1e-6, 1e4, 128, False)
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_support_runs_the_int8_kernels_and_says_so(dtype):
    k = KernelSupport.decide(_arch(), dtype, torch.device("cpu"), ops, kv_dtype=torch.int8)
    assert k.decode_attention.enabled and "int8" in k.decode_attention.reason and "AMX" not in k.decode_attention.reason
    assert k.rope_and_cache.enabled and "int8" in k.rope_and_cache.reason
    assert k.prefill_attention.enabled == (dtype == torch.bfloat16) and k.fused_decode.enabled == (dtype == torch.bfloat16)


def test_kernel_support_turns_the_kv_kernels_off_for_a_pool_dtype_they_cannot_read():
    k = KernelSupport.decide(_arch(), torch.bfloat16, torch.device("cpu"), ops, kv_dtype=torch.float16)
    for name in ("decode_attention", "prefill_attention", "rope_and_cache"):
        choice = getattr(k, name)
        assert not choice.enabled and "KV pools of float16" in choice.reason, name
    assert not k.fused_decode.enabled and k.op("decode_attention") is None and k.rms_norm.enabled
    # head_dim 16 suits fp32 pools (multiples of 16) but int8 ones are read in chunks of 32
    small = _arch(head_dim=16, hidden_size=64)
    assert KernelSupport.decide(small, torch.float32, torch.device("cpu"), ops).decode_attention.enabled
    off = KernelSupport.decide(small, torch.float32, torch.device("cpu"), ops, kv_dtype=torch.int8).decode_attention
    assert not off.enabled and "head_dim 16 is not a multiple of 32" in off.reason



def test_fused_decode_over_int8_pools_equals_the_layer_by_layer_path(tiny_model_dirs):
    """The engine's fused step (decode_model() carrying the scale pools) and its Python layers
    read and write the int8 cache identically."""
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import LLMEngine

    def run(fused: bool):
        engine = LLMEngine(EngineConfig(model=tiny_model_dirs["llama-hd64"], dtype="bfloat16", device="cpu",
                                        kv_cache_memory="1MiB", kv_cache_dtype="int8"))  # fmt: skip
        engine.model.fused_decode = fused
        assert (engine.model.fused_decode_rows() > 0) == fused
        out = decode_steps(engine, ["The quick brown fox", "hello world, once", "0123"])
        return out, engine.runner.kv_pool.clone(), engine.runner.kv_scales.clone()

    fused, stepwise = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(fused, stepwise))
