"""The model's work per token and this machine's limits, measured in the same run.

Decode at batch 1 reads every weight once per token, so its floor is
weight bytes ÷ memory-read bandwidth (plus the KV cache it reads, small at short
contexts). Prefill is matrix work, so its floor is FLOPs ÷ the measured GEMM rate.
Both machine figures come from `kvserve.planner.calibrate` (best-of timings).

Costs are counted from the architecture, not from the engine's modules, so they do not
move when the engine fuses or reorders its weights, and with the planner's formulas
(planner/roofline.py, latency.py, attention.py), the one cost model.
"""

from __future__ import annotations

import dataclasses

from kvserve.arch import ModelArchitecture
from kvserve.planner import attention, latency, roofline
from kvserve.planner.calibrate import measure_bf16_flops_per_s, measure_read_bytes_per_s


@dataclasses.dataclass(frozen=True)
class MachineLimits:
    read_bytes_per_s: float
    gemm_flops_per_s: float
    read_test_bytes: int
    gemm_size: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def measure_machine(device: str, read_bytes: int, gemm_size: int, seconds: float) -> MachineLimits:
    return MachineLimits(
        read_bytes_per_s=measure_read_bytes_per_s(read_bytes, seconds, device),
        gemm_flops_per_s=measure_bf16_flops_per_s(gemm_size, seconds, device),
        read_test_bytes=read_bytes,
        gemm_size=gemm_size,
    )


def best_of(*measurements: MachineLimits) -> MachineLimits:
    """The best of several measurements: on shared CPUs a burst of someone else's work
    lowers one, and a roofline that is too low would flatter the engine."""
    return dataclasses.replace(
        measurements[0],
        read_bytes_per_s=max(m.read_bytes_per_s for m in measurements),
        gemm_flops_per_s=max(m.gemm_flops_per_s for m in measurements),
    )


def layer_params(arch: ModelArchitecture) -> int:
    """Parameters of the decoder layers that multiply each token's activations: all of them,
    or of a mixture of experts' routed experts only the k each token runs (P_active's share)."""
    routed = arch.routed_expert_params
    return arch.decoder_layer_params - routed + routed * arch.num_experts_per_tok // max(arch.num_experts, 1)


def total_params(arch: ModelArchitecture) -> int:
    return arch.num_params


def decode_bytes_per_step(
    arch: ModelArchitecture, weight_bytes: int, kv_bytes: int, context_len: float, kv_scale_bytes: float = 0,
    weights_read: int | None = None,
) -> float:
    """Bytes one batch-1 decode step must read: the layers, the final norm, the LM head
    (V·d, the embedding table itself when tied; the input embedding is one row), and the
    K/V of `context_len` positions (with an int8 cache's scales, `kv_scale_bytes` per KV head).
    `weights_read`: those weights' bytes as the engine holds them (quantized formats, scales
    included), instead of the parameter count times `weight_bytes`."""
    if weights_read is None:
        weights_read = (layer_params(arch) + arch.hidden_size + arch.vocab_size * arch.hidden_size) * weight_bytes
    return roofline.step_read_bytes(weights_read, arch.kv_bytes_per_position(kv_bytes, kv_scale_bytes) * context_len, 1)


def prefill_flops(arch: ModelArchitecture, num_tokens: int) -> dict[str, float]:
    """FLOPs one whole prefill of `num_tokens` (no cached prefix) needs, by part: the decoder
    layers' projections (the planner's 2·P·S over the layers' P), causal attention (QKᵀ and
    PV over the lower triangle), and the LM head for the one position that samples. The
    planner's `prefill_projection_flops` over all of P is what `plan run` reports instead."""
    linear = float(latency.prefill_projection_flops(layer_params(arch), num_tokens))
    attn = float(attention.attention_flops(0, num_tokens, arch.head_dim, arch.num_layers, arch.num_heads))
    lm_head = float(latency.prefill_projection_flops(arch.vocab_size * arch.hidden_size, 1))
    return {"linear": linear, "attention": attn, "lm_head": lm_head, "total": linear + attn + lm_head}
