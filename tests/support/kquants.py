"""Random GGUF K-quant tensors (gguf-py cannot quantize K-quants): super-blocks of random bytes
with fp16 scales set to realistic values, for the packing and kernel tests."""

from __future__ import annotations

import numpy as np

SUPER_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def random_k_blocks(type_name: str, n: int, k: int, seed: int = 0, full_range: bool = False) -> np.ndarray:
    """uint8 [n, k/256 · bytes]: random codes and sub-block scales, d = 0.001 (dmin 0.0005).
    Q6_K's int8 scales are in [20, 40] (neighbouring sub-blocks of real tensors are alike), or
    with `full_range` anywhere in [-128, 127], the extremes included."""
    size = SUPER_BYTES[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)

    def f16(value):
        return np.frombuffer(np.full(n * k // 256, value, np.float16).tobytes(), np.uint8).reshape(n, k // 256, 2)

    if type_name == "Q6_K":
        raw[..., -2:] = f16(0.001)
        if not full_range:
            raw[..., 192:208] = rng.integers(20, 40, size=(n, k // 256, 16), dtype=np.uint8)
        else:
            raw[..., 192] = 0x80  # -128
            raw[..., 193] = 0x7F  # 127
    else:
        raw[..., 0:2], raw[..., 2:4] = f16(0.001), f16(0.0005)
    return raw.reshape(n, -1)
