"""The C++ CPU kernels agree with the plain-torch reference path they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.reference import decode_attention, prefill_attention
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.kernels import cpu_ops, unavailable_reason
from kvserve.kernels.support import KernelSupport
from tests.support.kernel_cases import prefill_case
from tests.support.paged_driver import PagedDriver

ops = cpu_ops()
# Skipped only where the kernels cannot apply (no AVX512-BF16, no compiler); a machine
# that should build them and did not fails here instead of silently testing nothing.
pytestmark = pytest.mark.skipif(
    ops is None and unavailable_reason() is not None, reason=f"CPU kernels unavailable: {unavailable_reason()}"
)


needs_amx = pytest.mark.needs_amx  # skipped at levels without AMX (tests/kernels/conftest.py)


def test_kernels_built_where_they_can_be():
    assert ops is not None, "the CPU supports the kernels and a compiler is present, but the build failed (see the log)"


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(
    "layout, out_features, in_features",
    [
        ("row-major", 96, 64), ("row-major", 1728, 576), ("row-major", 37, 40),
        # the GEMV of CPUs without AMX reads the weight in the AMX kernel's tile layout
        ("vnni", 96, 64), ("vnni", 1728, 576), ("vnni", 48, 1536),
    ],
)  # fmt: skip
def test_gemv_matches_fp32_reference(rows, layout, out_features, in_features):
    torch.manual_seed(rows)
    x = torch.randn(rows, in_features).bfloat16()
    w = torch.randn(out_features, in_features).bfloat16()
    expected = x.float() @ w.float().T
    got = (ops.gemv_bf16(x, w) if layout == "row-major" else ops.gemv_vnni(x, ops.amx_pack_weight(w))).float()
    # one bf16 rounding of the fp32-accumulated result; where the sum cancels to near zero,
    # both sides' fp32 summation orders differ by up to ~K·2⁻²⁴ of the terms' size (seen on
    # an AMD Zen 4: 1.9e-6 against an exact-looking 0 at K = 576)
    torch.testing.assert_close(got, expected, atol=in_features * 2**-24 * 4, rtol=2**-8)


def test_gemv_on_vnni_tiles_refuses_a_feature_count_off_its_weight():
    packed = ops.amx_pack_weight(torch.randn(48, 64).bfloat16())
    with pytest.raises(RuntimeError, match="features"):
        ops.gemv_vnni(torch.randn(1, 96).bfloat16(), packed)


@pytest.mark.parametrize("rows, features", [(48, 64), (96, 576), (16, 32)])
def test_rows_read_from_the_vnni_tiles_are_the_weights_rows(rows, features):
    """The embedding lookup on a tied LM head's tiles: ops.bf16_tile_rows is layouts.bf16_tile_rows
    in one call, every bit, for any ids (repeats, both ends, an empty batch)."""
    from kvserve.kernels import layouts

    torch.manual_seed(rows)
    w = torch.randn(rows, features).bfloat16()
    tiles = ops.amx_pack_weight(w)
    for ids in ([0], [rows - 1], [rows - 1, 0, 17 % rows, 17 % rows, 15, 16 % rows], []):
        ids = torch.tensor(ids, dtype=torch.long)
        got = ops.bf16_tile_rows(tiles, ids)
        assert got.shape == (len(ids), features) and torch.equal(got, w[ids])
        assert torch.equal(got, layouts.bf16_tile_rows(tiles, ids))
    for bad in ([rows], [-1]):
        with pytest.raises(RuntimeError, match="outside the weight's"):
            ops.bf16_tile_rows(tiles, torch.tensor(bad))


def _decode_case(dtype, batch, num_heads, num_kv_heads, head_dim, lens, block_size=16, num_blocks=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(batch, num_heads, head_dim, generator=g).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    max_blocks = -(-max(lens) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in range(batch)]).to(torch.int32)
    ctx = torch.arange(max(lens))
    slots = tables[:, ctx // block_size].long() * block_size + ctx % block_size
    mask = (ctx.unsqueeze(0) < lens_t.unsqueeze(1)).view(batch, 1, 1, -1)
    meta = AttentionMetadata(None, batch, slots, mask, lens_t, tables, [])
    return q, k, v, meta


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"],
)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, lens",
    [
        (9, 3, 64, [1, 17, 200, 33]),  # SmolLM2's shape; partial and whole blocks
        (4, 4, 32, [5, 16, 48]),  # g = 1, one chunk
        (2, 2, 64, [70, 3]),  # g = 1, two chunks
        (8, 2, 128, [100]),
        (6, 2, 32, [31, 64, 65, 2]),
        (16, 1, 64, [40]),
        (14, 2, 64, [90, 7]),  # g = 7: V-pass head groups of 4 + 3
        (5, 1, 96, [33, 64]),  # three chunks, g = 5: groups of 2, 2, 1
        (4, 1, 256, [40, 300]),  # Gemma-3-1B's head_dim, the kernel's widest; two splits
    ],
)
def test_decode_attention_matches_reference(dtype, tol, num_heads, num_kv_heads, head_dim, lens):
    """At the `amx` level bf16 scores take AMX tiles, at the others vector dot products."""
    q, k, v, meta = _decode_case(dtype, len(lens), num_heads, num_kv_heads, head_dim, lens)
    scale = head_dim**-0.5
    expected = decode_attention(q.float(), k.float(), v.float(), meta, scale)
    got = ops.paged_decode_attention(q, k, v, meta.decode_block_tables, meta.decode_context_lens, scale)
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


def _prefill_case(segments, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """tests/support/kernel_cases.py's pools and queries, with the segments as the metadata the kernel takes."""
    q, k, v, prefills = prefill_case(segments, num_heads, num_kv_heads, head_dim, block_size, seed)
    return q, k, v, AttentionMetadata(None, 0, None, None, None, None, prefills)


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size, segments",
    [
        (9, 3, 64, 16, [(0, 128)] * 3),  # SmolLM2's shape, equal prompts (the batched case)
        (9, 3, 64, 16, [(0, 17), (0, 40), (33, 7), (100, 1), (5, 200)]),  # partial blocks, cached history
        (4, 4, 32, 4, [(0, 5), (20, 50)]),  # g = 1, one chunk, blocks of 4 slots
        (8, 2, 128, 32, [(0, 77), (64, 64)]),  # four chunks: Q and K tiles reloaded per group
        (16, 1, 64, 16, [(0, 300)]),  # g = 16, more than 256 keys
        (4, 1, 256, 16, [(0, 70), (40, 9)]),  # Gemma-3-1B's head_dim
    ],
)
def test_prefill_attention_kernel_matches_reference(num_heads, num_kv_heads, head_dim, block_size, segments):
    q, k, v, meta = _prefill_case(segments, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    expected = torch.empty(q.shape)
    prefill_attention(q.float(), k.float(), v.float(), meta, scale, expected)
    got = torch.full_like(q, float("nan"))
    slots, segs, _ = meta.prefill_kernel_args()
    ops.paged_prefill_attention(q, k, v, slots, segs, scale, got)
    # probabilities and the output are each rounded to bf16 once
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_prefill_attention_kernel_writes_only_its_rows():
    # decode rows come first in the flat batch; the kernel must leave them to the decode kernel
    q, k, v, meta = _prefill_case([(0, 20), (8, 9)], 6, 2, 64, 16)
    q = torch.cat([torch.zeros(3, 6, 64).bfloat16(), q])
    for seg in meta.prefills:
        seg.query_start += 3
    out = torch.full_like(q, 7.0)
    slots, segs, _ = meta.prefill_kernel_args()
    ops.paged_prefill_attention(q, k, v, slots, segs, 64**-0.5, out)
    assert (out[:3] == 7).all() and torch.isfinite(out[3:].float()).all() and not (out[3:] == 7).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["llama-gqa", "llama-hd64"])  # head_dim 64: the AMX prefill kernel's path
