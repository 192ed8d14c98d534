"""Linear methods: one owner per weight format (see base.py); `choose_linear_method` picks one."""

from __future__ import annotations

from kvserve.kernels.support import KernelSupport
from kvserve.model.linear_methods.base import LinearMethod
from kvserve.model.linear_methods.cpu_bf16 import CpuBf16LinearMethod
from kvserve.model.linear_methods.unquantized import TorchLinearMethod

__all__ = ["LinearMethod", "CpuBf16LinearMethod", "TorchLinearMethod", "choose_linear_method"]


def choose_linear_method(
    kernels: KernelSupport, out_features: int, in_features: int, *, silu_mul: bool = False, argmax: bool = False
) -> LinearMethod:
    """The method for one [out_features, in_features] projection of this model, decided once."""
    silu_ops = kernels.op("silu_and_mul") if silu_mul else None
    plan = kernels.plan_projection(out_features, in_features, silu_mul=silu_mul, argmax=argmax)
    if plan is None:
        return TorchLinearMethod(silu_ops)
    return CpuBf16LinearMethod(kernels.ops, plan, silu_ops)
