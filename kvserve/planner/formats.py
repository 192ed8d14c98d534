"""The engine's format names as the planner's p_w and p_kv.

`kvserve plan run --quantization NAME --kv-cache-dtype NAME` take the names of the engine's
flags (`kvserve serve --quantization`, `--kv-cache-dtype`) and give the bytes they store:

| --quantization | p_w (bytes per weight)                                                     |
| -------------- | -------------------------------------------------------------------------- |
| none           | 2 (bf16: every weight dequantized)                                         |
| auto           | a `.gguf`: its own tensors' bytes / its parameters (exact, from the header); |
|                | a float model (preset, config.json): 2 (bf16)                              |
| int8           | 1 + 2/D: int8 codes and one fp16 scale per output row (rows of D inputs)    |
| int4           | 0.625: 4-bit codes, an fp16 scale and min per 32 (as Q4_1)                 |
| q8_0           | 34/32 = 1.0625: 32 int8 codes and an fp16 scale                            |
| q4_0           | 18/32 = 0.5625: 32 4-bit codes and an fp16 scale                           |
| q4_1           | 20/32 = 0.625: 32 4-bit codes, fp16 scale and min                          |
| q4_k_m         | 4.85/8 ≈ 0.606: an estimate, see Q4_K_M_BITS_PER_WEIGHT                    |

| --kv-cache-dtype  | p_kv | scale bytes s per (position, KV head), each of K and V |
| ----------------- | ---- | ------------------------------------------------------ |
| auto, bfloat16    | 2    | 0                                                      |
| int8              | 1    | 4 (an fp32 scale: `kvserve.arch.KV_INT8_SCALE_BYTES`) |

so `c_kv = 2·L·N_kv·(H·p_kv + s)`, computed by the engine's own
`kvserve.arch.kv_bytes_per_position`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import ConfigError
from kvserve.arch import KV_INT8_SCALE_BYTES
from kvserve.planner.models import PlannedModel

QUANTIZATIONS = ("auto", "none", "int8", "int4", "q8_0", "q4_0", "q4_1", "q4_k_m")
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")

BF16_BYTES = 2.0
# Q4_K_M (llama.cpp's recipe): Q4_K (144 B per 256 weights = 4.5 bits) everywhere but the LM
# head (the tied embeddings) and attn_v / ffn_down in about half the layers, which are Q6_K
# (210 B per 256 = 6.5625 bits). For Llama-3-8B that is ~19 % of the weights in Q6_K:
# 4.5 + 0.19·2.06 ≈ 4.89 bits; llama.cpp's reported Q4_K_M sizes run 4.8–4.9 bits per weight
# for 7–8B models. 4.85 is that middle; a model's own .gguf with `auto` gives its exact figure.
Q4_K_M_BITS_PER_WEIGHT = 4.85

_BLOCK_BYTES_PER_WEIGHT = {"q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "int4": 20 / 32,
                           "q4_k_m": Q4_K_M_BITS_PER_WEIGHT / 8}


@dataclass(frozen=True)
class WeightFormat:
    name: str
    bytes_per_weight: float
    how: str  # where the figure comes from, for the report


@dataclass(frozen=True)
class KvFormat:
    name: str
    bytes_per_kv_element: float
    scale_bytes: float  # s, per (position, KV head), each of K and V


def weight_format(name: str, model: PlannedModel) -> WeightFormat:
    """p_w of `--quantization NAME` for this model; ConfigError naming the flag for a bad name."""
    if name not in QUANTIZATIONS:
        raise ConfigError("--quantization", f"must be one of {', '.join(QUANTIZATIONS)}, got {name!r}")
    if name == "none":
        return WeightFormat(name, BF16_BYTES, "bf16, every weight dequantized")
    if name == "auto":
        if model.stored_bytes_per_weight is not None:
            return WeightFormat(name, model.stored_bytes_per_weight, "the GGUF's own tensor types and sizes")
        return WeightFormat(name, BF16_BYTES, "a float model in bf16")
    if name == "int8":
        return WeightFormat(name, 1 + 2 / model.arch.hidden_size, f"int8 and an fp16 scale per row of D={model.arch.hidden_size}")
    return WeightFormat(name, _BLOCK_BYTES_PER_WEIGHT[name], {
        "int4": "4-bit, fp16 scale and min per 32", "q8_0": "Q8_0 blocks, 34 B per 32", "q4_0": "Q4_0 blocks, 18 B per 32",
        "q4_1": "Q4_1 blocks, 20 B per 32", "q4_k_m": f"Q4_K_M, ≈{Q4_K_M_BITS_PER_WEIGHT} bits per weight (estimate)",
    }[name])


def kv_format(name: str) -> KvFormat:
    """p_kv and scale bytes of `--kv-cache-dtype NAME`; ConfigError naming the flag for a bad name."""
    if name not in KV_CACHE_DTYPES:
        raise ConfigError("--kv-cache-dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if name == "int8":
        return KvFormat(name, 1.0, float(KV_INT8_SCALE_BYTES))
    return KvFormat(name, BF16_BYTES, 0.0)
