"""The cases tests/kernels/test_core_emulated.py runs through tests/kernels/cpp/core_driver.cpp
at every level, with the checks on their outputs.

Each kernel family of the torch-free core (kvserve/kernels/core) gets the kinds of cases the
x86 kernel tests run through torch (test_kernels.py, test_quant_linear.py,
test_int8_kv_kernels.py, test_shared_prefix_attention.py, test_shared_prefill.py), on shapes
small enough for qemu: inputs and quantized weights made by kvserve's own packers, outputs
checked against the same plain-torch references with the same tolerances, and a row computed
alone (or in another row count, tile or chunk) against the same row in a larger call, bit for
bit. A case is an array-in, array-out call of one core function (the driver knows nothing
else); a check reads the outputs of any cases of its family, so the invariance checks compare
cases with each other.
"""

from __future__ import annotations

import copy

import dataclasses
import hashlib
import math
from collections.abc import Callable
from pathlib import Path

import gguf
import torch
import torch.nn.functional as F

from kvserve.attention.kv_pool import dequantize_kv, quantize_kv
from kvserve.attention.metadata import AttentionMetadata, PrefillSegment, rectangular_causal_bias
from kvserve.attention.reference import decode_attention, prefill_attention
from kvserve.model import quant_formats as qf
from tests.support.kernel_cases import int8_reference, prefill_case, quantized_weight
from kvserve.model.layers import RMSNorm
from kvserve.model.llama import WholeProjectionNorm
from tests.support.kquants import random_k_blocks

FAMILIES = (
    "gemv_rowmajor", "gemm_tiles", "quant_linear", "quant_linear_rows", "quant_embedding", "decode_attention", "prefill_attention",
    "shared_prefix_attention", "merge_attention_states", "rms_norm", "rope_and_cache", "rope_and_cache_int8",
    "silu_and_mul", "gelu_tanh_and_mul", "argmax_rows", "whole_projection_norm", "moe_route",
)  # fmt: skip

# the integer view of each dtype: bitwise comparisons that NaN (and -0) cannot fool
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.dtype]) if t.dtype in _BITS else t


@dataclasses.dataclass
class Case:
    id: str
    family: str
    desc: str  # what the case is, for failure messages
    params: dict[str, int | float]
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]  # initial contents (the driver writes them back after the call)


Results = dict[str, dict[str, torch.Tensor]]  # case id -> output name -> tensor


class Checker:
    """Collects every failure of a family's checks (so one run reports them all)."""

    def __init__(self, family: str):
        self.family = family
        self.failures: list[str] = []

    def fail(self, what: str) -> None:
        self.failures.append(f"[{self.family}] {what}")

    def true(self, cond: bool, what: str) -> None:
        if not cond:
            self.fail(what)

    def same(self, got: torch.Tensor, want: torch.Tensor, what: str) -> bool:
        """Bit for bit."""
        if got.shape != want.shape:
            self.fail(f"{what}: shape {tuple(got.shape)} against {tuple(want.shape)}")
            return False
        off = bits(got) != bits(want)
        if off.any():
            i = int(off.flatten().nonzero()[0])
            g, w = got.flatten()[i].item(), want.flatten()[i].item()
            diff = (got.double() - want.double()).abs()
            finite = diff[torch.isfinite(diff)]
            worst = f"; largest |difference| {finite.max().item():.3g}" if finite.numel() else ""
            self.fail(f"{what}: {int(off.sum())} of {off.numel()} elements differ in their bits (first at flat "
                      f"index {i}: {g!r} against {w!r}{worst})")  # fmt: skip
            return False
        return True

    def close(self, got: torch.Tensor, want: torch.Tensor, atol, rtol: float, what: str) -> None:
        """|got - want| <= atol + rtol·|want| elementwise (atol a number or a tensor), as
        torch.testing.assert_close; infinities must match exactly, NaN is a failure."""
        if got.shape != want.shape:
            self.fail(f"{what}: shape {tuple(got.shape)} against {tuple(want.shape)}")
            return
        g, w = got.double(), want.double()
        atol_t = atol.double() if isinstance(atol, torch.Tensor) else torch.tensor(float(atol), dtype=torch.float64)
        inf = torch.isinf(w) | torch.isinf(g)
        allowed = atol_t + rtol * w.abs()
        diff = torch.where(inf, torch.zeros_like(g), (g - w).abs())
        bad = (diff > allowed) | torch.isnan(g) | (inf & (g != w))
        if bad.any():
            excess = torch.where(bad, diff - allowed, torch.full_like(diff, -math.inf))
            i = int(excess.flatten().argmax())
            a = allowed.expand_as(g).flatten()[i].item()
            self.fail(f"{what}: {int(bad.sum())} of {bad.numel()} elements off (worst at flat index {i}: got "
                      f"{g.flatten()[i].item():.7g}, want {w.flatten()[i].item():.7g}, |difference| "
                      f"{diff.flatten()[i].item():.3g} > allowed {a:.3g}; largest |difference| {diff.max().item():.3g})")  # fmt: skip


class Suite:
    """All cases, and per family the checks on their outputs."""

    def __init__(self):
        self.cases: list[Case] = []
        self.checks: dict[str, list[Callable[[Results, Checker], None]]] = {f: [] for f in FAMILIES}

    def add(self, family: str, desc: str, params: dict, inputs: dict, outputs: dict) -> str:
        case = Case(f"c{len(self.cases):04d}", family, desc, params, {k: v for k, v in inputs.items() if v is not None},
                    outputs)  # fmt: skip
        self.cases.append(case)
        return case.id

    def check(self, family: str):
        def register(fn):
            self.checks[family].append(fn)
            return fn

        return register

    def desc(self, case_id: str) -> str:
        return self.cases[int(case_id[1:])].desc

    def write(self, directory: Path) -> None:
        """The manifest and the arrays, each array's file named by its bytes' hash (the cases
        of one pool share its file)."""
        lines, written = [], set()

        def file(t: torch.Tensor) -> str:
            data = t.contiguous().view(torch.uint8).numpy().tobytes()
            name = hashlib.sha1(data).hexdigest()[:16]
            if name not in written:
                (directory / f"{name}.bin").write_bytes(data)
                written.add(name)
            return name

        for c in self.cases:
            words = [c.id, c.family]
            for k, v in c.params.items():
                words.append(f"{k}={float(v).hex() if isinstance(v, float) else int(v)}")
            words.append("in=" + ",".join(f"{n}@{file(t)}" for n, t in c.inputs.items()))
            words.append("out=" + ",".join(f"{n}@{file(t)}" for n, t in c.outputs.items()))
            lines.append(" ".join(words))
        (directory / "manifest.txt").write_text("\n".join(lines) + "\n")

    def read(self, directory: Path, ids: set[str] | None = None) -> Results:
        """The outputs the driver wrote (a case whose files are missing is left out)."""
        out: Results = {}
        for c in self.cases:
            if ids is not None and c.id not in ids:
                continue
            got = {}
            for name, init in c.outputs.items():
                path = directory / f"{c.id}.{name}.bin"
                if path.exists():
                    raw = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
                    got[name] = raw.view(init.dtype).view(init.shape)
            if len(got) == len(c.outputs):
                out[c.id] = got
        return out

    def run_checks(self, family: str, res: Results) -> list[str]:
        ck = Checker(family)
        missing = [c for c in self.cases if c.family == family and c.id not in res]
        if missing:
            ck.fail(f"{len(missing)} cases have no outputs, the first {missing[0].id} ({missing[0].desc})")
            return ck.failures
        for fn in self.checks[family]:
            fn(res, ck)
        return ck.failures


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- gemv ----------------------------------------------------------------------------------


