"""The compiled module binds what kvserve/kernels/api.py declares, exports its limits, and
dispatches a Projection as kernels.h says."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import api, cpu_ops
from kvserve.kernels.isa import cpu_supports_bf16

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="CPU kernels unavailable here")
needs_amx = pytest.mark.needs_amx  # skipped at levels without AMX (tests/kernels/conftest.py)
# the engine's own gate (kvserve/kernels/support.py onednn_linear): oneDNN packs bf16 weights only
# where it has bf16 kernels for the CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not an AVX2-only one)
needs_onednn = pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and cpu_supports_bf16()),
                                  reason="no oneDNN bf16 kernels in this torch for this CPU")

DOCUMENTED_LIMITS = {
    "gemv_max_rows": 8,
    "decode_attention_max_queries_per_kv_head": 16,
    "decode_attention_max_head_dim": 256,
    "decode_attention_head_dim_multiple_bf16": 32,
    "decode_attention_head_dim_multiple_fp32": 16,
    "prefill_attention_head_dim_multiple": 32,
    "rope_head_dim_multiple": 32,
    "rms_norm_width_multiple": 16,
    "silu_width_multiple": 16,
    "tile_rows": 16,
    "tile_k": 32,
    "amx_argmax_max_rows": 128,
}
KERNELS_H = Path(api.__file__).with_name("kernels.h")


def _declared() -> set[str]:
    return {n for n in vars(api.CpuOps) if not n.startswith("_")} | set(api.CpuOps.__annotations__)


def test_module_binds_exactly_the_names_api_declares():
    assert {n for n in dir(ops) if not n.startswith("_")} == _declared()


def _bound_params(doc: str) -> list[str]:
    """Parameter names (with '*' and '=' for a default) from pybind11's signature line."""
    inner, depth, parts, cur = doc.split("(", 1)[1], 0, [], ""
    for ch in inner:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.split(":")[0].strip() + ("=" if "=" in p else "") for p in parts if p.strip()]


def _declared_params(fn) -> list[str]:
    out, positional = [], 0
    for p in list(inspect.signature(fn).parameters.values())[1:]:  # self
        if p.kind is p.KEYWORD_ONLY and "*" not in out:
            out.append("*")
        name = f"arg{positional}" if p.kind is p.POSITIONAL_ONLY else p.name
        positional += p.kind is p.POSITIONAL_ONLY
        out.append(name + ("=" if p.default is not p.empty else ""))
    return out


CONSTANTS = {"QUANT_Q8", "QUANT_Q4", "QUANT_Q4_MIN", "QUANT_Q8_MIN", "QUANT_Q4_K", "QUANT_Q6_K"}


@pytest.mark.parametrize("name", sorted(_declared() - CONSTANTS))
def test_bound_signature_is_the_declared_one(name):
    declared = getattr(api.CpuOps, name, None) or getattr(api, name).__init__
    bound = getattr(ops, name)
    doc = (bound.__init__ if isinstance(bound, type) else bound).__doc__
    params = _bound_params(doc)
    assert (params[1:] if isinstance(bound, type) else params) == _declared_params(declared)


def test_quant_format_constants_are_the_packers_codes():
    from kvserve.model.quant_formats import KIND_CODES

    assert {n: getattr(ops, n) for n in CONSTANTS} == {
        "QUANT_Q8": KIND_CODES["q8"], "QUANT_Q4": KIND_CODES["q4"],
        "QUANT_Q4_MIN": KIND_CODES["q4_min"], "QUANT_Q8_MIN": KIND_CODES["q8_min"],
        "QUANT_Q4_K": KIND_CODES["q4_k"], "QUANT_Q6_K": KIND_CODES["q6_k"],
    }  # fmt: skip


def test_limits_are_ints_for_the_documented_keys():
    assert ops.limits() == DOCUMENTED_LIMITS
    assert all(type(v) is int for v in ops.limits().values())


def test_kernels_h_header_comment_explains_every_limit():
    explained = set(re.findall(r"^//   ([a-z0-9_]+) ", KERNELS_H.read_text(), flags=re.M))
    assert set(ops.limits()) <= explained


N, K = 80, 96


def _weights(bias: bool, n: int = N):
    g = torch.Generator().manual_seed(n)
    w = (torch.randn(n, K, generator=g) / K**0.5).bfloat16()
    return w, (torch.randn(n, generator=g).bfloat16() if bias else None)


