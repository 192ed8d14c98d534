"""The packed weight layouts the kernels read, and every reshuffle of them outside C++.

Every kernel level reads the same two packed
layouts, so a weight is packed once at load and the model, its linear methods and the
tensor-parallel sharding never index into them themselves: they call here. Both layouts are
cut into groups of GROUP output columns (weight rows) and blocks of BLOCK inputs (weight
columns), group-major, so a packed tensor's dim 0 is the group and dim 1 the block.

Block-quantized codes (the quant_linear kernel; QuantSegment in kernels.h). Per block of
BLOCK inputs of one output column, w = d·c + m with c an unsigned code of 8, 6 or 4 bits:
- codes uint8 [N/16, K/32, 512] (8-bit), [N/16, K/32, 384] (6-bit) or [N/16, K/32, 256]
  (4-bit); within a (group, block), byte j·64 + 4·n + t holds column n's code for input
  4j + t, for j < 8 (8-bit) or j < 4 (4-bit, where the byte's low nibble is input 4j + t and
  its high nibble input 16 + 4j + t: GGUF's own Q4_0 order within a block). 6-bit codes are
  their low 4 bits in the 4-bit layout (bytes 0-255), then their top 2 bits (bytes 256-383):
  byte 256 + (j // 2)·64 + 4·n + t holds, from bit 4·(j % 2), those of input 4j + t and then of
  input 16 + 4j + t;
- scales d and minima m fp16 [N/16, K/32, 16]: [g, b, n] is output column 16g + n's value for
  block b; a scale per output column (no blocks) is [N/16, 1, 16]. The K-quants (GGUF Q4_K,
  Q6_K as stored) hold their super-block's d (and dmin) per SUPER inputs, [N/16, K/256, 16],
  and each block's small integer scales in `sub`, uint8 [N/16, K/32, 32]: [g, b, n] and
  [g, b, 16 + n] column 16g + n's two for block b (Q4_K: its sc and mn; Q6_K: the int8 scales
  of inputs 0-15 and 16-31 of the block).

bf16 VNNI tiles (amx_pack_weight; the AMX kernels, gemv_vnni, gemm_vnni): [N/16, K/32, 16,
32], [g, b, p, 2n + j] = w[16g + n, 32b + 2p + j]: per (group, block) one 1 KiB tile whose
row p holds the input pair (2p, 2p + 1) of each of the 16 columns.

Pure torch: nothing here depends on which kernel level is loaded (or whether one is).
"""

from __future__ import annotations

import torch

GROUP = 16  # output columns (weight rows) per packed group: a tile's / a code vector's width
BLOCK = 32  # inputs (weight columns) per quantization block and per VNNI tile's depth
SUPER = 256  # inputs per super-block of the K-quant formats (their d and dmin)
_PAIRS = BLOCK // 2  # rows of a VNNI tile: one per pair of bf16 inputs


def on_grid(rows: int, cols: int) -> bool:
    """Whether an [rows, cols] weight packs: whole groups of GROUP rows, whole blocks of BLOCK columns."""
    return rows > 0 and rows % GROUP == 0 and cols % BLOCK == 0