def _pack_tiles(w: torch.Tensor) -> torch.Tensor:
    """ops.amx_pack_weight: w [N, K] bf16 -> VNNI tiles [N/16, K/32, 16, 32]."""
    n, k = w.shape
    return w.contiguous().view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous().view(n // 16, k // 32, 16, 32)


def _gemv_family(s: Suite, family: str, shapes, seed: int) -> None:
    """Every row count against the fp32 product; every row (of those picked) alone bitwise the
    same as in the larger calls."""
    for n, k, counts, alone, spread in shapes:
        g = _gen(seed + n + k)
        rows = max(counts)
        if spread:  # terms spread over 2^±8: summing in another order shows after rounding to bf16
            x = (torch.randn(rows, k, generator=g) * 2.0 ** torch.randint(-8, 9, (rows, k), generator=g)).bfloat16()
            w = (torch.randn(n, k, generator=g) * 2.0 ** torch.randint(-8, 9, (n, k), generator=g)).bfloat16()
        else:
            x, w = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
        wk = w if family == "gemv_rowmajor" else _pack_tiles(w)
        expected = x.float() @ w.float().T
        # one bf16 rounding of the fp32-accumulated result; fp32 summation orders differ by up to
        # ~K·2^-24 of the terms' size (test_kernels.py's bound, for unit terms; scaled to the
        # terms' size where they are spread)
        atol = 4 * 2.0**-24 * (x.float().abs() @ w.float().abs().T) if spread else k * 2**-24 * 4
        ids = {}
        for m in counts:
            ids[m] = s.add(family, f"N={n} K={k} M={m}", dict(M=m, K=k, N=n), dict(x=x[:m], w=wk),
                           dict(y=torch.zeros(m, n, dtype=torch.bfloat16)))  # fmt: skip
        alone_ids = {r: s.add(family, f"N={n} K={k} row {r} alone", dict(M=1, K=k, N=n), dict(x=x[r : r + 1], w=wk),
                              dict(y=torch.zeros(1, n, dtype=torch.bfloat16))) for r in alone}  # fmt: skip

        @s.check(family)
        def _(res, ck, ids=ids, alone_ids=alone_ids, expected=expected, atol=atol, n=n, k=k):
            for m, cid in ids.items():
                a = atol[:m] if isinstance(atol, torch.Tensor) else atol
                ck.close(res[cid]["y"].float(), expected[:m], a, 2**-8, f"N={n} K={k} M={m} against x·Wᵀ in fp32")
            for r, cid in alone_ids.items():
                for m, big in ids.items():
                    if r < m:
                        ck.same(res[cid]["y"][0], res[big]["y"][r], f"N={n} K={k}: row {r} alone against it among M={m}")


def gemv_cases(s: Suite) -> None:
    # (N, K, row counts, rows checked alone, spread values); gemv_rowmajor: 1..8 rows (kGemvMaxRows),
    # N off the 8/4/2-column tiles and K off the 16-input grid (scalar tails)
    _gemv_family(s, "gemv_rowmajor", [
        (96, 64, [1, 2, 3, 5, 8], [0, 4, 7], False),
        (37, 40, [1, 3, 8], [0, 7], False),
        (256, 512, [1, 2, 4, 6, 8], [0, 3, 5, 7], True),
    ], seed=10)  # fmt: skip
    # gemm_tiles at avx2/neon: <= 4 rows one pass (several column blocks in flight at 1-2 rows),
    # <= 24 the depth-chunked few-row path, more the panels in chunks of 144 rows
    _gemv_family(s, "gemm_tiles", [
        (96, 64, [1, 2, 3, 4, 5, 8, 9, 24, 25, 150], [0, 1, 7, 8, 23, 24, 143, 144, 149], False),
        (256, 512, [1, 3, 6, 24, 30], [0, 2, 5, 23, 29], True),  # depth chunks in both many-row paths
        (48, 1536, [1, 2, 8], [0, 7], False),
    ], seed=20)  # fmt: skip


# ---- quant_linear, quant_embedding ---------------------------------------------------------


def _segment_arrays(w: qf.QuantizedWeight) -> tuple[dict, dict]:
    """The driver's view of the segments, as ops/quant_linear.cpp check_segments builds it."""
    params, arrays = {"nsegs": len(w.segments)}, {}
    for i, seg in enumerate(w.segments):
        kb = seg.cols // qf.BLOCK
        params[f"fmt{i}"] = qf.KIND_CODES[seg.kind]
        params[f"groups{i}"] = seg.codes.shape[0]
        params[f"per_channel{i}"] = int(not seg.k_quant and seg.scales.shape[1] == 1 and kb != 1)
        arrays[f"codes{i}"] = seg.codes
        arrays[f"scales{i}"] = seg.scales
        arrays[f"mins{i}"] = seg.mins
        arrays[f"sub{i}"] = seg.sub
    return params, arrays


def _ql(s: Suite, desc: str, w, x, y_dtype, bias=None) -> str:
    params, arrays = _segment_arrays(w)
    m, k = x.shape
    params.update(M=m, K=k, x_bf16=int(x.dtype == torch.bfloat16), y_bf16=int(y_dtype == torch.bfloat16))
    return s.add("quant_linear", desc, params, dict(x=x, bias=bias, **arrays), dict(y=torch.zeros(m, w.shape[0], dtype=y_dtype)))


def quant_cases(s: Suite) -> None:
    plain = ["q8", "int8-channel", "q4", "q4_min", "q8_min"]
    k_quants = ["Q4_K", "Q6_K", "Q6_K-full-range"]
    counts = [1, 3, 9, 48, 70]  # decode, tiles of 4 and their remainders, the 8-bit panel from 48, two chunks of 64
    alone = [5, 47, 48, 63, 64, 69]
    for kind in plain + k_quants:
        kq = kind in k_quants
        n, k = (48, 768) if kq else (96, 576)
        w = quantized_weight(kind, n, k)
        x = torch.randn(70, k, generator=_gen(1)).to(torch.bfloat16)
        # the K-quants as test_quant_linear.py checks them: fp32 outputs, tight (exact integer sums)
        y_dtype = torch.float32 if kq else torch.bfloat16
        ids = {m: _ql(s, f"{kind} N={n} K={k} M={m} x bf16", w, x[:m], y_dtype) for m in counts}
        alone_ids = {r: _ql(s, f"{kind} row {r} alone", w, x[r : r + 1], y_dtype) for r in alone}
        x32 = torch.randn(70, k, generator=_gen(3))
        f32_ids = {m: _ql(s, f"{kind} M={m} x fp32 y fp32", w, x32[:m], torch.float32) for m in (9, 70)}
        exact, exact32 = int8_reference(x, w), int8_reference(x32, w)
        float_ref = x.double() @ w.dequantize(torch.float64).T

        @s.check("quant_linear")
        def _(res, ck, kind=kind, kq=kq, ids=ids, alone_ids=alone_ids, f32_ids=f32_ids, exact=exact, exact32=exact32,
              float_ref=float_ref):  # fmt: skip
            for m, cid in ids.items():
                y = res[cid]["y"].double()
                if kq:  # the integer sums are exact; fp32 scaling and accumulation only
                    ck.close(y, exact[:m], 1e-5 * exact.abs().max().item(), 1e-5, f"{kind} M={m} against the exact int8 reference")
                else:  # fp32 sums and the bf16 result's rounding
                    ck.close(y, exact[:m], 1e-3 * exact.abs().max().item(), 2**-7, f"{kind} M={m} against the exact int8 reference")
                    rel = ((y - float_ref[:m]).norm() / float_ref[:m].norm()).item()
                    ck.true(rel < 0.02, f"{kind} M={m}: int8 activations cost {rel:.4f} relative error against x·Wᵀ")
            for m, cid in f32_ids.items():
                want = exact32[:m]
                atol = 1e-5 * want.abs().max().item() if kq else 1e-4
                ck.close(res[cid]["y"].double(), want, atol, 1e-5 if kq else 1e-4, f"{kind} M={m} fp32 in and out")
            for r, cid in alone_ids.items():
                for m, big in ids.items():
                    if r < m:
                        ck.same(res[cid]["y"][0], res[big]["y"][r], f"{kind}: row {r} alone against it among M={m}")
            for m, big in ids.items():
                if m < 70:
                    ck.same(res[big]["y"], res[ids[70]]["y"][:m], f"{kind}: M={m} against the first {m} of M=70")

        # the embedding lookup: rows of W dequantized, bit for bit
        tokens = torch.tensor([0, 17, n - 1, 17, 5])
        params, arrays = _segment_arrays(w)
        params.update(T=len(tokens), K=k)
        eid = s.add("quant_embedding", f"{kind} ids {tokens.tolist()}", params, dict(ids=tokens, **arrays),
                    dict(out=torch.zeros(len(tokens), k)))  # fmt: skip
        want = w.dequantize()[tokens]
        if kq:  # and GGUF's own dequantization of its bytes
            raw = random_k_blocks(kind.split("-")[0], n, k, 0, full_range=kind.endswith("full-range"))
            gg = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind.split("-")[0]])).float()[tokens]
        else:
            gg = None

        @s.check("quant_embedding")
        def _(res, ck, eid=eid, want=want, gg=gg, kind=kind):
            ck.same(res[eid]["out"], want, f"{kind}: rows against QuantizedWeight.dequantize()")
            if gg is not None:
                ck.same(res[eid]["out"], gg, f"{kind}: rows against gguf's dequantize")

    # several segments of every format in one weight, with a bias (bf16 and fp32 outputs)
    k = 512
    kinds = ["Q4_K", "q4", "Q6_K", "q8", "int8-channel", "q4_min", "q8_min"]
    both = qf.QuantizedWeight.cat([quantized_weight(kd, 16 if i % 2 else 32, k, seed=30 + i) for i, kd in enumerate(kinds)])
    n = both.shape[0]
    bias = torch.randn(n, generator=_gen(7)).to(torch.bfloat16)
    xs = {torch.bfloat16: torch.randn(70, k, generator=_gen(8)).to(torch.bfloat16), torch.float32: torch.randn(70, k, generator=_gen(9))}
    dtypes = (torch.bfloat16, torch.float32)
    mixed = {(m, xd, yd): _ql(s, f"{len(kinds)} segments + bias M={m} x {xd} y {yd}", both, xs[xd][:m], yd, bias)
             for m in (1, 9, 70) for xd in dtypes for yd in dtypes}  # fmt: skip
    mixed_alone = {r: _ql(s, f"{len(kinds)} segments + bias row {r} alone", both, xs[torch.bfloat16][r : r + 1],
                          torch.float32, bias) for r in (8, 48, 69)}  # fmt: skip
    nobias = _ql(s, f"{len(kinds)} segments M=9 fp32 no bias", both, xs[torch.bfloat16][:9], torch.float32)
    mixed_ref = {xd: int8_reference(x, both) + bias.double() for xd, x in xs.items()}

    @s.check("quant_linear")
    def _(res, ck):
        for (m, xd, yd), cid in mixed.items():
            what = f"mixed segments + bias M={m} x {xd} y {yd}"
            if yd == torch.bfloat16:  # test_mixed_segments_bias_and_fp32_input's tolerances
                ck.close(res[cid]["y"].double(), mixed_ref[xd][:m], 2e-2, 2**-7, what)
            else:
                ck.close(res[cid]["y"].double(), mixed_ref[xd][:m], 1e-4, 1e-4, what)
        for r, cid in mixed_alone.items():
            ck.same(res[cid]["y"][0], res[mixed[(70, torch.bfloat16, torch.float32)]]["y"][r],
                    f"mixed segments: row {r} alone against M=70")  # fmt: skip
        ck.close(res[nobias]["y"].double(), mixed_ref[torch.bfloat16][:9] - bias.double(), 1e-4, 1e-4,
                 "mixed segments M=9 without bias")  # fmt: skip

    # Q6_K's largest integer sums (test_q6_k_extremes_stay_exact_in_the_integer_sums)
    raw = random_k_blocks("Q6_K", 16, 256, full_range=True)
    raw[:, :192] = 0
    raw[:, 192:208] = 0x80
    w6 = qf.from_gguf("Q6_K", raw, 16, 256)
    x6 = torch.full((2, 256), 3.0)
    x6[1, 1::2] = -3.0
    ext = _ql(s, "Q6_K codes 0 under scales -128, x ±3", w6, x6, torch.float32)
    ext_ref = int8_reference(x6, w6)

    @s.check("quant_linear")
    def _(res, ck):
        ck.close(res[ext]["y"].double(), ext_ref, 1e-6, 1e-6, "Q6_K extremes")

    tokens = torch.tensor([0, 31, 32, 63, 64, n - 1, 40])  # across the segments' edges
    params, arrays = _segment_arrays(both)
    params.update(T=len(tokens), K=k)
    emb = s.add("quant_embedding", "mixed segments", params, dict(ids=tokens, **arrays), dict(out=torch.zeros(len(tokens), k)))

    @s.check("quant_embedding")
    def _(res, ck):
        ck.same(res[emb]["out"], both.dequantize()[tokens], "mixed segments: rows against dequantize()")


