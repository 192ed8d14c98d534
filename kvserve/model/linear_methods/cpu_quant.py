"""Block-quantized weights on the CPU: kvserve's quant_linear kernel for every row count.

The weight stays in its quantized form (kvserve/model/quant_formats.py), once, in the layout
every kernel level reads (kvserve/kernels/layouts.py): no float copy. The compute format is
an int8 dot product: each row of the activations is quantized to int8 per block of 32 (one
fp32 scale, Σq kept for the weight minima) and multiplied with the weight codes in integers
(kvserve/kernels/ says with which instructions at each level); per block the integer sum is
scaled by both scales in fp32. Decode (1-8 rows), batched decode and prefill
all run this one kernel, so a row's result never depends on the batch it came in.
"""

from __future__ import annotations

import torch

from kvserve.model.linear_methods.base import LinearMethod
from kvserve.model.quant_formats import KIND_CODES, QuantizedWeight

COMPUTE_FORMAT = "int8 dot, activations int8 per row and block of 32"


def kernel_segments(ops, weight: QuantizedWeight) -> list:
    return [
        ops.QuantSegment(codes=s.codes, scales=s.scales, mins=s.mins, format=KIND_CODES[s.kind], sub=s.sub)
        for s in weight.segments
    ]


class CpuQuantLinearMethod(LinearMethod):
    name = "cpu-quant"

    def __init__(self, ops, silu_ops=None, float_out: bool = False):
        super().__init__(silu_ops)
        self.ops = ops
        self.float_out = float_out
        self.segments: list = []  # the weight's ops.QuantSegments, once processed

    def process_weights_after_loading(self, layer) -> None:
        # kept here as well: reading Projection.quant back would copy the list on every lookup
        self.segments = kernel_segments(self.ops, layer.qweight)
        layer.kernel = self.ops.Projection(
            quant=self.segments,
            # logits in fp32: bf16's step is 1/8 at |logit| 16-32, enough to tie a greedy choice
            float_out=self.float_out,
            bias=layer.bias.detach().to(torch.bfloat16) if layer.bias is not None else None,
        )

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, layer.kernel)

    def fused_projection(self, layer):
        return layer.kernel

    def embedding_rows(self, layer, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.quant_embedding(ids, self.segments, layer.in_features, torch.bfloat16)

    def batch_invariant(self, layer) -> bool:
        return True  # each row's blocks summed in one order, whatever tile it lands in (kernels/quant_linear.cpp)

    def describe(self, layer) -> str:
        return f"{self.name}: {layer.qweight.describe()}; {COMPUTE_FORMAT}"
