"""A projection y = x·Wᵀ (+ b): the layer holds its weight, its linear method owns the format.

The method (kvserve/model/linear_methods/) is chosen once at load; after the weights are on
their device, `process_weights_after_loading` lets it pack them (and drop the row-major
copy where nothing reads it). The model code only calls the layer.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels.support import KernelSupport
from kvserve.model.linear_methods import LinearMethod, choose_linear_method


class Linear(nn.Module):
    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: KernelSupport, *, argmax: bool = False,
        silu_mul: bool = False,
    ):  # fmt: skip
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.method: LinearMethod = choose_linear_method(
            kernels, self.out_features, self.in_features, silu_mul=silu_mul, argmax=argmax
        )
        self.kernel = None  # what the method's kernels read (an ops.Projection), once processed

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def fused_projection(self):
        """What the fused decode step reads for this projection (an ops.Projection), or None."""
        return self.method.fused_projection(self)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of forward(x), taken inside the kernel where the method can; else None."""
        return self.method.argmax(self, x)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.method.describe(self)}"


class GateUpSiluLinear(Linear):
    """[gate; up] in one matmul, returning silu(gate)·up: the SiLU MLP's first half."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, kernels: KernelSupport):
        super().__init__(torch.cat([gate, up], dim=0), None, kernels, silu_mul=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply_silu_mul(self, x)
