"""Linear methods: one owner per weight format (see base.py); `choose_linear_method` picks one."""

from __future__ import annotations

from kvserve.kernels.support import KernelSupport
from kvserve.model.linear_methods.base import LinearMethod
from kvserve.model.linear_methods.cpu_bf16 import CpuBf16LinearMethod
from kvserve.model.linear_methods.cpu_quant import CpuQuantLinearMethod
from kvserve.model.linear_methods.unquantized import TorchLinearMethod

__all__ = ["LinearMethod", "CpuBf16LinearMethod", "CpuQuantLinearMethod", "TorchLinearMethod", "choose_linear_method"]


def choose_linear_method(
    kernels: KernelSupport, out_features: int, in_features: int, *, silu_mul: bool = False, argmax: bool = False,
    quantized: bool = False,
) -> LinearMethod:
    """The method for one [out_features, in_features] projection of this model, decided once.
    `quantized`: the weight is a QuantizedWeight (the loader made it only where the kernel is on)."""
    silu_ops = kernels.op("silu_and_mul") if silu_mul else None
    if quantized:
        ops = kernels.op("quant_linear")
        if ops is None:
            raise RuntimeError(f"a quantized weight reached a model whose quant_linear kernel is off ({kernels.quant_linear.reason})")
        return CpuQuantLinearMethod(ops, silu_ops, float_out=argmax)  # the LM head: fp32 logits
    plan = kernels.plan_projection(out_features, in_features, silu_mul=silu_mul, argmax=argmax)
    if plan is None:
        return TorchLinearMethod(silu_ops)
    return CpuBf16LinearMethod(kernels.ops, plan, silu_ops)