def _projection(layout: str, w: torch.Tensor, b: torch.Tensor | None):
    if layout == "weight":
        return ops.Projection(weight=w, bias=b, gemv_max_rows=8)
    if layout == "gemv+onednn":
        return ops.Projection(gemv=ops.amx_pack_weight(w), onednn=torch.ops.mkldnn._reorder_linear_weight(w, 2048),
                              bias=b, gemv_max_rows=8)  # fmt: skip
    assert layout == "weight+amx"
    return ops.Projection(weight=w, amx=ops.amx_pack_weight(w), bias=b, gemv_max_rows=8, amx_max_rows=256)


LAYOUTS = [
    "weight",
    pytest.param("gemv+onednn", marks=needs_onednn),
    pytest.param("weight+amx", marks=needs_amx),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 8, 9, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(layout, rows, with_bias):
    w, b = _weights(with_bias)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).bfloat16()
    y = ops.linear(x, _projection(layout, w, b))
    assert y.shape == (rows, N) and y.dtype == torch.bfloat16
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=8e-3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_linear_of_no_rows_is_empty_with_n_columns(layout):
    y = ops.linear(torch.empty(0, K, dtype=torch.bfloat16), _projection(layout, *_weights(False)))
    assert y.shape == (0, N)


@needs_onednn
def test_linear_refuses_gemv_rows_without_gemv_or_weight():
    w, _ = _weights(False)
    p = ops.Projection(onednn=torch.ops.mkldnn._reorder_linear_weight(w, 2048), gemv_max_rows=8)
    with pytest.raises(RuntimeError, match="neither Projection.gemv nor Projection.weight"):
        ops.linear(torch.randn(3, K).bfloat16(), p)


def test_linear_refuses_amx_rows_without_amx():
    p = ops.Projection(weight=_weights(False)[0], gemv_max_rows=8, amx_max_rows=64)
    with pytest.raises(RuntimeError, match="Projection.amx is not set"):
        ops.linear(torch.randn(9, K).bfloat16(), p)


def test_linear_refuses_a_gemv_max_rows_past_the_kernels_limit():
    p = ops.Projection(weight=_weights(False)[0], gemv_max_rows=ops.limits()["gemv_max_rows"] + 1)
    with pytest.raises(RuntimeError, match="gemv_max_rows"):
        ops.linear(torch.randn(2, K).bfloat16(), p)


@pytest.mark.parametrize("rows", [1, 9])
def test_linear_silu_mul_is_silu_of_gate_times_up(rows):
    w, _ = _weights(False, n=2 * 32)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).bfloat16()
    gate, up = F.linear(x.float(), w.float()).chunk(2, dim=-1)
    got = ops.linear_silu_mul(x, ops.Projection(weight=w, gemv_max_rows=8))
    torch.testing.assert_close(got.float(), F.silu(gate) * up, atol=2e-2, rtol=1.6e-2)


@needs_amx
def test_linear_silu_mul_on_interleaved_tiles_is_the_unfused_pair_bitwise():
    w, _ = _weights(False, n=2 * 32)
    interleaved = w.view(2, 2, 16, K).transpose(0, 1).reshape(2 * 32, K)  # gate block p, then up block p
    fused = ops.Projection(weight=w, amx=ops.amx_pack_weight(interleaved), gemv_max_rows=8, amx_max_rows=256,
                           silu_interleaved=True)  # fmt: skip
    x = torch.randn(20, K).bfloat16()
    expected = ops.silu_and_mul(ops.amx_linear(x, ops.amx_pack_weight(w)))
    assert torch.equal(ops.linear_silu_mul(x, fused), expected)


def test_projection_reads_back_its_fields_with_none_for_missing_tensors():
    w, b = _weights(True)
    p = ops.Projection(weight=w, bias=b, gemv_max_rows=4, amx_max_rows=64, silu_interleaved=True)
    assert p.weight is w and p.bias is b and p.gemv is None and p.amx is None and p.onednn is None
    assert (p.gemv_max_rows, p.amx_max_rows, p.silu_interleaved) == (4, 64, True)


def test_projection_takes_keywords_only():
    with pytest.raises(TypeError):
        ops.Projection(_weights(False)[0])