def test_engine_logits_with_and_without_kernels(tiny_model_dirs, variant, dtype):
    def run(cpu_kernels, dtype=dtype):
        engine = LLMEngine(
            EngineConfig(
                model=tiny_model_dirs[variant], dtype=dtype, device="cpu", kv_cache_memory="4MiB", cpu_kernels=cpu_kernels
            )
        )
        assert engine.uses_cpu_kernels == cpu_kernels
        driver = PagedDriver(engine)
        req = driver.new_request(engine.tokenizer.encode("The quick brown fox jumps over the lazy dog"))
        out = [driver.prefill(req, chunk=4)]  # later chunks attend over cached history (S0 > 0)
        for token in (5, 9, 11):
            out.append(driver.decode(req, token))
        return torch.stack(out)

    if dtype == "float32":
        torch.testing.assert_close(run(True), run(False), atol=1e-4, rtol=1e-4)
        return
    # bf16: the kernels round at other points than torch does, so the two bf16 paths differ
    # by bf16 noise (up to ~0.25 on the hd64 model's logits); both are held to fp32 instead,
    # and the kernels may not be less accurate than torch's own bf16 path
    exact = run(False, dtype="float32")
    kernel_error = (run(True) - exact).abs().max()
    torch_error = (run(False) - exact).abs().max()
    assert kernel_error <= 1.25 * torch_error + 1e-2, (kernel_error, torch_error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_torch_layer(dtype, with_residual):
    from kvserve.model.layers import RMSNorm

    torch.manual_seed(0)
    x = (torch.randn(37, 576) * 3).to(dtype)
    residual = torch.randn(37, 576).to(dtype)
    weight = torch.randn(576).to(dtype)
    reference = RMSNorm(weight, 1e-5)  # no ops: the plain-torch path
    res_ref, res_got = residual.clone(), residual.clone()
    expected = reference(x.clone(), res_ref if with_residual else None)
    got = ops.rms_norm(x.clone(), weight, 1e-5, res_got if with_residual else None)
    # same order of operations (fp32 statistics, rounded to the dtype, then scaled): the
    # results may differ only by the last-place rounding of 1/sqrt and of the product
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 8e-3)
    if with_residual:
        assert torch.equal(res_got, res_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch_including_extremes(dtype):
    torch.manual_seed(0)
    gate_up = (torch.randn(37, 2 * 96) * 4).to(dtype)
    gate_up[0, :6] = torch.tensor([-1000.0, -100.0, -88.0, 88.0, 100.0, 1000.0])  # exp over- and underflow
    gate, up = gate_up.float().chunk(2, dim=-1)
    silu = F.silu(gate).to(dtype).float()  # the model rounds silu(gate) to its dtype before the product
    expected = silu * up
    got = ops.silu_and_mul(gate_up)
    assert torch.isfinite(got.float()).all()
    # bf16: two roundings (silu, then the product), so a tie can land one bf16 step (2^-8) away
    torch.testing.assert_close(got.float(), expected, atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_matches_torch_including_extremes(dtype):
    torch.manual_seed(0)
    gate_up = (torch.randn(37, 2 * 96) * 4).to(dtype)
    gate_up[0, :8] = torch.tensor([-1e4, -100.0, -10.0, -1e-3, 1e-3, 10.0, 100.0, 1e4])  # σ's exp over- and underflow
    gate, up = gate_up.float().chunk(2, dim=-1)
    gelu = F.gelu(gate, approximate="tanh").to(dtype).float()  # rounded to the dtype before the product, as the model does
    got = ops.gelu_tanh_and_mul(gate_up)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), gelu * up, atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 1.6e-2)
    # and as Gemma's MLP reads it in fp32: within a few ulp of torch's tanh form everywhere
    x = torch.linspace(-12, 12, 4800)
    ones = torch.ones_like(x)
    torch.testing.assert_close(ops.gelu_tanh_and_mul(torch.cat([x, ones])[None]).squeeze(0), F.gelu(x, approximate="tanh"),
                               atol=1e-6, rtol=1e-6)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_matches_torch_with_ties(dtype):
    torch.manual_seed(0)
    x = torch.randn(7, 1000).to(dtype)
    x[3, 17] = x[3, 900] = 50  # a tie: the lower index wins, as in torch.argmax
    x[5, -1] = 60  # in the scalar tail (1000 = 62·16 + 8)
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))
    assert int(ops.argmax_rows(x)[3]) == 17


