"""Block-quantized weights in the layout kvserve's quant_linear kernel reads (kernels/quant_linear.cpp).

Every format is w = d·c + m per block of 32 inputs of one output column, c an unsigned
code of 4 or 8 bits, d (and m, where stored) fp16:

| kind     | codes | m                | from                                                    |
| -------- | ----- | ---------------- | ------------------------------------------------------- |
| q8       | 8-bit | −128·d (implied) | GGUF Q8_0 (exact); Q6_K (requantized); int8 of floats    |
| q4       | 4-bit | −8·d (implied)   | GGUF Q4_0 (exact)                                       |
| q4_min   | 4-bit | stored           | GGUF Q4_1 (exact); Q4_K (codes exact, d·sc and dmin·m   |
|          |       |                  | rounded to fp16); int4 of floats                        |
| q8_min   | 8-bit | stored           | GGUF Q5_0, Q5_1 (exact); Q5_K (as Q4_K)                 |
| q4_k     | 4-bit | −dmin·mn         | GGUF Q4_K as stored: d, dmin per 256, 6-bit sc, mn per 32 |
| q6_k     | 6-bit | −32·d·sc         | GGUF Q6_K as stored: d per 256, an int8 sc per 16 inputs |

`--quantization int8` quantizes float weights with one scale per output channel (symmetric,
scales [groups, 1, 16]); `int4` with a scale and a minimum per block of 32.

The packed layout (codes, scales and minima in groups of 16 output columns and blocks of 32
inputs) is the kernels' own, stated, packed, unpacked and cut in kvserve/kernels/layouts.py;
this module only decides what the codes and scales are. `dequantize` is the plain-torch
reference the kernel is tested against.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvserve.kernels import layouts
from kvserve.kernels.layouts import BLOCK, GROUP  # noqa: F401  (re-exported: the packed grid)

# rows packed at a time: the float values a repack or quantization goes through ([rows,
# cols] fp32, and their codes) stay a few tens of MB even for a 128k-row LM head
_CHUNK_ROWS = 2048

KINDS = {"q8": (8, False, 128), "q4": (4, False, 8), "q4_min": (4, True, 0), "q8_min": (8, True, 0),
         "q4_k": (4, True, 0), "q6_k": (6, False, 32)}  # fmt: skip
# the C++ format constants (kernels.h kQuant*)
KIND_CODES = {"q8": 0, "q4": 1, "q4_min": 2, "q8_min": 3, "q4_k": 4, "q6_k": 5}
# kinds that keep GGUF's super-block scales: d (dmin) per SUPER inputs, small scales per block in `sub`
K_QUANT_KINDS = ("q4_k", "q6_k")


@dataclasses.dataclass
class QuantSegment:
    """`rows` output columns of one kind, packed for the kernel."""

    kind: str
    rows: int
    cols: int
    codes: torch.Tensor  # uint8 [rows/16, cols/32, 512, 384 or 256]
    scales: torch.Tensor  # fp16 [rows/16, cols/32 or 1, 16]; K-quants [rows/16, cols/256, 16]
    mins: torch.Tensor | None  # fp16, as scales, where the kind stores m
    source: str  # what it came from, for the start-up report
    sub: torch.Tensor | None = None  # K-quants: uint8 [rows/16, cols/32, 32], each block's small scales

    @property
    def bits(self) -> int:
        return KINDS[self.kind][0]

    @property
    def k_quant(self) -> bool:
        return self.kind in K_QUANT_KINDS

    @property
    def tensors(self) -> list[torch.Tensor]:
        """What the kernel reads of this segment."""
        return [t for t in (self.codes, self.scales, self.mins, self.sub) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclasses.dataclass
class QuantizedWeight:
    """An [out, in] weight as one or more segments stacked by rows (a fused QKV may mix kinds)."""

    segments: list[QuantSegment]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(s.rows for s in self.segments), self.segments[0].cols

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def describe(self) -> str:
        sources = []
        for s in self.segments:
            if s.source not in sources:
                sources.append(s.source)
        return " + ".join(sources)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([dequantize_segment(s) for s in self.segments], dim=0).to(dtype)

    @staticmethod
    def cat(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Rows of several weights stacked (QKV, gate/up): their segments listed in order, not
        copied. quant_linear runs every segment of a projection in one call, so a merged copy
        would buy nothing and cost a transient copy of each layer while the model is built."""
        return QuantizedWeight([s for p in parts for s in p.segments])