def _tiny_model(layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, inter=64, block=16, blocks=8, int8=False,
                gemma=False):
    """A random DecodeModel; `int8`: its pools quantized by quantize_kv, with their scales;
    `gemma`: Gemma 3's layer options (a norm on each branch's output, GeGLU, q/k norms), the
    odd layers local (their own RoPE tables) and in KV group 1."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).bfloat16()

    def proj(n, k, bias=False):
        return ops.Projection(weight=rand(n, k, scale=k**-0.5), bias=rand(n) if bias else None, gemv_max_rows=8)

    qkv_n = (heads + 2 * kv_heads) * head_dim

    def layer(i):
        common = dict(input_norm=rand(hidden), post_attention_norm=rand(hidden), qkv=proj(qkv_n, hidden, bias=not gemma),
                      o=proj(hidden, heads * head_dim), gate_up=proj(2 * inter, hidden), down=proj(hidden, inter))
        if not gemma:
            return ops.DecodeLayer(**common)
        return ops.DecodeLayer(**common, q_norm=rand(head_dim), k_norm=rand(head_dim), attn_out_norm=rand(hidden),
                               mlp_out_norm=rand(hidden), gelu=True, local=i % 2 == 1, kv_group=i % 2)

    decoder = [layer(i) for i in range(layers)]
    pools = [rand(blocks, block, kv_heads, head_dim) for _ in range(2 * layers)]
    angles = torch.arange(64).float()[:, None] * torch.rand(head_dim // 2, generator=g)[None]
    scales = {}
    if int8:
        from kvserve.attention.kv_pool import quantize_kv

        quantized = [quantize_kv(p) for p in pools]
        pools = [q for q, _ in quantized]
        scales = dict(k_scales=[s for _, s in quantized[:layers]], v_scales=[s for _, s in quantized[layers:]])
    if gemma:
        local = angles * 0.25  # another base
        scales.update(cos_local=local.cos(), sin_local=local.sin())
    return ops.DecodeModel(layers=decoder, k_pools=pools[:layers], v_pools=pools[layers:], cos_half=angles.cos(),
                           sin_half=angles.sin(), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                           eps=1e-5, scale=head_dim**-0.5, **scales)  # fmt: skip


def _step_inputs(batch=3, block=16, groups=1):
    """positions, then per KV group its slots and tables (group i's blocks shifted by i: each group
    indexes blocks of its own), then the context lengths"""
    lens = torch.tensor([5, 17, 30][:batch], dtype=torch.int32)
    positions = (lens - 1).long()
    slots, tables = [], []
    for i in range(groups):
        t = torch.arange(batch * 2, dtype=torch.int32).view(batch, 2) + i
        tables.append(t)
        slots.append(t[torch.arange(batch), positions // block].long() * block + positions % block)
    return positions, slots, tables, lens


def _layer_by_layer(model, h, positions, slots, tables, lens, starts=()):
    """What decode_layers does, one binding at a time (kernels.h); `starts`: per layer a window's
    start positions or None, as attention/sliding_window.py reads a window seen past."""
    residual = None
    for i, (layer, k, v) in enumerate(zip(model.layers, model.k_pools, model.v_pools)):
        x = ops.rms_norm(h, layer.input_norm, model.eps, residual)
        residual = h if residual is None else residual
        qkv = ops.linear(x, layer.qkv)
        if layer.q_norm is not None:
            heads = qkv.view(qkv.shape[0], -1, model.head_dim)
            for first, count, w in ((0, model.num_heads, layer.q_norm), (model.num_heads, model.num_kv_heads, layer.k_norm)):
                part = heads[:, first : first + count]
                part.copy_(ops.rms_norm(part.reshape(-1, model.head_dim).contiguous(), w, model.eps, None).view(part.shape))
        cos, sin = (model.cos_local, model.sin_local) if layer.local else (model.cos_half, model.sin_half)
        g = layer.kv_group
        q = ops.rope_and_cache(qkv, positions, cos, sin, k, v, slots[g], model.num_heads, model.num_kv_heads,
                               model.head_dim)  # fmt: skip
        if starts and starts[i] is not None:
            attn = ops.paged_decode_attention_lse(q, k, v, tables[g], lens, starts[i], model.scale)[0].to(q.dtype)
        else:
            attn = ops.paged_decode_attention(q, k, v, tables[g], lens, model.scale)
        o = ops.linear(attn.view(h.shape[0], -1), layer.o)
        if layer.attn_out_norm is not None:
            o = ops.rms_norm(o, layer.attn_out_norm, model.eps, None)
        x = ops.rms_norm(o, layer.post_attention_norm, model.eps, residual)
        act = ops.gelu_tanh_and_mul(ops.linear(x, layer.gate_up)) if layer.gelu else ops.linear_silu_mul(x, layer.gate_up)
        h = ops.linear(act, layer.down)
        if layer.mlp_out_norm is not None:
            h = ops.rms_norm(h, layer.mlp_out_norm, model.eps, None)
    return residual.add_(h)


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma3"])
def test_decode_layers_is_the_bindings_layer_by_layer_bitwise(gemma):
    fused, stepwise = _tiny_model(gemma=gemma), _tiny_model(gemma=gemma)  # same seed: equal weights, separate pools
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    inputs = _step_inputs(groups=2 if gemma else 1)
    expected = _layer_by_layer(stepwise, h.clone(), *inputs)
    assert torch.equal(ops.decode_layers(fused, h.clone(), *inputs), expected)
    assert all(torch.equal(a, b) for a, b in zip(fused.k_pools + fused.v_pools, stepwise.k_pools + stepwise.v_pools))
    if gemma:  # each option bites: the same weights with one option undone give another result
        assert fused.layers[1].local and fused.layers[1].kv_group == 1 and fused.layers[0].gelu
        for undone in (dict(gelu=False), dict(local=False), dict(attn_out_norm=None), dict(mlp_out_norm=None)):
            other = _tiny_model(gemma=True)
            layers = [_layer_with(layer, **undone) for layer in other.layers]
            other = _model_with(other, layers)
            assert not torch.equal(ops.decode_layers(other, h.clone(), *inputs), expected), undone


def test_decode_layers_reads_a_window_seen_past_from_its_start_positions():
    """Gemma 3's local layers (the odd ones) with a window of 8 that two of the three rows (17 and
    30 positions) see past: those layers over [len - 8, len), the global ones over everything."""
    fused, stepwise = _tiny_model(gemma=True), _tiny_model(gemma=True)
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    inputs = _step_inputs(groups=2)
    window_starts = (inputs[-1] - 8).clamp(min=0).to(torch.int32)
    starts = [window_starts if layer.local else None for layer in fused.layers]
    expected = _layer_by_layer(stepwise, h.clone(), *inputs, starts)
    got = ops.decode_layers(fused, h.clone(), *inputs, [], starts)
    assert torch.equal(got, expected)
    unwindowed = ops.decode_layers(_tiny_model(gemma=True), h.clone(), *inputs)
    assert not torch.equal(got, unwindowed)  # the window bites
    with pytest.raises(RuntimeError, match="one entry per layer or none, got 1 for 2 layers"):
        ops.decode_layers(_tiny_model(gemma=True), h.clone(), *inputs, [], starts[:1])


def _layer_with(layer, **changes):
    """A DecodeLayer as `layer` but for `changes`."""
    fields = ("input_norm", "post_attention_norm", "qkv", "o", "gate_up", "down", "q_norm", "k_norm", "attn_out_norm",
              "mlp_out_norm", "gelu", "local", "kv_group")
    return ops.DecodeLayer(**{f: changes[f] if f in changes else getattr(layer, f) for f in fields})


def _model_with(m, layers):
    return ops.DecodeModel(layers=layers, k_pools=m.k_pools, v_pools=m.v_pools, cos_half=m.cos_half, sin_half=m.sin_half,
                           num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, eps=m.eps,
                           scale=m.scale, cos_local=m.cos_local, sin_local=m.sin_local)  # fmt: skip


def test_decode_layers_refuses_a_layer_past_the_groups_given():
    m = _tiny_model(gemma=True)
    positions, slots, tables, lens = _step_inputs(groups=2)
    with pytest.raises(RuntimeError, match="a layer of KV group 1 in a step of 1 groups"):
        ops.decode_layers(m, torch.zeros(3, 64, dtype=torch.bfloat16), positions, slots[:1], tables[:1], lens)


def test_decode_layers_refuses_a_pool_count_off_the_layer_count():
    m = _tiny_model()
    short = ops.DecodeModel(layers=m.layers, k_pools=m.k_pools[:1], v_pools=m.v_pools, cos_half=m.cos_half,
                            sin_half=m.sin_half, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                            head_dim=m.head_dim, eps=m.eps, scale=m.scale)  # fmt: skip
    with pytest.raises(RuntimeError, match="one K and one V pool per layer"):
        ops.decode_layers(short, torch.zeros(3, 64, dtype=torch.bfloat16), *_step_inputs())