# ---- decode attention ------------------------------------------------------------------------


def _decode_pools(dtype, num_kv_heads, head_dim, block_size, num_blocks, g):
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    return k, v


def _decode_call(s, desc, q, k, v, tables, lens, scale, ks=None, vs=None, starts=None, lse=False, softcap=None) -> str:
    pool = 2 if ks is not None else 1 if k.dtype == torch.float32 else 0
    b, nh, hd = q.shape
    out_dtype = torch.float32 if lse else q.dtype  # the _lse binding's outputs are fp32
    params = dict(q_bf16=int(q.dtype == torch.bfloat16), pool=pool, B=b, num_heads=nh, num_kv_heads=k.shape[2],
                  head_dim=hd, block_size=k.shape[1], max_blocks=tables.shape[1], scale=float(scale),
                  out_bf16=int(out_dtype == torch.bfloat16))  # fmt: skip
    if softcap is not None:
        params["softcap"] = softcap
    outs = dict(out=torch.full(q.shape, float("nan"), dtype=out_dtype))
    if lse:
        outs["lse"] = torch.full((b, nh), float("nan"))
    return s.add("decode_attention", desc, params,
                 dict(q=q, k_pool=k, v_pool=v, k_scale=ks, v_scale=vs, block_tables=tables, context_lens=lens,
                      start_positions=starts), outs)  # fmt: skip


def _reference_rows(q, k_pool, v_pool, slots, scale, softcap=None):
    """test_shared_prefix_attention.py's explicit reference: one row over the positions at
    `slots` in fp32: (out [N_q, H], lse [N_q])."""
    num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[2]
    if len(slots) == 0:
        return torch.zeros(num_heads, head_dim), torch.full((num_heads,), -math.inf)
    k = k_pool.reshape(-1, num_kv_heads, head_dim)[slots].float()
    v = v_pool.reshape(-1, num_kv_heads, head_dim)[slots].float()
    rep = num_heads // num_kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("hd,shd->hs", q.float(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("hs,shd->hd", torch.exp(scores - lse[:, None]), v), lse