def slice_rows(w: QuantizedWeight, lo: int, hi: int) -> QuantizedWeight:
    """Output rows [lo, hi) of `w` (a tensor-parallel column shard), copied out of the packed
    layout without unpacking: whole groups of GROUP rows, so lo and hi must fall on them."""
    if lo % GROUP or hi % GROUP:
        raise ValueError(f"rows [{lo}, {hi}) are not whole groups of {GROUP} packed rows")
    out, start = [], 0
    for seg in w.segments:
        a, b = max(lo, start) - start, min(hi, start + seg.rows) - start  # within the segment
        if a < b:
            out.append(dataclasses.replace(
                seg, rows=b - a, codes=layouts.slice_group_rows(seg.codes, a, b),
                scales=layouts.slice_group_rows(seg.scales, a, b),
                mins=None if seg.mins is None else layouts.slice_group_rows(seg.mins, a, b),
                sub=None if seg.sub is None else layouts.slice_group_rows(seg.sub, a, b),
            ))  # fmt: skip
        start += seg.rows
    return QuantizedWeight(out)


def slice_cols(w: QuantizedWeight, lo: int, hi: int) -> QuantizedWeight:
    """Input columns [lo, hi) of `w` (a tensor-parallel row shard): whole blocks of BLOCK
    columns (whole super-blocks of SUPER for the K-quants), so lo and hi must fall on them
    (ValueError otherwise). A per-output-channel scale (one per row) stays."""
    out = []
    for seg in w.segments:
        params = layouts.slice_super_cols if seg.k_quant else layouts.slice_params_cols
        out.append(dataclasses.replace(
            seg, cols=hi - lo, codes=layouts.slice_block_cols(seg.codes, lo, hi), scales=params(seg.scales, lo, hi),
            mins=None if seg.mins is None else params(seg.mins, lo, hi),
            sub=None if seg.sub is None else layouts.slice_block_cols(seg.sub, lo, hi),
        ))  # fmt: skip
    return QuantizedWeight(out)


packable = layouts.on_grid  # whether an [rows, cols] weight packs


# ---- packing ------------------------------------------------------------------------------


def pack(kind: str, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, source: str) -> QuantizedWeight:
    """A QuantizedWeight from unpacked codes [N, K], scales [N, K/32] (or [N, 1]) and minima."""
    bits, has_min, _ = KINDS[kind]
    n, k = codes.shape
    seg = QuantSegment(
        kind, n, k, layouts.pack_codes(codes.to(torch.uint8), bits), layouts.pack_block_params(d),
        layouts.pack_block_params(m) if has_min else None, source,
    )  # fmt: skip
    return QuantizedWeight([seg])


