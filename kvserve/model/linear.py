"""A projection y = x·Wᵀ (+ b) that picks the fastest path for the rows it gets.

On the CPU in bf16: up to GEMV_MAX_ROWS rows go to kvserve's GEMV kernel (decode of a
few requests streams the weights once, near memory bandwidth); more rows go to oneDNN
with the weight pre-packed once into its AMX/AVX512 blocked layout (packing on every call
otherwise costs as much as the multiply at decode batch sizes). Elsewhere: F.linear.
The pre-packed copy doubles the memory of the weights it packs; `--no-prepack-weights` skips it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GEMV_MAX_ROWS = 8
# oneDNN picks its blocking from a row-count hint; any row count works with the result
_PACK_HINT_ROWS = 2048


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, ops=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.ops = ops
        self.packed: torch.Tensor | None = None

    def prepack(self) -> bool:
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
            return False
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_HINT_ROWS)
        except (RuntimeError, AttributeError):  # a torch build without the op
            self.packed = None
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16:
            if self.ops is not None and 0 < x.shape[0] <= GEMV_MAX_ROWS:
                y = self.ops.gemv_bf16(x, self.weight)
                return y if self.bias is None else y + self.bias
            if self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
