"""The packed weight layouts (kvserve/kernels/layouts.py) against element-by-element
statements of them: packing and its inverse, cutting a packed weight by rows and columns, and
the bf16 VNNI tiles' helpers."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import layouts
from kvserve.kernels.layouts import BLOCK, GROUP


def _codes(n: int, k: int, bits: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2**bits, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def _reference_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The layout as the kernel reads it: per (group g, block b), byte j·64 + 4n + t holds column
    16g + n's code for input 4j + t (8-bit); for 4-bit, input 4j + t in the low nibble and
    16 + 4j + t in the high one."""
    n, k = codes.shape
    c = codes.tolist()
    vectors = 8 if bits == 8 else 4
    out = torch.zeros(n // GROUP, k // BLOCK, vectors * 64, dtype=torch.uint8)
    for g in range(n // GROUP):
        for b in range(k // BLOCK):
            for j in range(vectors):
                for col in range(GROUP):
                    row = c[GROUP * g + col]
                    for t in range(4):
                        x = BLOCK * b + 4 * j + t
                        out[g, b, 64 * j + 4 * col + t] = row[x] if bits == 8 else row[x] | (row[x + 16] << 4)
    return out


@pytest.mark.parametrize("bits", [8, 4])
def test_codes_pack_as_the_kernel_reads_them_and_unpack_back(bits):
    codes = _codes(32, 64, bits)
    packed = layouts.pack_codes(codes, bits)
    assert packed.shape == (2, 2, 512 if bits == 8 else 256)
    assert torch.equal(packed, _reference_codes(codes, bits))
    assert torch.equal(layouts.unpack_codes(packed, bits), codes)


def test_nibbles_as_gguf_stores_them_pack_as_4_bit_codes():
    codes = _codes(32, 96, 4, seed=1)
    qs = codes.view(32, 3, 2, 16)
    gguf_bytes = qs[:, :, 0] | (qs[:, :, 1] << 4)  # byte i: input i low, input 16 + i high
    assert torch.equal(layouts.pack_nibbles(gguf_bytes), layouts.pack_codes(codes, 4))


@pytest.mark.parametrize("blocks", [3, 1])  # per block of 32, and one per output column
def test_scales_and_minima_pack_by_group_and_unpack_back(blocks):
    d = torch.randn(48, blocks, generator=torch.Generator().manual_seed(2))
    packed = layouts.pack_block_params(d)
    assert packed.dtype == torch.float16 and packed.shape == (3, blocks, 16)
    for g, b, n in [(0, 0, 0), (1, blocks - 1, 5), (2, 0, 15)]:
        assert packed[g, b, n] == d[GROUP * g + n, b].half()
    assert torch.equal(layouts.unpack_block_params(packed), d.half())


@pytest.mark.parametrize("bits", [8, 4])
def test_a_packed_cut_is_the_packing_of_the_cut(bits):
    codes = _codes(64, 160, bits, seed=3)
    d = torch.randn(64, 5, generator=torch.Generator().manual_seed(4))
    w = torch.randn(64, 160, generator=torch.Generator().manual_seed(5)).bfloat16()
    packed, params, tiles = layouts.pack_codes(codes, bits), layouts.pack_block_params(d), layouts.pack_bf16_tiles(w)
    for lo, hi in [(0, 16), (16, 48), (32, 64)]:
        assert torch.equal(layouts.slice_group_rows(packed, lo, hi), layouts.pack_codes(codes[lo:hi], bits))
        assert torch.equal(layouts.slice_group_rows(params, lo, hi), layouts.pack_block_params(d[lo:hi]))
        assert torch.equal(layouts.slice_group_rows(tiles, lo, hi), layouts.pack_bf16_tiles(w[lo:hi]))
    for lo, hi in [(0, 32), (32, 128), (64, 160)]:
        b0, b1 = lo // BLOCK, hi // BLOCK
        assert torch.equal(layouts.slice_block_cols(packed, lo, hi), layouts.pack_codes(codes[:, lo:hi], bits))
        assert torch.equal(layouts.slice_params_cols(params, lo, hi), layouts.pack_block_params(d[:, b0:b1]))
        assert torch.equal(layouts.slice_block_cols(tiles, lo, hi), layouts.pack_bf16_tiles(w[:, lo:hi]))
    assert layouts.slice_group_rows(packed, 16, 32).is_contiguous()


def test_a_scale_per_output_column_stays_whole_under_a_column_cut():
    per_channel = layouts.pack_block_params(torch.randn(32, 1))
    assert layouts.slice_params_cols(per_channel, 32, 96) is per_channel


def test_a_cut_inside_a_group_or_block_is_refused():
    packed = layouts.pack_codes(_codes(32, 64, 8), 8)
    with pytest.raises(ValueError, match="groups of 16"):
        layouts.slice_group_rows(packed, 8, 32)
    with pytest.raises(ValueError, match="blocks of 32"):
        layouts.slice_block_cols(packed, 0, 48)
    with pytest.raises(ValueError, match="blocks of 32"):
        layouts.slice_params_cols(layouts.pack_block_params(torch.ones(32, 1)), 0, 48)


def test_on_grid():
    assert layouts.on_grid(16, 32) and layouts.on_grid(4096, 576)
    assert not layouts.on_grid(0, 32) and not layouts.on_grid(24, 32) and not layouts.on_grid(16, 48)


# ---- bf16 VNNI tiles ------------------------------------------------------------------------


def _weight(n: int = 48, k: int = 96) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(6)).bfloat16()


def test_vnni_tiles_hold_each_columns_input_pairs():
    w = _weight()
    tiles = layouts.pack_bf16_tiles(w)
    assert tiles.shape == (3, 3, 16, 32)
    expected = torch.empty_like(tiles)
    for g in range(3):
        for b in range(3):
            for p in range(16):
                for n in range(16):
                    for j in range(2):
                        expected[g, b, p, 2 * n + j] = w[16 * g + n, 32 * b + 2 * p + j]
    assert torch.equal(tiles, expected)
    assert torch.equal(layouts.unpack_bf16_tiles(tiles), w)
    with pytest.raises(ValueError, match="tile grid"):
        layouts.pack_bf16_tiles(w[:24])


def test_vnni_tiles_are_the_kernels_amx_pack_weight():
    from kvserve.kernels import cpu_ops, unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(f"no kernels: {unavailable_reason()}")
    ops = cpu_ops()
    if ops is None:
        pytest.skip("the kernels did not load")
    w = _weight()
    assert torch.equal(ops.amx_pack_weight(w), layouts.pack_bf16_tiles(w))


def test_rows_gathered_from_the_tiles_are_the_weights_rows():
    w = _weight()
    ids = torch.tensor([0, 47, 17, 17, 31, 16, 5])
    assert torch.equal(layouts.bf16_tile_rows(layouts.pack_bf16_tiles(w), ids), w[ids])


def test_interleave_gate_up_alternates_16_row_blocks():
    gate_up = torch.arange(64).view(64, 1)  # gate rows 0-31, up rows 32-63
    order = layouts.interleave_gate_up(gate_up).view(-1).tolist()
    assert order == [*range(0, 16), *range(32, 48), *range(16, 32), *range(48, 64)]