def dequantize_segment(seg: QuantSegment) -> torch.Tensor:
    """The reference: the segment's weights as fp32 [rows, cols], d·c + m exactly as the kernel's
    embedding lookup (and gguf's dequantize) computes them."""
    bits, has_min, offset = KINDS[seg.kind]
    kb = seg.cols // BLOCK
    codes = layouts.unpack_codes(seg.codes, bits).view(seg.rows, kb, BLOCK)
    if seg.k_quant:  # the super-block's d (dmin) times each block's small scales, exact in fp32
        per_super = layouts.SUPER // BLOCK
        d = layouts.unpack_block_params(seg.scales).float().repeat_interleave(per_super, dim=1)  # [rows, kb]
        first, second = layouts.unpack_block_subs(seg.sub)
        if seg.kind == "q6_k":  # w = (d·sc_h)·(c − 32), sc_h the scale of the input's half
            sc = torch.stack([first.view(torch.int8), second.view(torch.int8)], dim=2).float()  # [rows, kb, 2]
            dh = (d[..., None] * sc).repeat_interleave(BLOCK // 2, dim=2)  # [rows, kb, 32]
            return (dh * (codes.float() - offset)).reshape(seg.rows, seg.cols)
        dmin = layouts.unpack_block_params(seg.mins).float().repeat_interleave(per_super, dim=1)
        return ((d * first.float())[..., None] * codes.float() - (dmin * second.float())[..., None]).reshape(seg.rows, seg.cols)
    d = layouts.unpack_block_params(seg.scales).float()[..., None]  # [rows, blocks or 1, 1]
    m = layouts.unpack_block_params(seg.mins).float()[..., None] if has_min else -float(offset) * d
    return (d * codes.float() + m).reshape(seg.rows, seg.cols)


# ---- from float weights (--quantization int8 | int4) --------------------------------------


def _by_row_chunks(quantize):
    """Quantize a large weight _CHUNK_ROWS rows at a time (one segment each), so the fp32
    intermediates stay small: a 49k × 2048 embedding would need ~1.6 GB of them at once."""

    def run(w: torch.Tensor, *args) -> QuantizedWeight:
        if w.shape[0] <= _CHUNK_ROWS:
            return quantize(w, *args)
        return QuantizedWeight.cat([quantize(w[r : r + _CHUNK_ROWS], *args) for r in range(0, w.shape[0], _CHUNK_ROWS)])

    return run


@_by_row_chunks
def quantize_int8_per_channel(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8, one fp16 scale per output channel (row)."""
    w = w.float()
    d = (w.abs().amax(dim=1, keepdim=True) / 127).to(torch.float16).float()
    q = torch.where(d > 0, torch.round(w / torch.where(d > 0, d, 1)), 0).clamp(-127, 127)
    return pack("q8", (q + 128).to(torch.uint8), d, None, "int8 per output channel")


@_by_row_chunks
def quantize_q8_blocks(w: torch.Tensor, source: str) -> QuantizedWeight:
    """Symmetric int8 per block of 32 (Q8_0's rule): a requantization target for formats
    without a kernel of their own."""
    n, k = w.shape
    blocks = w.float().view(n, k // BLOCK, BLOCK)
    d = (blocks.abs().amax(dim=2, keepdim=True) / 127).to(torch.float16).float()
    q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1)), 0).clamp(-127, 127)
    return pack("q8", (q + 128).to(torch.uint8).view(n, k), d.view(n, -1), None, source)


@_by_row_chunks
def quantize_int4_blocks(w: torch.Tensor) -> QuantizedWeight:
    """Asymmetric int4 per block of 32: d = (max − min) / 15, m = min (Q4_1's rule)."""
    n, k = w.shape
    blocks = w.float().view(n, k // BLOCK, BLOCK)
    lo, hi = blocks.amin(dim=2, keepdim=True), blocks.amax(dim=2, keepdim=True)
    d = ((hi - lo) / 15).to(torch.float16).float()
    m = lo.to(torch.float16).float()
    q = torch.where(d > 0, torch.round((blocks - m) / torch.where(d > 0, d, 1)), 0).clamp(0, 15)
    return pack("q4_min", q.to(torch.uint8).view(n, k), d.view(n, -1), m.view(n, -1), "int4 per block of 32 (scale and minimum)")


# ---- from GGUF blocks ---------------------------------------------------------------------

# GGUF types run natively or repacked; the rest are dequantized at load (with a note)
GGUF_NATIVE = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
GGUF_REPACKED = ("Q5_0", "Q5_1", "Q5_K")


def _f16(raw: np.ndarray, start: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw[..., start : start + 2]).view(np.float16)[..., 0].astype(np.float32))


def from_gguf(type_name: str, raw: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    """One GGUF tensor's blocks (uint8 [rows, bytes per row], rows already in HF order) packed.
    `type_name` one of GGUF_NATIVE + GGUF_REPACKED. Large tensors are packed in chunks of rows
    (one segment each: quant_linear runs a projection's segments in one call)."""
    if rows > _CHUNK_ROWS:
        parts = [from_gguf(type_name, raw[r : r + _CHUNK_ROWS], min(_CHUNK_ROWS, rows - r), cols)
                 for r in range(0, rows, _CHUNK_ROWS)]  # fmt: skip
        return QuantizedWeight.cat(parts)
    kb = cols // BLOCK
    if type_name == "Q8_0":
        blocks = raw.reshape(rows, kb, 34)
        q = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8)).to(torch.int16)
        return pack("q8", (q + 128).to(torch.uint8).view(rows, cols), _f16(blocks, 0), None, "Q8_0 (native)")
    if type_name in ("Q4_0", "Q4_1"):
        header = 2 if type_name == "Q4_0" else 4
        blocks = raw.reshape(rows, kb, header + 16)
        kind = "q4" if type_name == "Q4_0" else "q4_min"
        mins = layouts.pack_block_params(_f16(blocks, 2)) if header == 4 else None
        seg = QuantSegment(
            kind, rows, cols, layouts.pack_nibbles(torch.from_numpy(np.ascontiguousarray(blocks[:, :, header:]))),
            layouts.pack_block_params(_f16(blocks, 0)), mins, f"{type_name} (native)",
        )  # fmt: skip
        return QuantizedWeight([seg])
    if type_name == "Q4_K":
        return _from_q4_k(raw, rows, cols)
    if type_name == "Q6_K":
        return _from_q6_k(raw, rows, cols)
    return _requantized(type_name, raw, rows, cols)


def _k_scales(raw: np.ndarray, rows: int, cols: int):
    """(d·sc, dmin·m) per sub-block of 32 for Q4_K / Q5_K super-blocks, fp32 [rows, cols/32]."""
    import gguf.quants as gq

    supers = raw.reshape(-1, raw.shape[-1] // (cols // 256))
    d = _f16(supers, 0)
    dmin = _f16(supers, 2)
    sc, mn = gq.Q4_K.get_scale_min(np.ascontiguousarray(supers[:, 4:16]))
    scale = d[:, None] * torch.from_numpy(sc.astype(np.float32))
    minimum = dmin[:, None] * torch.from_numpy(mn.astype(np.float32))
    return scale.reshape(rows, cols // BLOCK), minimum.reshape(rows, cols // BLOCK)


def _from_q4_k(raw: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    # super-block of 256: d, dmin (fp16), 12 bytes of 6-bit scales and minima, 128 bytes of
    # nibbles: per 64 inputs, 32 bytes whose low nibbles are inputs 0-31, high ones 32-63
    import gguf.quants as gq

    supers = raw.reshape(-1, 144)
    sc, mn = gq.Q4_K.get_scale_min(np.ascontiguousarray(supers[:, 4:16]))  # [n_super, 8] each
    qs = torch.from_numpy(np.ascontiguousarray(supers[:, 16:])).view(-1, 4, 1, 32)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(rows, cols)
    kb = cols // BLOCK
    seg = QuantSegment(
        "q4_k", rows, cols, layouts.pack_codes(codes, 4),
        layouts.pack_block_params(_f16(supers, 0).view(rows, -1)), layouts.pack_block_params(_f16(supers, 2).view(rows, -1)),
        "Q4_K (native)",
        sub=layouts.pack_block_subs(torch.from_numpy(np.ascontiguousarray(sc)).to(torch.uint8).view(rows, kb),
                                    torch.from_numpy(np.ascontiguousarray(mn)).to(torch.uint8).view(rows, kb)),
    )  # fmt: skip
    return QuantizedWeight([seg])


def _from_q6_k(raw: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    # super-block of 256 (gguf's own reading): 128 bytes of low nibbles, 64 of top 2-bit pairs,
    # 16 int8 scales (one per 16 inputs), d (fp16); q = (low | top << 4) − 32
    supers = raw.reshape(-1, 210)
    n = supers.shape[0]
    ql = supers[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = supers[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = (ql & 0x0F).reshape(n, 8, 32) | ((qh & 0x03).reshape(n, 8, 32) << 4)  # q + 32, in input order
    sc = torch.from_numpy(np.ascontiguousarray(supers[:, 192:208]).view(np.int8)).view(rows, cols // 16)
    seg = QuantSegment(
        "q6_k", rows, cols, layouts.pack_codes(torch.from_numpy(np.ascontiguousarray(codes)).view(rows, cols), 6),
        layouts.pack_block_params(_f16(supers, 208).view(rows, -1)), None, "Q6_K (native)",
        sub=layouts.pack_block_subs(sc[:, 0::2].contiguous(), sc[:, 1::2].contiguous()),
    )  # fmt: skip
    return QuantizedWeight([seg])


def _requantized(type_name: str, raw: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    """Formats whose bit layout we do not unpack ourselves: gguf's own dequantization gives
    the values, from which the codes are recovered exactly under the block's (d, m)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    values = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)).view(rows, cols)
    if type_name in ("Q5_0", "Q5_1"):
        blocks = raw.reshape(rows, cols // BLOCK, -1)
        d = _f16(blocks, 0)
        m = _f16(blocks, 2) if type_name == "Q5_1" else -16 * d
        source = f"{type_name} (repacked to 8-bit codes, exact)"
    else:  # Q5_K
        d, minimum = _k_scales(raw, rows, cols)
        m = -minimum
        source = "Q5_K (repacked to 8-bit codes: codes exact, scales and minima rounded to fp16)"
    blocks = values.view(rows, cols // BLOCK, BLOCK)
    # Q5_0's d is negative where the block's largest magnitude is (ggml's rule)
    safe = torch.where(d != 0, d, 1)[..., None]
    codes = torch.where(d[..., None] != 0, torch.round((blocks - m[..., None]) / safe), 0).clamp(0, 255)
    return pack("q8_min", codes.to(torch.uint8).view(rows, cols), d, m, source)