# ---- block-quantized codes ----------------------------------------------------------------


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes uint8 [N, K] (values < 2**bits, one per weight) → the packed codes uint8
    [N/16, K/32, 512 or 256] (the module docstring's layout)."""
    n, k = codes.shape
    kb = k // BLOCK
    if bits == 8:
        return codes.view(n // GROUP, GROUP, kb, 8, 4).permute(0, 2, 3, 1, 4).reshape(n // GROUP, kb, 512).contiguous()
    if bits == 6:
        top = (codes >> 4).view(n, kb, 2, 4, 4)  # [n, kb, input half, j, t]: the top 2 bits
        nib = top[:, :, 0] | (top[:, :, 1] << 2)  # [n, kb, j, t]: input 4j + t's, then 16 + 4j + t's
        plane = (nib[:, :, 0::2] | (nib[:, :, 1::2] << 4)).view(n // GROUP, GROUP, kb, 2, 4).permute(0, 2, 3, 1, 4)
        return torch.cat([pack_codes(codes & 0x0F, 4), plane.reshape(n // GROUP, kb, 128)], dim=2).contiguous()
    if bits != 4:
        raise ValueError(f"codes of {bits} bits: the kernels read 8, 6 or 4")
    blocks = codes.view(n, kb, 2, BLOCK // 2)
    return pack_nibbles(blocks[:, :, 0] | (blocks[:, :, 1] << 4))


def pack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs uint8 [N, K/32, 16], byte i of a block holding input i in its low nibble and input
    16 + i in its high one (GGUF Q4_0 / Q4_1's block bytes as stored) → the packed 4-bit
    codes uint8 [N/16, K/32, 256]."""
    n, kb, _ = qs.shape
    return qs.view(n // GROUP, GROUP, kb, 4, 4).permute(0, 2, 3, 1, 4).reshape(n // GROUP, kb, 256).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of pack_codes: packed `bits`-bit codes uint8 [N/16, K/32, 512 or 256] →
    uint8 [N, K], one code per weight."""
    g, kb, _ = packed.shape
    if bits == 6:
        low = unpack_codes(packed[:, :, :256].contiguous(), 4).view(g * GROUP, kb, BLOCK)
        plane = packed[:, :, 256:].reshape(g, kb, 2, GROUP, 4).permute(0, 3, 1, 2, 4)  # [g, 16, kb, j // 2, t]
        nib = torch.stack([plane & 0x0F, plane >> 4], dim=4).reshape(g * GROUP, kb, 4, 4)  # [.., j, t]
        top = torch.stack([nib & 0x03, nib >> 2], dim=2).reshape(g * GROUP, kb, BLOCK)  # [.., half, j, t]
        return (low | (top << 4)).reshape(g * GROUP, kb * BLOCK)
    if bits == 8:
        codes = packed.view(g, kb, 8, GROUP, 4).permute(0, 3, 1, 2, 4)  # [g, 16, kb, 8, 4]
    else:
        vectors = packed.view(g, kb, 4, GROUP, 4)
        both = torch.stack([vectors & 0x0F, vectors >> 4], dim=2)  # [g, kb, low|high, 4, 16, 4]
        codes = both.permute(0, 4, 1, 2, 3, 5)  # [g, 16, kb, 2, 4, 4]
    return codes.reshape(g * GROUP, kb * BLOCK)


def pack_block_params(values: torch.Tensor) -> torch.Tensor:
    """Per-block scales or minima [N, blocks] (blocks = K/32, or 1 for one per output column)
    → fp16 [N/16, blocks, 16], [g, b, n] the value of column 16g + n."""
    n, b = values.shape
    return values.to(torch.float16).view(n // GROUP, GROUP, b).permute(0, 2, 1).contiguous()


def unpack_block_params(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_block_params: fp16 [N/16, blocks, 16] → fp16 [N, blocks]."""
    g, b, _ = packed.shape
    return packed.permute(0, 2, 1).reshape(g * GROUP, b)


def pack_block_subs(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The K-quants' two small scales per block, uint8 (or int8, kept as its bytes) [N, K/32]
    each → uint8 [N/16, K/32, 32]: [g, b, n] = first of column 16g + n, [g, b, 16 + n] = second."""
    n, b = first.shape
    both = torch.stack([first.view(torch.uint8), second.view(torch.uint8)], dim=2)  # [N, b, 2]
    return both.view(n // GROUP, GROUP, b, 2).permute(0, 2, 3, 1).reshape(n // GROUP, b, 2 * GROUP).contiguous()


def unpack_block_subs(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of pack_block_subs: uint8 [N/16, K/32, 32] → (first, second) uint8 [N, K/32]."""
    g, b, _ = packed.shape
    both = packed.view(g, b, 2, GROUP).permute(0, 3, 1, 2).reshape(g * GROUP, b, 2)
    return both[..., 0], both[..., 1]


# ---- cutting a packed weight (tensor-parallel shards) ---------------------------------------
# Codes, scales, minima and VNNI tiles are all [N/16, K/32, ...]: one cut serves each.


def slice_group_rows(packed: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Output rows [lo, hi) of any packed tensor of this module ([N/16, ...]: codes, scales,
    minima, VNNI tiles), copied: the packing of w[lo:hi]. lo and hi must fall on groups of
    GROUP rows (ValueError otherwise)."""
    if lo % GROUP or hi % GROUP:
        raise ValueError(f"rows [{lo}, {hi}) are not whole groups of {GROUP} packed rows")
    return packed[lo // GROUP : hi // GROUP].contiguous()


def slice_block_cols(packed: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Input columns [lo, hi) of a packed tensor with blocks on dim 1 ([N/16, K/32, ...]:
    codes, per-block scales or minima, VNNI tiles), copied: the packing of w[:, lo:hi]. lo
    and hi must fall on blocks of BLOCK columns (ValueError otherwise)."""
    if lo % BLOCK or hi % BLOCK:
        raise ValueError(f"columns [{lo}, {hi}) are not whole blocks of {BLOCK}")
    return packed[:, lo // BLOCK : hi // BLOCK].contiguous()


def slice_super_cols(params: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Input columns [lo, hi) of the K-quants' per-super-block d or dmin fp16 [N/16, K/256, 16]:
    lo and hi must fall on super-blocks of SUPER columns (ValueError otherwise)."""
    if lo % SUPER or hi % SUPER:
        raise ValueError(f"columns [{lo}, {hi}) are not whole super-blocks of {SUPER} (a K-quant weight's scales)")
    return params[:, lo // SUPER : hi // SUPER].contiguous()


def slice_params_cols(params: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """slice_block_cols for scales or minima fp16 [N/16, blocks, 16], where a scale per output
    column ([N/16, 1, 16]: no blocks) holds for every input and so stays whole."""
    if params.shape[1] == 1:
        if lo % BLOCK or hi % BLOCK:
            raise ValueError(f"columns [{lo}, {hi}) are not whole blocks of {BLOCK}")
        return params
    return slice_block_cols(params, lo, hi)


# ---- bf16 VNNI tiles --------------------------------------------------------------------------


def pack_bf16_tiles(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] → VNNI tiles [N/16, K/32, 16, 32] (the module docstring's layout): the plain
    torch statement of what the kernels' amx_pack_weight builds, for code without a kernel
    module and for tests."""
    n, k = w.shape
    if not on_grid(n, k):
        raise ValueError(f"a [{n}, {k}] weight is off the tile grid ({GROUP} rows, {BLOCK} columns)")
    tiles = w.contiguous().view(n // GROUP, GROUP, k // BLOCK, _PAIRS, 2).permute(0, 2, 3, 1, 4)
    return tiles.reshape(n // GROUP, k // BLOCK, _PAIRS, 2 * GROUP).contiguous()


def unpack_bf16_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_bf16_tiles: VNNI tiles [N/16, K/32, 16, 32] → the row-major [N, K]."""
    g, kb = tiles.shape[:2]
    return tiles.view(g, kb, _PAIRS, GROUP, 2).permute(0, 3, 1, 2, 4).reshape(g * GROUP, kb * BLOCK)


def bf16_tile_rows(tiles: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64 [T]) of the weight held as VNNI tiles [N/16, K/32, 16, 32] → [T, K],
    gathered from the tiles (an embedding lookup with no row-major copy kept)."""
    g, kb = tiles.shape[:2]
    rows = tiles.view(g, kb, _PAIRS, GROUP, 2)[ids // GROUP, :, :, ids % GROUP, :]  # [T, kb, 16 pairs, 2]
    return rows.reshape(ids.shape[0], kb * BLOCK)


def interleave_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    """[gate; up] ([2I, K], I a multiple of GROUP) with their GROUP-row blocks alternating:
    gate rows 0-15, up rows 0-15, gate rows 16-31, ... the order amx_linear_silu_mul reads
    its packed weight in, so each 16 outputs of silu(gate)·up come from two neighbouring
    column groups. Pack the result with amx_pack_weight."""
    two_i, k = gate_up.shape
    return gate_up.view(2, two_i // (2 * GROUP), GROUP, k).transpose(0, 1).reshape(two_i, k)

