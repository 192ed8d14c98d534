"""KernelSupport decides once per model which kernels run, and names the reason for each that does not."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.kernels import cpu_ops, unavailable_reason
from kvserve.kernels.support import KernelSupport
from kvserve.arch import ModelArchitecture

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"CPU kernels unavailable: {unavailable_reason()}")
CPU = torch.device("cpu")


def _arch(**changes) -> ModelArchitecture:
    base = ModelArchitecture("llama", 320, 256, 512, 2, 4, 2, 64, 1e-6, 1e4, 128, False)
    return dataclasses.replace(base, **changes)


def test_a_shape_inside_every_limit_turns_every_bf16_kernel_on():
    k = KernelSupport.decide(_arch(), torch.bfloat16, CPU, ops)
    for name in ("decode_attention", "prefill_attention", "rms_norm", "rope_and_cache", "silu_and_mul", "gemv", "fused_decode"):
        assert getattr(k, name).enabled, (name, getattr(k, name).reason)


def test_more_query_heads_per_kv_head_than_the_decode_kernel_takes_turn_it_and_the_fused_step_off():
    limit = ops.limits()["decode_attention_max_queries_per_kv_head"]
    k = KernelSupport.decide(_arch(num_heads=2 * limit, num_kv_heads=1, hidden_size=2 * limit * 64), torch.bfloat16, CPU, ops)
    assert not k.decode_attention.enabled and f"{2 * limit} query heads per KV head > {limit}" in k.decode_attention.reason
    assert not k.fused_decode.enabled and "decode attention is off" in k.fused_decode.reason
    assert k.op("decode_attention") is None and k.prefill_attention.enabled


def test_a_head_dim_past_the_decode_kernel_turns_it_off():
    widest = ops.limits()["decode_attention_max_head_dim"]
    k = KernelSupport.decide(_arch(head_dim=2 * widest, hidden_size=4 * widest, num_heads=2, num_kv_heads=1),
                             torch.bfloat16, CPU, ops)  # fmt: skip
    assert not k.decode_attention.enabled and f"head_dim {2 * widest} >" in k.decode_attention.reason
    # Gemma 3's 256 is within it
    assert KernelSupport.decide(_arch(head_dim=256, hidden_size=512, num_heads=2, num_kv_heads=1), torch.bfloat16, CPU,
                                ops).decode_attention.enabled  # fmt: skip


def test_widths_off_the_kernels_grid_turn_those_kernels_off():
    k = KernelSupport.decide(_arch(hidden_size=72, intermediate_size=100, head_dim=18), torch.bfloat16, CPU, ops)
    assert "hidden_size 72 is not a multiple of 16" in k.rms_norm.reason
    assert "intermediate_size 100 is not a multiple of 16" in k.silu_and_mul.reason
    assert not k.rope_and_cache.enabled and not k.prefill_attention.enabled and not k.fused_decode.enabled


def test_float32_runs_the_elementwise_kernels_but_no_bf16_linear():
    k = KernelSupport.decide(_arch(), torch.float32, CPU, ops)
    assert k.rms_norm.enabled and k.decode_attention.enabled
    assert not k.gemv.enabled and not k.prefill_attention.enabled and not k.fused_decode.enabled
    assert k.plan_projection(64, 256) is None  # F.linear


@pytest.mark.parametrize(
    "dtype, device, ops_, reason",
    [(torch.float16, CPU, ops, "take bfloat16 or float32"), (torch.bfloat16, torch.device("cuda"), ops, "CPU kernels"),
     (torch.bfloat16, CPU, None, "not loaded")],
)  # fmt: skip
def test_everything_off_names_why(dtype, device, ops_, reason):
    k = KernelSupport.decide(_arch(), dtype, device, ops_)
    assert all(not c.enabled and reason in c.reason for c in k.choices().values())
    assert k.op("rms_norm") is None


def test_without_prepacked_weights_only_the_row_major_gemv_runs():
    k = KernelSupport.decide(_arch(), torch.bfloat16, CPU, ops, prepack_weights=False)
    plan = k.plan_projection(64, 256)
    assert plan is not None and not plan.gemv_vnni and not plan.onednn and plan.amx_max_rows == 0 and plan.keep_row_major
    assert "--no-prepack-weights" in k.onednn_linear.reason


def test_describe_lists_every_kernel_with_its_verdict():
    k = KernelSupport.decide(_arch(num_heads=32, num_kv_heads=1, hidden_size=2048), torch.bfloat16, CPU, ops)
    text = k.describe()
    for name, choice in k.choices().items():
        assert name.replace("_", " ") in text and choice.reason in text
