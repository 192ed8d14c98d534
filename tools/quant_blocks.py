"""Random quantized weights written directly as GGUF blocks, never through a float copy.

Codes are uniform over each format's range (made symmetric about zero where the format has
no min, so no weight matrix has a mean that the residual stream would amplify); per-block
scales are jittered ±25 % around the value that gives each weight std 0.02 (WEIGHT_STD),
every fp16 scale finite, positive and a normal number. `BLOCK_MAKERS` maps each GGML type
to its maker; the `pack_*` helpers lay out a block as `gguf.quants` reads it.
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType as T

WEIGHT_STD = 0.02

_JITTER = 0.25  # per-block scale factor uniform in [1 - j, 1 + j]
_JITTER_MS = 1 + _JITTER**2 / 3  # E[f²]


def _uniform_int_ms(lo: int, hi: int, center: float = 0.0) -> float:
    """E[(q − center)²] for q uniform on the integers lo..hi."""
    n = hi - lo + 1
    mean = (lo + hi) / 2
    return (n * n - 1) / 12 + (mean - center) ** 2


def _raw_bytes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    words = rng.bit_generator.random_raw((n + 7) // 8)
    return words.view(np.uint8)[:n].reshape(shape)


def _fp16(values: np.ndarray) -> np.ndarray:
    """float → fp16 bytes [..., 2]."""
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _scales(rng: np.random.Generator, n: int, base: float) -> np.ndarray:
    return base * rng.uniform(1 - _JITTER, 1 + _JITTER, n)


def _pack_nibbles_32(codes: np.ndarray) -> np.ndarray:
    """[n, 32] 4-bit codes → [n, 16] bytes: element j in the low nibble of byte j, j+16 in the high."""
    return codes[:, :16] | (codes[:, 16:] << np.uint8(4))


def _make_q8_0(rng, n):
    d = _scales(rng, n, WEIGHT_STD / math.sqrt(_JITTER_MS * _uniform_int_ms(-127, 127)))
    qs = rng.integers(-127, 128, (n, 32), dtype=np.int8).view(np.uint8)
    return np.concatenate([_fp16(d), qs], axis=1)


def _make_q4_0(rng, n):
    # codes 1..15 (weights d·(q − 8) in −7..7, symmetric)
    d = _scales(rng, n, WEIGHT_STD / math.sqrt(_JITTER_MS * _uniform_int_ms(-7, 7)))
    codes = rng.integers(1, 16, (n, 32), dtype=np.uint8)
    return np.concatenate([_fp16(d), _pack_nibbles_32(codes)], axis=1)


def pack_q5_0(d: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Q5_0 blocks from scales [n] and 5-bit codes [n, 32] (weight = d·(code − 16))."""
    qs = (codes[:, :16] & np.uint8(0x0F)) | ((codes[:, 16:] & np.uint8(0x0F)) << np.uint8(4))
    qh = np.packbits(codes >> np.uint8(4), axis=-1, bitorder="little")
    return np.concatenate([_fp16(d), qh, qs], axis=1)


def _make_q5_0(rng, n):
    d = _scales(rng, n, WEIGHT_STD / math.sqrt(_JITTER_MS * _uniform_int_ms(-15, 15)))
    return pack_q5_0(d, rng.integers(1, 32, (n, 32), dtype=np.uint8))


def _make_q4_1(rng, n):
    # w = d·q + m, q uniform 0..15, m = −7.5·d: zero mean
    d = _scales(rng, n, WEIGHT_STD / math.sqrt(_JITTER_MS * _uniform_int_ms(0, 15, 7.5)))
    return np.concatenate([_fp16(d), _fp16(-7.5 * d), _raw_bytes(rng, (n, 16))], axis=1)


def _make_q5_1(rng, n):
    d = _scales(rng, n, WEIGHT_STD / math.sqrt(_JITTER_MS * _uniform_int_ms(0, 31, 15.5)))
    return np.concatenate([_fp16(d), _fp16(-15.5 * d), _raw_bytes(rng, (n, 20))], axis=1)


def pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12-byte scales field of Q4_K / Q5_K from 6-bit sub-block scales and mins [n, 8]."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    lo_d = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    lo_m = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return np.concatenate([lo_d, lo_m, hi], axis=1)


# sub-block scales: Q4_K's span 32..63 as llama.cpp's (the largest near 63); Q5_K's 16..31
# keep its fp16 d a normal number
_K_SCALE_RANGE = {"q4_k": (32, 63), "q5_k": (16, 31)}


def _make_k_minned(rng, n, bits: int):
    lo, hi = _K_SCALE_RANGE["q4_k" if bits == 4 else "q5_k"]
    center = (2**bits - 1) / 2
    sc_ms = _uniform_int_ms(lo, hi)
    d = _scales(rng, n, WEIGHT_STD / math.sqrt(_JITTER_MS * sc_ms * _uniform_int_ms(0, 2**bits - 1, center)))
    sc = rng.integers(lo, hi + 1, (n, 8), dtype=np.uint8)
    # w = d·sc·q − dmin·m with dmin = center·d and m = sc: each sub-block's mean is zero
    parts = [_fp16(d), _fp16(center * d), pack_k_scales(sc, sc)]
    if bits == 5:
        parts.append(_raw_bytes(rng, (n, 32)))  # qh: the fifth bit of each weight
    parts.append(_raw_bytes(rng, (n, 128)))  # qs: the low four bits
    return np.concatenate(parts, axis=1)


def pack_q6_k(d: np.ndarray, scales: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Q6_K blocks from d [n], int8 sub-block scales [n, 16] and 6-bit codes [n, 256]
    (weight e = d·scales[e // 16]·(codes[e] − 32)); the layout of `gguf.quants.Q6_K`."""
    n = codes.shape[0]
    c = codes.reshape(n, 2, 128)
    lo, hi = c & np.uint8(0x0F), c >> np.uint8(4)
    ql = (lo[:, :, :64] | (lo[:, :, 64:] << np.uint8(4))).reshape(n, 128)
    h = hi.reshape(n, 2, 4, 32)
    qh = (h[:, :, 0] | (h[:, :, 1] << np.uint8(2)) | (h[:, :, 2] << np.uint8(4)) | (h[:, :, 3] << np.uint8(6))).reshape(n, 64)
    return np.concatenate([ql, qh, scales.astype(np.int8).view(np.uint8), _fp16(d)], axis=1)


_Q6_SCALE_RANGE = (8, 15)  # int8 sub-block scales; keeps the fp16 d a normal number


def _make_q6_k(rng, n):
    lo, hi = _Q6_SCALE_RANGE
    d = _scales(rng, n, WEIGHT_STD / math.sqrt(_JITTER_MS * _uniform_int_ms(lo, hi) * _uniform_int_ms(-31, 31)))
    scales = rng.integers(lo, hi + 1, (n, 16), dtype=np.int8)
    return pack_q6_k(d, scales, rng.integers(1, 64, (n, 256), dtype=np.uint8))  # codes 1..63: −31..31


BLOCK_MAKERS = {  # type: (rng, number of blocks) -> [blocks, block bytes] uint8
    T.Q8_0: _make_q8_0, T.Q4_0: _make_q4_0, T.Q4_1: _make_q4_1, T.Q5_0: _make_q5_0, T.Q5_1: _make_q5_1,
    T.Q4_K: lambda rng, n: _make_k_minned(rng, n, 4), T.Q5_K: lambda rng, n: _make_k_minned(rng, n, 5),
    T.Q6_K: _make_q6_k,
}