@needs_amx
@pytest.mark.parametrize(
    "rows, n, k",
    [(9, 16, 32), (17, 48, 96), (64, 960, 576), (64, 48, 224), (100, 576, 1536), (129, 48, 96), (300, 80, 64), (600, 64, 64)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_matches_torch(rows, n, k, with_bias):
    """Rows that are not a multiple of the 16-row tile, several 64-row groups, both loops
    (up to 128 rows, depth in chunks, the last one shorter at k=224; panels of 256 with
    column blocks in pairs, an odd one left), bias: all within bf16 rounding of the fp32
    product."""
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    y = ops.amx_linear(x, ops.amx_pack_weight(w), b)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, atol=1e-2, rtol=8e-3)  # bf16 output: 2^-8 relative


@needs_amx
@pytest.mark.parametrize("rows", [9, 16, 37, 64, 128, 129, 300])
@pytest.mark.parametrize(
    "intermediate, k",
    # an odd and an even count of 16-column blocks per half; then depth in chunks, with more
    # gate/up pairs than one group of the decode-sized loop holds
    [(48, 96), (64, 96), (304, 576)],
)
def test_amx_linear_silu_mul_is_the_unfused_pair_bitwise(rows, intermediate, k):
    """The fused gate/up kernel against amx_linear then silu_and_mul on the plain [gate; up]
    pack: both loops, rows off the tile grid, odd A tiles in a panel — bit for bit."""
    from kvserve.kernels.layouts import interleave_gate_up

    g = torch.Generator().manual_seed(rows + intermediate)
    gate_up = (torch.randn(2 * intermediate, k, generator=g) * 0.2).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    expected = ops.silu_and_mul(ops.amx_linear(x, ops.amx_pack_weight(gate_up), None))
    got = ops.amx_linear_silu_mul(x, ops.amx_pack_weight(interleave_gate_up(gate_up)))
    assert got.shape == (rows, intermediate)
    assert torch.equal(got, expected)


@needs_amx
@pytest.mark.parametrize("rows, n, k", [(9, 16, 32), (37, 480, 224), (64, 4096, 576), (128, 2048, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_argmax_is_argmax_of_the_product_bitwise(rows, n, k, with_bias):
    """The greedy LM head: the argmax epilogue against argmax_rows of amx_linear's bf16
    output, with a tie at the maximum between a column in the first group of blocks the
    threads share out and one in the last group (the lower index must win), rows off the
    tile grid, two row groups."""
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    w[5] = w[n - 3] = (x[0].float() * 2).bfloat16()  # row 0's largest output, twice
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    if b is not None:
        b[5] = b[n - 3] = 0
    packed = ops.amx_pack_weight(w)
    expected = ops.argmax_rows(ops.amx_linear(x, packed, b))
    got = ops.amx_linear_argmax(x, packed, b)
    assert got.dtype == torch.int64 and torch.equal(got, expected)
    assert int(got[0]) == 5


@needs_amx
def test_amx_linear_argmax_refuses_more_rows_than_its_loop_takes():
    packed = ops.amx_pack_weight(torch.zeros(16, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="at most 128 rows"):
        ops.amx_linear_argmax(torch.zeros(129, 32, dtype=torch.bfloat16), packed)


@needs_amx
def test_amx_pack_weight_rejects_shapes_off_the_tile_grid():
    with pytest.raises(RuntimeError, match="N % 16 == 0 and K % 32 == 0"):
        ops.amx_pack_weight(torch.zeros(24, 32, dtype=torch.bfloat16))


def _linear(w: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True):
    """A Linear as the engine builds one for a bf16 model on this machine."""
    from kvserve.arch import ModelArchitecture
    from kvserve.model.linear import Linear

    arch = ModelArchitecture("llama", 320, 64, 128, 1, 4, 2, 16, 1e-6, 1e4, 64, False)
    kernels = KernelSupport.decide(arch, torch.bfloat16, torch.device("cpu"), ops, prepack_weights=prepack)
    lin = Linear(w, bias, kernels)
    lin.process_weights_after_loading()
    return lin


@pytest.mark.parametrize("prepack", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear_at_every_row_count(prepack, with_bias):
    """Each tier the method keeps (GEMV, AMX where present, oneDNN, F.linear) gives x·Wᵀ + b."""
    w = torch.randn(64, 96).bfloat16()
    b = torch.randn(64).bfloat16() if with_bias else None
    lin = _linear(w, b, prepack)
    for rows in (1, 8, 9, 300, 1025):
        x = torch.randn(rows, 96).bfloat16()
        ref = F.linear(x.float(), w.float(), None if b is None else b.float())
        torch.testing.assert_close(lin(x).float(), ref, atol=3e-2, rtol=8e-3)


def test_linear_without_amx_holds_only_the_vnni_tiles_for_every_row_count():
    if ops.amx_available():
        pytest.skip("this CPU has AMX: its tiles serve the GEMV and the AMX kernel (test_linear_on_amx_...)")
    w = torch.randn(64, 96).bfloat16()
    lin = _linear(w)
    p = lin.kernel
    assert lin.weight is None and p.weight is None and p.amx is None and p.onednn is None
    assert p.gemv is not None and p.gemv_all_rows
    x = torch.randn(8, 96).bfloat16()
    assert torch.equal(lin(x), ops.gemv_vnni(x, p.gemv))
    big = torch.randn(77, 96).bfloat16()
    assert torch.equal(lin(big), ops.gemm_vnni(big, p.gemv))
    torch.testing.assert_close(lin(big).float(), big.float() @ w.float().T, rtol=2**-7, atol=1e-2)


def test_gemm_vnni_matches_the_gemv_row_for_row_in_full_tiles():
    w = torch.randn(48, 128).bfloat16()
    packed = ops.amx_pack_weight(w)
    x = torch.randn(150, 128).bfloat16()
    y = ops.gemm_vnni(x, packed)
    # full 8-row tiles run the GEMV's own 8-row kernel
    assert torch.equal(y[:8], ops.gemv_vnni(x[:8], packed)) and torch.equal(y[64:72], ops.gemv_vnni(x[64:72], packed))
    torch.testing.assert_close(y.float(), x.float() @ w.float().T, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_gemv_lanes_give_every_column_the_many_row_paths_bits(threads):
    """The decode GEMV takes the blocks of a tile from lanes of a thread's share (each lane one
    long stream) and the blocks past whole lanes in neighbouring groups: whichever a column
    block falls in, at any thread count, its outputs are the bits the many-row path gives the
    same row (one summation order per output, k in order)."""
    g = torch.Generator().manual_seed(3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        # block counts below one lane per thread, at whole lanes, and with leftovers of each size
        for nb in (3, 7, 8, 9, 16, 17, 19, 63, 108):
            w = (torch.randn(16 * nb, 96, generator=g) * 2.0 ** torch.randint(-8, 9, (16 * nb, 96), generator=g)).bfloat16()
            packed = ops.amx_pack_weight(w)
            x = (torch.randn(64, 96, generator=g) * 2.0 ** torch.randint(-8, 9, (64, 96), generator=g)).bfloat16()
            many = ops.gemm_vnni(x, packed)  # 64 rows: the widened panels (or the pair tiles' chunks)
            for rows in range(1, 9):
                assert torch.equal(ops.gemv_vnni(x[:rows], packed), many[:rows]), (nb, rows)
    finally:
        torch.set_num_threads(before)


def test_linear_without_amx_gives_a_row_the_same_bits_at_every_row_count():
    """Batch invariance of the bf16 path without AMX: the GEMV (1-8 rows, several column
    blocks in flight at 1-2 rows) and the 8x32 tiles sum every output in one order, so a row
    computed alone equals the same row inside a call of any size (1 to 1,024 rows)."""
    if ops.amx_available():
        pytest.skip("this CPU has AMX: its GEMV and tiles sum in different orders (--deterministic uses the VNNI tiles)")
    g = torch.Generator().manual_seed(0)
    # long sums of terms spread over 2^±8, so summing in another order shows after rounding to bf16
    w = (torch.randn(256, 2048, generator=g) * 2.0 ** torch.randint(-8, 9, (256, 2048), generator=g)).bfloat16()
    lin = _linear(w)
    x = (torch.randn(1024, 2048, generator=g) * 2.0 ** torch.randint(-8, 9, (1024, 2048), generator=g)).bfloat16()
    alone = torch.cat([lin(x[i : i + 1]) for i in range(64)])
    for rows in (1, 2, 3, 5, 8, 9, 17, 64, 65, 300, 1024):
        assert torch.equal(lin(x[:rows])[: min(rows, 64)], alone[: min(rows, 64)]), rows
    # rows past the many-row path's first chunk of rows (and at its edges), each against itself alone
    late = [140, 143, 144, 145, 200, 299]
    together = lin(x[:300])
    for i in late:
        assert torch.equal(together[i], lin(x[i : i + 1])[0]), i
    for start in (0, 7, 100, 999):  # a row's place in the call does not matter either
        assert torch.equal(lin(x[start : start + 3])[0], lin(x[start : start + 1])[0])


@pytest.mark.parametrize("pair_dots", [True, False], ids=["pair-dots", "widened"])
def test_both_bf16_formats_of_the_tiles_give_a_row_the_same_bits_at_every_row_count(pair_dots):
    """The bf16 GEMM on the VNNI tiles in either compute format (isa.bf16_pair_dots: VDPBF16PS
    pair dots, or the weights widened to fp32 FMAs) sums every output in one order, so a row's
    bits do not depend on its call; the two formats differ from each other only by rounding.
    A level without pair dots refuses them (always widened)."""
    level_has_pairs = ops.isa_level() in ("avx512-bf16", "amx")
    before = ops.bf16_pair_dots()
    try:
        assert ops.set_bf16_pair_dots(pair_dots) == (pair_dots and level_has_pairs)
        g = torch.Generator().manual_seed(1)
        w = (torch.randn(64, 1024, generator=g) * 2.0 ** torch.randint(-8, 9, (64, 1024), generator=g)).bfloat16()
        packed = ops.amx_pack_weight(w)
        x = (torch.randn(300, 1024, generator=g) * 2.0 ** torch.randint(-8, 9, (300, 1024), generator=g)).bfloat16()
        alone = torch.cat([ops.gemm_vnni(x[i : i + 1], packed) for i in range(40)])
        for rows in (1, 2, 3, 8, 9, 17, 40, 65, 145, 300):
            assert torch.equal(ops.gemm_vnni(x[:rows], packed)[: min(rows, 40)], alone[: min(rows, 40)]), rows
        torch.testing.assert_close(ops.gemm_vnni(x, packed).float(), x.float() @ w.float().T, rtol=2**-7, atol=1e-2)
    finally:
        ops.set_bf16_pair_dots(before)


@needs_amx
def test_linear_on_amx_reads_one_tile_copy_for_the_gemv_and_tiles_up_to_1024_rows():
    """On AMX the GEMV streams the VNNI tiles, which are the AMX kernel's layout: one copy for
    both (up to 1024 rows), oneDNN's past them, and no row-major weight where oneDNN is there."""
    from kvserve.kernels.support import AMX_MAX_ROWS

    w = torch.randn(64, 96).bfloat16()
    lin = _linear(w)
    p = lin.kernel
    assert p.gemv is not None and p.amx is not None and p.gemv.data_ptr() == p.amx.data_ptr()
    assert p.amx_max_rows == AMX_MAX_ROWS and not p.gemv_all_rows
    if p.onednn is not None:
        assert lin.weight is None and p.weight is None
    x = torch.randn(8, 96).bfloat16()
    assert torch.equal(lin(x), ops.gemv_vnni(x, p.gemv))
    x = torch.randn(AMX_MAX_ROWS, 96).bfloat16()
    assert torch.equal(lin(x), ops.amx_linear(x, p.amx))


def test_linear_off_the_tile_grid_keeps_the_row_major_weight():
    w = torch.randn(40, 40).bfloat16()  # N % 16 and K % 32 off the grid: no tile copies
    lin = _linear(w)
    assert lin.weight is not None and lin.kernel.gemv is None and lin.kernel.amx is None
    x = torch.randn(3, 40).bfloat16()
    torch.testing.assert_close(lin(x).float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=8e-3)


@pytest.fixture(scope="module")
def qwen2_hd64(tmp_path_factory) -> str:
    from tests.support.tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("qwen2-hd64"), model_type="qwen2", num_heads=4, num_kv_heads=2, hidden_size=256))


@pytest.mark.parametrize("variant", ["llama-hd64", "qwen2-hd64"])
def test_fused_decode_layers_equal_the_layer_by_layer_path(tiny_model_dirs, qwen2_hd64, variant):
    """ops.decode_layers runs the same kernels as the Python layers; the result is identical."""
    path = qwen2_hd64 if variant == "qwen2-hd64" else tiny_model_dirs[variant]

    def run(fused: bool):
        engine = LLMEngine(EngineConfig(model=path, dtype="bfloat16", device="cpu", kv_cache_memory="4MiB"))
        engine.model.fused_decode = fused
        # 11 rows fit the fused path: past the GEMV's 8, on AMX tiles or (without AMX) the VNNI tiles
        assert engine.model.fused_decode_rows() >= 11 if fused else engine.model.fused_decode_rows() == 0
        # 11 requests: more than the GEMV's 8 rows, so the fused path's packed projections run
        texts = [f"{t} {i}" for i in range(11) for t in ("The quick brown fox", "hello world, once upon a time")][:11]
        return decode_steps(engine, texts)

    assert torch.equal(run(True), run(False))


def decode_steps(engine: LLMEngine, texts: list[str], tokens=(5, 9, 11)) -> torch.Tensor:
    """Prefill each text as a request, then one decode step of all of them per token in
    `tokens`: each step's sampled-row outputs, stacked [steps, requests, ...]."""
    driver = PagedDriver(engine)
    reqs = [driver.new_request(engine.tokenizer.encode(t)) for t in texts]
    for r in reqs:
        driver.prefill(r)
    out = []
    for token in tokens:
        for r in reqs:
            r.append_output_token(token)
        step = driver.step([(r, 1) for r in reqs])
        out.append(torch.stack([step[r.request_id] for r in reqs]))
    return torch.stack(out)