def decode_cases(s: Suite) -> None:
    # (N_q, N_kv, H, context lengths, block size): g = 1, 2, 3, 4, 8; head dims 64 and 128;
    # lengths within one tile, across tiles and across splits of 256 (merged in order)
    shapes = [
        (4, 4, 64, [5, 16, 48, 300], 16),
        (4, 2, 128, [1, 17, 257, 33], 16),
        (9, 3, 64, [70, 300, 2], 16),
        (8, 2, 64, [100, 600], 32),
        (8, 1, 128, [40, 513], 16),
    ]
    for si, (nh, nkv, hd, lens, bs) in enumerate(shapes):
        for pool in ("bf16", "fp32", "int8-bf16q", "int8-fp32q"):
            g = _gen(100 + si)
            dtype = torch.float32 if pool in ("fp32", "int8-fp32q") else torch.bfloat16
            max_blocks = -(-max(lens) // bs)
            num_blocks = max(64, max_blocks + 4)
            k, v = _decode_pools(dtype, nkv, hd, bs, num_blocks, g)
            q = torch.randn(len(lens), nh, hd, generator=g).to(dtype)
            tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in lens]).to(torch.int32)
            lens_t = torch.tensor(lens, dtype=torch.int32)
            ctx = torch.arange(max(lens))
            slots = tables[:, ctx // bs].long() * bs + ctx % bs
            mask = (ctx.unsqueeze(0) < lens_t.unsqueeze(1)).view(len(lens), 1, 1, -1)
            meta = AttentionMetadata(None, len(lens), slots, mask, lens_t, tables, [])
            scale = hd**-0.5
            int8 = pool.startswith("int8")
            ks = vs = None
            if int8:
                (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
                expected = decode_attention(q.float(), kq, vq, meta, scale, ks, vs)
                unquantized = decode_attention(q.float(), k.float(), v.float(), meta, scale)
                k, v = kq, vq
            else:
                expected = decode_attention(q.float(), k.float(), v.float(), meta, scale)
            name = f"{pool} pool g={nh // nkv} H={hd} lens {lens}"
            batch = _decode_call(s, name, q, k, v, tables, lens_t, scale, ks, vs)
            alone = [_decode_call(s, f"{name}: row {i} alone", q[i : i + 1], k, v, tables[i : i + 1], lens_t[i : i + 1],
                                  scale, ks, vs) for i in range(len(lens))]  # fmt: skip

            @s.check("decode_attention")
            def _(res, ck, name=name, batch=batch, alone=alone, expected=expected, pool=pool, dtype=dtype,
                  unq=unquantized if int8 else None):  # fmt: skip
                got = res[batch]["out"].float()
                if pool == "bf16":
                    ck.close(got, expected, 1e-2, 1e-2, f"{name} against the reference")
                elif pool == "fp32":
                    ck.close(got, expected, 1e-5, 1e-5, f"{name} against the reference")
                else:  # K/V exact (int8 times fp32 scales): fp32 summation order and the output's rounding only
                    ck.close(got, expected, 1e-5, 1e-5 if dtype == torch.float32 else 2**-8, f"{name} against the int8 reference")
                    ck.close(got, unq, 5e-2, 5e-2, f"{name} against the unquantized cache")
                for i, cid in enumerate(alone):
                    ck.same(res[cid]["out"][0], res[batch]["out"][i], f"{name}: row {i} alone against it in the batch")

    # the _lse variant: each row's range [start, len) (one empty), fp32 outputs and the lse
    ranges = [(0, 1), (16, 16), (32, 33), (7, 200), (64, 364), (0, 300), (48, 49), (160, 170), (0, 600)]
    for nh, nkv, hd in [(9, 3, 64), (8, 2, 128)]:
        for pool in ("bf16", "fp32", "int8-bf16q", "int8-fp32q"):
            g = _gen(200 + hd)
            dtype = torch.float32 if pool in ("fp32", "int8-fp32q") else torch.bfloat16
            B, bs = len(ranges), 16
            max_blocks = -(-max(e for _, e in ranges) // bs)
            k, v = _decode_pools(dtype, nkv, hd, bs, B * max_blocks + 1, g)
            tables = torch.randperm(B * max_blocks + 1, generator=g)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
            q = torch.randn(B, nh, hd, generator=g).to(dtype)
            starts = torch.tensor([a for a, _ in ranges], dtype=torch.int32)
            lens = torch.tensor([e for _, e in ranges], dtype=torch.int32)
            scale = hd**-0.5
            int8 = pool.startswith("int8")
            ks = vs = None
            kf, vf = k, v
            if int8:
                (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
                kf, vf = dequantize_kv(k, ks, torch.float32), dequantize_kv(v, vs, torch.float32)
            refs = []
            for b, (a, e) in enumerate(ranges):
                pos = torch.arange(a, e)
                refs.append(_reference_rows(q[b], kf, vf, tables[b][pos // bs].long() * bs + pos % bs, scale))
            name = f"lse {pool} pool g={nh // nkv} H={hd}"
            cid = _decode_call(s, f"{name} ranges {ranges}", q, k, v, tables, lens, scale, ks, vs, starts, lse=True)
            # from 0 the same sums as the plain kernel, whose output is this fp32 one rounded
            live = lens > 0
            zero = _decode_call(s, f"{name} from 0", q[live], k, v, tables[live], lens[live], scale, ks, vs,
                                torch.zeros(int(live.sum()), dtype=torch.int32), lse=True)  # fmt: skip
            plain = _decode_call(s, f"{name}: the plain kernel", q[live], k, v, tables[live], lens[live], scale, ks, vs)
            tol = 1e-5 if pool == "fp32" else 1e-2

            @s.check("decode_attention")
            def _(res, ck, name=name, cid=cid, zero=zero, plain=plain, refs=refs, tol=tol, dtype=dtype):
                out, lse = res[cid]["out"], res[cid]["lse"]
                for b, (ro, rl) in enumerate(refs):
                    ck.close(out[b], ro, tol, tol, f"{name} row {b} range {ranges[b]}: out against the reference")
                    ck.close(lse[b], rl, 1e-4, 1e-5, f"{name} row {b} range {ranges[b]}: lse against the reference")
                ck.same(out[1], torch.zeros_like(out[1]), f"{name}: an empty range's out is 0")
                ck.true(bool(torch.all(lse[1] == -math.inf)), f"{name}: an empty range's lse is -inf")
                ck.same(res[zero]["out"].to(dtype), res[plain]["out"], f"{name}: from 0, rounded, against the plain kernel")


# ---- prefill attention -----------------------------------------------------------------------



def _prefill_call(s, desc, q, k, v, prefills, scale, ks=None, vs=None, sharing=None, softcap=None) -> str:
    rows, offset = [], 0
    for seg in prefills:
        rows.append((seg.query_start, seg.num_new, seg.num_cached, offset))
        offset += seg.context_slots.numel()
    slots = torch.cat([seg.context_slots for seg in prefills]).long()
    arrays = dict(q=q, k_pool=k, v_pool=v, k_scale=ks, v_scale=vs, slots=slots, segments=torch.tensor(rows, dtype=torch.long))
    if sharing is not None:
        arrays["leader"] = torch.tensor([a for a, _ in sharing], dtype=torch.long)
        arrays["shared_len"] = torch.tensor([b for _, b in sharing], dtype=torch.long)
    params = dict(num_heads=q.shape[1], num_kv_heads=k.shape[2], head_dim=q.shape[2], num_segments=len(prefills),
                  scale=float(scale))  # fmt: skip
    if softcap is not None:
        params["softcap"] = softcap
    return s.add("prefill_attention", desc, params, arrays, dict(out=torch.full_like(q, float("nan"))))


def prefill_cases(s: Suite) -> None:
    shapes = [
        (9, 3, 64, 16, [(0, 17), (33, 7), (100, 1), (5, 100)]),  # partial blocks, cached history
        (4, 4, 32, 4, [(0, 5), (20, 50)]),  # g = 1, blocks of 4 slots
        (8, 2, 128, 32, [(0, 77), (64, 64)]),
        (8, 1, 64, 16, [(0, 130)]),  # g = 8
    ]
    for si, (nh, nkv, hd, bs, segments) in enumerate(shapes):
        for int8 in (False, True):
            q, k, v, prefills = prefill_case(segments, nh, nkv, hd, bs, seed=300 + si)
            scale = hd**-0.5
            meta = AttentionMetadata(None, 0, None, None, None, None, prefills)
            expected, unq = torch.empty(q.shape), None
            ks = vs = None
            if int8:
                (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
                prefill_attention(q.float(), k8, v8, meta, scale, expected, ks, vs)
                unq = torch.empty(q.shape)
                prefill_attention(q.float(), k.float(), v.float(), meta, scale, unq)
                kp, vp = k8, v8
            else:
                prefill_attention(q.float(), k.float(), v.float(), meta, scale, expected)
                kp, vp = k, v
            name = f"{'int8' if int8 else 'bf16'} pools g={nh // nkv} H={hd} block {bs} segments (S0, m) {segments}"
            whole = _prefill_call(s, name, q, kp, vp, prefills, scale, ks, vs)
            # each segment alone in its own call, then each prompt in two chunks, the second over
            # the first as cached history: a row's bits depend on its own query and context only
            alone, chunks = [], []
            for j, seg in enumerate(prefills):
                rows = slice(seg.query_start, seg.query_start + seg.num_new)
                one = PrefillSegment(0, seg.num_new, seg.num_cached, seg.context_slots, None)
                alone.append((rows, _prefill_call(s, f"{name}: segment {j} alone", q[rows].contiguous(), kp, vp, [one],
                                                  scale, ks, vs)))  # fmt: skip
                if seg.num_new >= 2:
                    cut = seg.num_new // 3 + 1
                    for lo, hi in ((0, cut), (cut, seg.num_new)):
                        part = PrefillSegment(0, hi - lo, seg.num_cached + lo, seg.context_slots[: seg.num_cached + hi], None)
                        r = slice(seg.query_start + lo, seg.query_start + hi)
                        chunks.append((r, _prefill_call(s, f"{name}: segment {j} chunk [{lo}, {hi})",
                                                        q[r].contiguous(), kp, vp, [part], scale, ks, vs)))  # fmt: skip

            @s.check("prefill_attention")
            def _(res, ck, name=name, whole=whole, alone=alone, chunks=chunks, expected=expected, unq=unq):
                got = res[whole]["out"].float()
                # probabilities and the output each rounded to bf16 once (int8: K/V exact in the tiles)
                ck.close(got, expected, 2e-2, 2e-2, f"{name} against the reference")
                if unq is not None:
                    ck.close(got, unq, 6e-2, 6e-2, f"{name} against the unquantized cache")
                for rows, cid in alone:
                    ck.same(res[cid]["out"], res[whole]["out"][rows], f"{name}: rows {rows.start}-{rows.stop - 1} alone")
                for rows, cid in chunks:
                    ck.same(res[cid]["out"], res[whole]["out"][rows],
                            f"{name}: rows {rows.start}-{rows.stop - 1} as a chunk over cached history")  # fmt: skip

    # segments whose cached history starts with the same 64 positions (a system prompt): the
    # members read their leader's packed K/V, the same values, so the same bits
    for int8 in (False, True):
        g = _gen(400)
        nh, nkv, hd, bs = 6, 2, 64, 16
        members = [(80, 10), (70, 20), (64, 5)]
        shared_blocks = 4
        own = [-(-(s0 + m) // bs) - shared_blocks for s0, m in members]
        num_blocks = shared_blocks + sum(own) + 2
        k = torch.randn(num_blocks, bs, nkv, hd, generator=g).bfloat16()
        v = torch.randn(num_blocks, bs, nkv, hd, generator=g).bfloat16()
        q = torch.randn(sum(m for _, m in members), nh, hd, generator=g).bfloat16()
        order = torch.randperm(num_blocks, generator=g)
        used, start, prefills = shared_blocks, 0, []
        for (s0, m), n in zip(members, own):
            blocks = torch.cat([order[:shared_blocks], order[used : used + n]])
            used += n
            slots = (blocks.unsqueeze(1) * bs + torch.arange(bs)).reshape(-1)[: s0 + m]
            prefills.append(PrefillSegment(start, m, s0, slots, rectangular_causal_bias(s0, m, torch.float32)))
            start += m
        ks = vs = None
        if int8:
            (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
        name = f"{'int8' if int8 else 'bf16'} pools, 3 segments over a shared 64-position prefix"
        own_read = _prefill_call(s, f"{name}: each its own", q, k, v, prefills, 0.125, ks, vs)
        shared = _prefill_call(s, f"{name}: read once", q, k, v, prefills, 0.125, ks, vs, sharing=[(0, 0), (0, 64), (0, 64)])

        @s.check("prefill_attention")
        def _(res, ck, name=name, own_read=own_read, shared=shared):
            ck.same(res[shared]["out"], res[own_read]["out"], f"{name}: shared against each reading its own")
            ck.true(bool(torch.isfinite(res[shared]["out"].float()).all()), f"{name}: finite")


# ---- shared-prefix attention, merge -----------------------------------------------------------


def shared_prefix_cases(s: Suite) -> None:
    bs = 16
    for nh, nkv, hd in [(9, 3, 64), (8, 2, 128)]:
        for n, prefix_len, int8 in [(1, 16, False), (3, 40, False), (16, 256, False), (5, 257, False), (2, 600, False),
                                    (3, 40, True), (16, 256, True), (5, 300, True)]:  # fmt: skip
            g = _gen(500 + n + prefix_len)
            nblocks = -(-prefix_len // bs)
            num_blocks = nblocks + 2
            k = torch.randn(num_blocks, bs, nkv, hd, generator=g).bfloat16()
            v = torch.randn(num_blocks, bs, nkv, hd, generator=g).bfloat16()
            blocks = torch.randperm(num_blocks, generator=g)[:nblocks].to(torch.int32)
            q = torch.randn(n, nh, hd, generator=g).bfloat16()
            scale = hd**-0.5
            ks = vs = None
            kf, vf = k, v
            if int8:
                (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
                kf, vf = dequantize_kv(k, ks, torch.float32), dequantize_kv(v, vs, torch.float32)
            pos = torch.arange(prefix_len)
            slots = blocks[pos // bs].long() * bs + pos % bs
            refs = [_reference_rows(q[b], kf, vf, slots, scale) for b in range(n)]
            name = f"{'int8' if int8 else 'bf16'} pools g={nh // nkv} H={hd} n={n} prefix {prefix_len}"

            def call(desc, qq):
                params = dict(prefix_len=prefix_len, n=qq.shape[0], num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                              block_size=bs, scale=float(scale))  # fmt: skip
                return s.add("shared_prefix_attention", desc, params,
                             dict(q=qq, k_pool=k, v_pool=v, k_scale=ks, v_scale=vs, blocks=blocks),
                             dict(out=torch.full(qq.shape, float("nan")), lse=torch.full(qq.shape[:2], float("nan"))))  # fmt: skip

            group = call(name, q)
            picked = sorted({0, n // 2, n - 1})
            alone = {b: call(f"{name}: row {b} alone", q[b : b + 1]) for b in picked} if n > 1 else {}
            perm = torch.randperm(n, generator=_gen(3))
            permuted = call(f"{name}: rows permuted", q[perm].contiguous()) if n > 1 else None

            @s.check("shared_prefix_attention")
            def _(res, ck, name=name, group=group, alone=alone, permuted=permuted, perm=perm, refs=refs):
                out, lse = res[group]["out"], res[group]["lse"]
                for b, (ro, rl) in enumerate(refs):
                    # bf16 probabilities for the PV product: the decode kernel's tolerance
                    ck.close(out[b], ro, 1e-2, 1e-2, f"{name} row {b}: out against the reference")
                    ck.close(lse[b], rl, 1e-4, 1e-5, f"{name} row {b}: lse against the reference")
                for b, cid in alone.items():
                    ck.same(res[cid]["out"][0], out[b], f"{name}: row {b} alone, out")
                    ck.same(res[cid]["lse"][0], lse[b], f"{name}: row {b} alone, lse")
                if permuted is not None:
                    ck.same(res[permuted]["out"], out[perm], f"{name}: permuted rows, out")
                    ck.same(res[permuted]["lse"], lse[perm], f"{name}: permuted rows, lse")


def softcap_cases(s: Suite) -> None:
    """Gemma 2's soft-capped scores (test_softcap_attention.py's cases, fewer): the decode kernel
    on bf16 and int8 pools, the prefill kernel over cached history, the shared-prefix kernel,
    each against the capping reference and a row's bits against it alone."""
    cap, bs = 1.5, 16
    nh, nkv, hd, lens = 8, 4, 256, [40, 300]  # Gemma-2-2B's heads
    for pool in ("bf16", "int8"):
        g = _gen(900)
        max_blocks = -(-max(lens) // bs)
        num_blocks = 2 * max_blocks + 1
        k, v = _decode_pools(torch.bfloat16, nkv, hd, bs, num_blocks, g)
        q = (3 * torch.randn(len(lens), nh, hd, generator=g)).bfloat16()
        tables = torch.randperm(num_blocks, generator=g)[: 2 * max_blocks].view(2, max_blocks).to(torch.int32)
        lens_t = torch.tensor(lens, dtype=torch.int32)
        ctx = torch.arange(max(lens))
        slots = tables[:, ctx // bs].long() * bs + ctx % bs
        meta = AttentionMetadata(None, 2, slots, (ctx.unsqueeze(0) < lens_t.unsqueeze(1)).view(2, 1, 1, -1), lens_t, tables, [])
        scale, ks, vs = hd**-0.5, None, None
        if pool == "int8":
            (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
            expected = decode_attention(q.float(), k, v, meta, scale, ks, vs, softcap=cap)
        else:
            expected = decode_attention(q.float(), k.float(), v.float(), meta, scale, softcap=cap)
        name = f"softcap {cap} {pool} pool g=2 H=256 lens {lens}"
        batch = _decode_call(s, name, q, k, v, tables, lens_t, scale, ks, vs, softcap=cap)
        alone = _decode_call(s, f"{name}: row 1 alone", q[1:], k, v, tables[1:], lens_t[1:], scale, ks, vs, softcap=cap)

        @s.check("decode_attention")
        def _(res, ck, name=name, batch=batch, alone=alone, expected=expected):
            ck.close(res[batch]["out"].float(), expected, 1e-2, 1e-2, f"{name} against the capping reference")
            ck.same(res[alone]["out"][0], res[batch]["out"][1], f"{name}: row 1 alone against it in the batch")

    q, k, v, prefills = prefill_case([(0, 70), (40, 9)], nh, nkv, hd, bs, seed=901)
    q = (3 * q.float()).bfloat16()
    meta = AttentionMetadata(None, 0, None, None, None, None, prefills)
    expected = torch.empty(q.shape)
    prefill_attention(q.float(), k.float(), v.float(), meta, hd**-0.5, expected, softcap=cap)
    name = f"softcap {cap} prefill g=2 H=256 segments (0, 70), (40, 9)"
    whole = _prefill_call(s, name, q, k, v, prefills, hd**-0.5, softcap=cap)
    seg = copy.copy(prefills[1])
    rows = slice(seg.query_start, seg.query_start + seg.num_new)
    seg.query_start = 0
    alone = _prefill_call(s, f"{name}: segment 1 alone", q[rows].contiguous(), k, v, [seg], hd**-0.5, softcap=cap)

    @s.check("prefill_attention")
    def _(res, ck, name=name, whole=whole, alone=alone, expected=expected, rows=rows):
        ck.close(res[whole]["out"].float(), expected, 2e-2, 2e-2, f"{name} against the capping reference")
        ck.same(res[alone]["out"], res[whole]["out"][rows], f"{name}: segment 1 alone against it beside the other")

    g = _gen(902)
    n, prefix_len = 3, 280
    k, v = _decode_pools(torch.bfloat16, nkv, hd, bs, 20, g)
    blocks = torch.randperm(20, generator=g)[:18].to(torch.int32)
    q = (3 * torch.randn(n, nh, hd, generator=g)).bfloat16()
    pos = torch.arange(prefix_len)
    slots = blocks[pos // bs].long() * bs + pos % bs
    refs = [_reference_rows(q[b], k, v, slots, hd**-0.5, softcap=cap) for b in range(n)]
    name = f"softcap {cap} shared prefix g=2 H=256 n={n} prefix {prefix_len}"

    def call(desc, qq):
        params = dict(prefix_len=prefix_len, n=qq.shape[0], num_heads=nh, num_kv_heads=nkv, head_dim=hd, block_size=bs,
                      scale=float(hd**-0.5), softcap=cap)  # fmt: skip
        return s.add("shared_prefix_attention", desc, params, dict(q=qq, k_pool=k, v_pool=v, blocks=blocks),
                     dict(out=torch.full(qq.shape, float("nan")), lse=torch.full(qq.shape[:2], float("nan"))))

    group, alone = call(name, q), call(f"{name}: row 2 alone", q[2:])

    @s.check("shared_prefix_attention")
    def _(res, ck, name=name, group=group, alone=alone, refs=refs):
        for b, (ro, rl) in enumerate(refs):
            ck.close(res[group]["out"][b], ro, 1e-2, 1e-2, f"{name} row {b}: out against the capping reference")
            ck.close(res[group]["lse"][b], rl, 1e-4, 1e-5, f"{name} row {b}: lse against the capping reference")
        ck.same(res[alone]["out"][0], res[group]["out"][2], f"{name}: row 2 alone, out")


def merge_cases(s: Suite) -> None:
    """test_merge_is_one_softmax_over_the_concatenated_keys's math: two parts of each row's keys,
    any split (empty parts too); 70 rows, past the 64 that run on one thread."""
    g = _gen(11)
    R, S, H = 70, 40, 64
    scores = torch.randn(R, S, generator=g) * 3
    values = torch.randn(S, H, generator=g)

    def part(lo, hi):
        if lo == hi:  # an empty part's output is never read
            return torch.full((R, H), float("nan")), torch.full((R,), -math.inf)
        lse = torch.logsumexp(scores[:, lo:hi], dim=-1)
        return torch.exp(scores[:, lo:hi] - lse[:, None]) @ values[lo:hi], lse

    def call(desc, oa, la, ob, lb, bf16):
        out = {"out_bf16" if bf16 else "out_f32": torch.zeros(R, H, dtype=torch.bfloat16 if bf16 else torch.float32),
               "lse": torch.zeros(R)}  # fmt: skip
        return s.add("merge_attention_states", desc, dict(rows=R, H=H), dict(xa=oa, la=la, xb=ob, lb=lb), out)

    whole_out, whole_lse = part(0, S)
    splits = {}
    for split in [0, 1, 17, S - 1, S]:
        (oa, la), (ob, lb) = part(0, split), part(split, S)
        splits[split] = (call(f"split at {split}, fp32", oa, la, ob, lb, False), call(f"split at {split}, bf16", oa, la, ob, lb, True))
    nan, empty = torch.full((R, H), float("nan")), torch.full((R,), -math.inf)
    both_empty = call("two empty parts", nan, empty, nan, empty, True)
    o, lse_o = torch.randn(R, H, generator=g), torch.randn(R, generator=g)
    one_empty = call("an empty part (inf outputs) and another", torch.full((R, H), math.inf), empty, o, lse_o, False)

    @s.check("merge_attention_states")
    def _(res, ck):
        for split, (f32, b16) in splits.items():
            ck.close(res[f32]["out_f32"], whole_out, 1e-5, 1e-5, f"split at {split}: out against one softmax")
            ck.close(res[f32]["lse"], whole_lse, 1e-5, 1e-5, f"split at {split}: lse against one softmax")
            ck.same(res[b16]["out_bf16"], res[f32]["out_f32"].bfloat16(), f"split at {split}: the bf16 output is the fp32 one rounded")
        ck.same(res[both_empty]["out_bf16"], torch.zeros(R, H, dtype=torch.bfloat16), "two empty parts give 0")
        ck.true(bool(torch.all(res[both_empty]["lse"] == -math.inf)), "two empty parts give lse -inf")
        ck.same(res[one_empty]["out_f32"], o, "one empty part: the other's out")
        ck.same(res[one_empty]["lse"], lse_o, "one empty part: the other's lse")


# ---- norm, RoPE, activations, argmax ---------------------------------------------------------


def norm_cases(s: Suite) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for with_residual in (False, True):
            for T, D in ((37, 576), (5, 80)):  # 80: a tail of 16 past the 32-wide loop
                g = _gen(T + D)
                x = (torch.randn(T, D, generator=g) * 3).to(dtype)
                residual = torch.randn(T, D, generator=g).to(dtype)
                weight = torch.randn(D, generator=g).to(dtype)
                res_ref = residual.clone()
                expected = RMSNorm(weight, 1e-5)(x.clone(), res_ref if with_residual else None)  # the plain-torch path
                name = f"{str(dtype)[6:]} T={T} D={D}{' with residual' if with_residual else ''}"
                bf16 = int(dtype == torch.bfloat16)

                def call(desc, rows):
                    outs = dict(out=torch.zeros(len(rows), D, dtype=dtype))
                    if with_residual:
                        outs["residual"] = residual[rows].clone()
                    return s.add("rms_norm", desc, dict(T=len(rows), D=D, eps=1e-5, bf16=bf16), dict(x=x[rows], w=weight), outs)

                whole = call(name, list(range(T)))
                last = call(f"{name}: row {T - 1} alone", [T - 1])

                @s.check("rms_norm")
                def _(res, ck, name=name, whole=whole, last=last, expected=expected, res_ref=res_ref, dtype=dtype,
                      with_residual=with_residual, T=T):  # fmt: skip
                    # the same order of operations: only the last-place rounding of 1/sqrt and of the product
                    ck.close(res[whole]["out"].float(), expected.float(), 1e-5, 1e-5 if dtype == torch.float32 else 8e-3,
                             f"{name} against the torch layer")  # fmt: skip
                    if with_residual:
                        ck.same(res[whole]["residual"], res_ref, f"{name}: the updated residual")
                    ck.same(res[last]["out"][0], res[whole]["out"][T - 1], f"{name}: the last row alone")


def _rope_inputs(dtype, T, nq, nkv, hd, blocks, bs, seed):
    g = _gen(seed)
    qkv = (torch.randn(T, (nq + 2 * nkv) * hd, generator=g) * 3).to(dtype)
    qkv[2, nq * hd : (nq + 1) * hd] = 0  # an all-zero K row: scale 0 in the int8 pools
    positions = torch.tensor([0, 1, 2, 3, 9, 10, 40, 63][:T])
    slots = torch.randperm(blocks * bs, generator=g)[:T]
    angles = torch.arange(64).float()[:, None] * torch.rand(hd // 2, generator=g)[None]
    return qkv, positions, slots, angles.cos(), angles.sin()


def rope_cases(s: Suite) -> None:
    """rope_and_cache against rotate-half in float64 (norm_rope_act.h's formula, apply_rotary's),
    V copied bit for bit; rope_and_cache_int8 as test_int8_kv_kernels.py checks it: its bytes and
    scales are quantize_kv of what the float kernel of the same level writes, bit for bit."""
    for dtype in (torch.float32, torch.bfloat16):
        for T, nq, nkv, hd in ((7, 4, 2, 64), (8, 8, 2, 128)):
            blocks, bs = 4, 4
            qkv, positions, slots, cos, sin = _rope_inputs(dtype, T, nq, nkv, hd, blocks, bs, seed=hd)
            params = dict(bf16=int(dtype == torch.bfloat16), T=T, width=qkv.shape[1], num_heads=nq, num_kv_heads=nkv, head_dim=hd)
            inputs = dict(qkv=qkv, positions=positions, cos=cos, sin=sin, slots=slots)
            name = f"{str(dtype)[6:]} T={T} N_q={nq} N_kv={nkv} H={hd}"
            fl = s.add("rope_and_cache", name, params, inputs,
                       dict(q_out=torch.zeros(T, nq, hd, dtype=dtype), k_pool=torch.zeros(blocks, bs, nkv, hd, dtype=dtype),
                            v_pool=torch.zeros(blocks, bs, nkv, hd, dtype=dtype)))  # fmt: skip
            i8 = s.add("rope_and_cache_int8", name, params, inputs,
                       dict(q_out=torch.zeros(T, nq, hd, dtype=dtype),
                            k_pool=torch.zeros(blocks, bs, nkv, hd, dtype=torch.int8),
                            v_pool=torch.zeros(blocks, bs, nkv, hd, dtype=torch.int8),
                            k_scale=torch.full((blocks, bs, nkv), -1.0), v_scale=torch.full((blocks, bs, nkv), -1.0)))  # fmt: skip
            heads = qkv.double().view(T, nq + 2 * nkv, hd)
            c, sn = cos.double()[positions][:, None], sin.double()[positions][:, None]
            a, b = heads[..., : hd // 2], heads[..., hd // 2 :]
            rotated = torch.cat([a * c - b * sn, b * c + a * sn], dim=-1)
            q_ref, k_ref, v_ref = rotated[:, :nq], rotated[:, nq : nq + nkv], qkv.view(T, nq + 2 * nkv, hd)[:, nq + nkv :]
            # fp32: one FMA each; bf16: + one rounding, which can land a step (2^-7 relative) away
            # from the float64 value's
            rtol = 1e-5 if dtype == torch.float32 else 2**-7
            untouched = torch.ones(blocks * bs, dtype=torch.bool)
            untouched[slots] = False

            @s.check("rope_and_cache")
            def _(res, ck, name=name, fl=fl, q_ref=q_ref, k_ref=k_ref, v_ref=v_ref, rtol=rtol, slots=slots, untouched=untouched,
                  nkv=nkv, hd=hd):  # fmt: skip
                r = res[fl]
                ck.close(r["q_out"].double(), q_ref, 1e-5, rtol, f"{name}: Q against rotate-half in float64")
                ck.close(r["k_pool"].view(-1, nkv, hd)[slots].double(), k_ref, 1e-5, rtol, f"{name}: K in its slots")
                ck.same(r["v_pool"].view(-1, nkv, hd)[slots], v_ref, f"{name}: V in its slots")
                for pool in ("k_pool", "v_pool"):
                    ck.same(r[pool].view(-1, nkv, hd)[untouched], torch.zeros_like(r[pool].view(-1, nkv, hd)[untouched]),
                            f"{name}: {pool}'s other slots untouched")  # fmt: skip

            @s.check("rope_and_cache_int8")
            def _(res, ck, name=name, fl=fl, i8=i8, slots=slots, untouched=untouched, nkv=nkv, hd=hd):
                r, f = res[i8], res[fl]
                ck.same(r["q_out"], f["q_out"], f"{name}: Q against the float kernel's")
                for p, sc, fp in (("k_pool", "k_scale", "k_pool"), ("v_pool", "v_scale", "v_pool")):
                    want_q, want_s = quantize_kv(f[fp].view(-1, nkv, hd)[slots])
                    ck.same(r[p].view(-1, nkv, hd)[slots], want_q, f"{name}: {p} against quantize_kv of the float pool")
                    ck.same(r[sc].view(-1, nkv)[slots], want_s, f"{name}: {sc} against quantize_kv's")
                    ck.true(bool((r[sc].view(-1, nkv)[untouched] == -1).all()), f"{name}: {sc} of other slots untouched")
                ck.true(float(r["k_scale"].view(-1, nkv)[slots[2], 0]) == 0.0, f"{name}: a zero K row has scale 0")


def act_cases(s: Suite) -> None:
    for family, extremes, act in (
        ("silu_and_mul", [-1000.0, -100.0, -88.0, 88.0, 100.0, 1000.0], F.silu),
        ("gelu_tanh_and_mul", [-1e4, -100.0, -10.0, -1e-3, 1e-3, 10.0, 100.0, 1e4], lambda t: F.gelu(t, approximate="tanh")),
    ):
        for dtype in (torch.float32, torch.bfloat16):
            gate_up = (torch.randn(37, 2 * 96, generator=_gen(0)) * 4).to(dtype)
            gate_up[0, : len(extremes)] = torch.tensor(extremes)  # exp over- and underflow
            gate, up = gate_up.float().chunk(2, dim=-1)
            expected = act(gate).to(dtype).float() * up  # the model rounds act(gate) to its dtype before the product
            name = f"{str(dtype)[6:]} T=37 F=96 with extremes"
            params = dict(T=37, F=96, bf16=int(dtype == torch.bfloat16))
            cid = s.add(family, name, params, dict(gate_up=gate_up), dict(out=torch.zeros(37, 96, dtype=dtype)))

            @s.check(family)
            def _(res, ck, cid=cid, name=name, expected=expected, dtype=dtype):
                got = res[cid]["out"].float()
                ck.true(bool(torch.isfinite(got).all()), f"{name}: finite")
                # bf16: two roundings (act, then the product), so a tie can land one bf16 step away
                ck.close(got, expected, 1e-5, 1e-5 if dtype == torch.float32 else 1.6e-2, f"{name} against torch")

    # and GELU as Gemma's MLP reads it in fp32: within a few ulp of torch's tanh form everywhere
    x = torch.linspace(-12, 12, 4800)
    cid = s.add("gelu_tanh_and_mul", "fp32 x in [-12, 12] times 1", dict(T=1, F=4800, bf16=0),
                dict(gate_up=torch.cat([x, torch.ones_like(x)])[None]), dict(out=torch.zeros(1, 4800)))  # fmt: skip

    @s.check("gelu_tanh_and_mul")
    def _(res, ck):
        ck.close(res[cid]["out"][0], F.gelu(x, approximate="tanh"), 1e-6, 1e-6, "fp32 over [-12, 12] against F.gelu")


def argmax_cases(s: Suite) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, 1000, generator=_gen(0)).to(dtype)
        x[3, 17] = x[3, 900] = 50  # a tie: the lower index wins, as torch.argmax
        x[5, -1] = 60  # in the scalar tail
        # rows longer than a chunk (8192): a tie across chunks, a row of -inf (0), the last element
        y = torch.randn(3, 20000, generator=_gen(1)).to(dtype)
        y[0, 100] = y[0, 15000] = 70
        y[1] = -math.inf
        y[2, -1] = 80
        for name, t in ((f"{str(dtype)[6:]} 7x1000 with ties", x), (f"{str(dtype)[6:]} 3x20000 across chunks", y)):
            R, V = t.shape
            cid = s.add("argmax_rows", name, dict(R=R, V=V, bf16=int(dtype == torch.bfloat16)), dict(x=t),
                        dict(out=torch.full((R,), -1, dtype=torch.long)))  # fmt: skip

            @s.check("argmax_rows")
            def _(res, ck, cid=cid, name=name, t=t):
                ck.same(res[cid]["out"], t.argmax(dim=-1), f"{name} against torch.argmax")


def quant_rows_cases(s: Suite) -> None:
    """quant_linear_rows (a token's k routed experts' down projections): row r against its own
    weight, every format in one call; each row's bits those of quant_linear on it alone."""
    kinds = ["q4", "q8", "Q4_K", "q4_min", "int8-channel", "Q6_K", "q8_min"]
    n, k = 48, 512
    weights = [quantized_weight(kind, n, k, seed=20 + r) for r, kind in enumerate(kinds)]
    for x_dtype, y_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)):
        x = torch.randn(len(kinds), k, generator=_gen(9)).to(x_dtype)
        params, arrays = _segment_arrays(qf.QuantizedWeight.cat(weights))
        first = torch.tensor([0] + [len(w.segments) for w in weights]).cumsum(0)
        params.update(R=len(kinds), K=k, x_bf16=int(x_dtype == torch.bfloat16), y_bf16=int(y_dtype == torch.bfloat16))
        name = f"{len(kinds)} rows, each its own weight, x {x_dtype} y {y_dtype}"
        rows = s.add("quant_linear_rows", name, params, dict(x=x, first=first, **arrays),
                     dict(y=torch.zeros(len(kinds), n, dtype=y_dtype)))  # fmt: skip
        alone = [_ql(s, f"{kind} row {r} alone ({name})", w, x[r : r + 1], y_dtype) for r, (kind, w) in enumerate(zip(kinds, weights))]
        exact = torch.cat([int8_reference(x[r : r + 1], w) for r, w in enumerate(weights)])

        @s.check("quant_linear_rows")
        def _(res, ck, rows=rows, alone=alone, exact=exact, name=name):
            y = res[rows]["y"]
            ck.close(y.double(), exact, 1e-3 * exact.abs().max().item(), 2**-7, f"{name}: against the exact int8 reference")
            for r, cid in enumerate(alone):
                ck.same(y[r], res[cid]["y"][0], f"{name}: row {r} against quant_linear on it alone")


def whole_norm_cases(s: Suite) -> None:
    """OLMoE's q/k norms over the whole projections against the torch layer (WholeProjectionNorm
    without ops), from the row's own sums and from given ones; a row alone against the same row
    among others, bit for bit."""
    for dtype in (torch.float32, torch.bfloat16):
        for T, q_size, kv_size in ((7, 256, 64), (3, 80, 40)):  # 80, 40: tails past the 32-wide loop
            g = _gen(q_size + kv_size)
            qkv = (torch.randn(T, q_size + 2 * kv_size, generator=g) * 3).to(dtype)
            q_w, k_w = torch.randn(q_size, generator=g).to(dtype), torch.randn(kv_size, generator=g).to(dtype)
            expected = WholeProjectionNorm(q_w, k_w, q_size, kv_size, 1e-6)(qkv)
            q32, k32 = qkv.float()[:, :q_size], qkv.float()[:, q_size : q_size + kv_size]
            want_sums = torch.stack([q32.pow(2).sum(-1), k32.pow(2).sum(-1)], -1)
            name = f"{str(dtype)[6:]} T={T} q={q_size} kv={kv_size}"
            params = dict(q_size=q_size, kv_size=kv_size, q_width=float(q_size), k_width=float(kv_size), eps=1e-6,
                          bf16=int(dtype == torch.bfloat16))  # fmt: skip

            def call(desc, rows, sums=None):
                inputs = dict(qkv=qkv[rows], q_w=q_w, k_w=k_w, **({} if sums is None else dict(sums=sums)))
                return s.add("whole_projection_norm", desc, dict(params, T=len(rows)), inputs,
                             dict(out=torch.zeros(len(rows), qkv.shape[1], dtype=dtype), sums_out=torch.zeros(len(rows), 2)))
            whole = call(name, list(range(T)))
            given = call(f"{name}: from given sums", list(range(T)), want_sums)
            last = call(f"{name}: row {T - 1} alone", [T - 1])

            @s.check("whole_projection_norm")
            def _(res, ck, name=name, whole=whole, given=given, last=last, expected=expected, want_sums=want_sums,
                  dtype=dtype, T=T):  # fmt: skip
                out = res[whole]["out"]
                ck.close(out.float(), expected.float(), 1e-5, 1e-5 if dtype == torch.float32 else 8e-3, f"{name} against the torch layer")
                ck.close(res[whole]["sums_out"], want_sums, 1e-5, 1e-5, f"{name}: qk_sum_squares")
                ck.close(res[given]["out"].float(), expected.float(), 1e-5, 1e-5 if dtype == torch.float32 else 8e-3,
                         f"{name}: from given sums against the torch layer")  # fmt: skip
                ck.same(res[last]["out"][0], out[T - 1], f"{name}: the last row alone")


def route_cases(s: Suite) -> None:
    """A sparse layer's router against torch's softmax and top k (float64 probabilities): the
    same experts in rank order, the weights within fp32 rounding; a token alone against the
    same token among others, bit for bit; a tie goes to the lower expert."""
    for dtype in (torch.float32, torch.bfloat16):
        for T, D, E, k, renorm in ((9, 256, 16, 4, True), (4, 200, 60, 8, False)):
            g = _gen(D + E)
            x = torch.randn(T, D, generator=g).to(dtype)
            router = torch.randn(E, D, generator=g) * 0.05
            probs = F.linear(x.double(), router.double()).softmax(-1)
            want_w, want_e = probs.topk(k, -1)
            if renorm:
                want_w = want_w / want_w.sum(-1, keepdim=True)
            name = f"{str(dtype)[6:]} T={T} D={D} E={E} k={k}{' renormalised' if renorm else ''}"
            params = dict(D=D, E=E, k=k, renormalise=int(renorm), bf16=int(dtype == torch.bfloat16))

            def call(desc, rows):
                return s.add("moe_route", desc, dict(params, T=len(rows)), dict(x=x[rows], router=router),
                             dict(weights=torch.zeros(len(rows), k), experts=torch.full((len(rows), k), -1, dtype=torch.long)))
            whole = call(name, list(range(T)))
            last = call(f"{name}: token {T - 1} alone", [T - 1])

            @s.check("moe_route")
            def _(res, ck, name=name, whole=whole, last=last, want_w=want_w, want_e=want_e, T=T):
                ck.same(res[whole]["experts"], want_e, f"{name}: the experts, largest first")
                ck.close(res[whole]["weights"], want_w, 1e-7, 2e-5, f"{name}: the weights")
                ck.same(res[last]["experts"][0], res[whole]["experts"][T - 1], f"{name}: the last token alone (experts)")
                ck.same(res[last]["weights"][0], res[whole]["weights"][T - 1], f"{name}: the last token alone (weights)")
    router = torch.zeros(6, 64)
    router[[1, 4]] = 1.0
    router[2] = 0.5
    tie = s.add("moe_route", "a tie between experts 1 and 4", dict(T=1, D=64, E=6, k=3, renormalise=0, bf16=0),
                dict(x=torch.ones(1, 64), router=router), dict(weights=torch.zeros(1, 3), experts=torch.full((1, 3), -1, dtype=torch.long)))  # fmt: skip

    @s.check("moe_route")
    def _(res, ck, tie=tie):
        ck.same(res[tie]["experts"], torch.tensor([[1, 4, 2]]), "a tie goes to the lower expert")


def build_suite() -> Suite:
    s = Suite()
    for make in (gemv_cases, quant_cases, quant_rows_cases, decode_cases, prefill_cases, shared_prefix_cases, softcap_cases,
                 merge_cases, norm_cases, whole_norm_cases, rope_cases, act_cases, argmax_cases, route_cases):  # fmt: skip
        make(s)
    return s
