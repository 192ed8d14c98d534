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
from kvserve.model.quant_formats import QuantizedWeight


class Linear(nn.Module):
    """`weight`: a float tensor, or a QuantizedWeight (kept as `qweight`; `weight` is then None)."""

    def __init__(
        self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None, kernels: KernelSupport, *,
        argmax: bool = False, silu_mul: bool = False,
    ):  # fmt: skip
        super().__init__()
        self.out_features, self.in_features = weight.shape
        quantized = isinstance(weight, QuantizedWeight)
        self.qweight = weight if quantized else None
        self.weight = None if quantized else nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # the weight and bias in the format they were loaded in, one copy: what a planner
        # counts (the method's packed copies come on top, LlamaForCausalLM.weight_bytes)
        self.stored_bytes = (weight.nbytes if quantized else weight.numel() * weight.element_size()) + (
            0 if bias is None else bias.numel() * bias.element_size()
        )
        self.method: LinearMethod = choose_linear_method(
            kernels, self.out_features, self.in_features, silu_mul=silu_mul, argmax=argmax, quantized=quantized
        )
        self.kernel = None  # what the method's kernels read (an ops.Projection), once processed

    def process_weights_after_loading(self) -> None:
        """Once: the model packs each layer's projections as it builds it (on the CPU), then
        asks every projection again once the model is on its device."""
        if self.kernel is None:
            self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def fused_projection(self):
        """What the fused decode step reads for this projection (an ops.Projection), or None."""
        return self.method.fused_projection(self)

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight (this layer as an embedding table)."""
        return self.method.embedding_rows(self, ids)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of forward(x), taken inside the kernel where the method can; else None."""
        return self.method.argmax(self, x)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.method.describe(self)}"


def cat_rows(weights: list) -> torch.Tensor | QuantizedWeight:
    """Weights stacked by output rows (QKV, gate/up), float or quantized alike."""
    if isinstance(weights[0], QuantizedWeight):
        return QuantizedWeight.cat(weights)
    return torch.cat(weights, dim=0)


class GateUpSiluLinear(Linear):
    """[gate; up] in one matmul, returning silu(gate)·up: the SiLU MLP's first half."""

    def __init__(self, gate: torch.Tensor | QuantizedWeight, up: torch.Tensor | QuantizedWeight, kernels: KernelSupport):
        super().__init__(cat_rows([gate, up]), None, kernels, silu_mul=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply_silu_mul(self, x)
