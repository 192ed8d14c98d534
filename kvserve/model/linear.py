"""A projection y = x·Wᵀ (+ b) that picks the fastest path for the rows it gets.

On the CPU in bf16, with kvserve's kernels:
- up to GEMV_MAX_ROWS rows (decode of a few requests) go to the GEMV kernel, which
  streams the weights once near memory bandwidth;
- up to AMX_MAX_ROWS rows (batched decode, mixed steps) go to the AMX kernel, on a copy of
  the weight packed once into AMX tiles (`kernels/amx_linear.cpp`): at these sizes oneDNN
  waits on memory far more than it computes;
- more rows (prefill chunks) go to oneDNN on a copy of the weight packed once in its own
  blocked layout, where oneDNN's blocking is the faster choice: on SmolLM2's gate/up
  projection (3072 × 576) at 2048 rows, 30 layers took 82-88 ms packed against 148-166 ms
  through F.linear (which re-packs per call) and 164-167 ms on the AMX kernel.
Without AMX, the oneDNN copy serves every row count above the GEMV's (packing on every
call otherwise costs as much as the multiply at decode batch sizes), and the GEMV reads a
copy in the AMX kernel's VNNI-tile layout, whose 16-column blocks it streams in order
(`gemv_vnni`; the AMX machines' GEMV still reads the row-major weight). Each packed copy
takes the memory of the weights it packs again (two copies with AMX or without: the
weights' memory three times over); `--no-prepack-weights` skips them. Elsewhere: F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GEMV_MAX_ROWS = 8
# measured on SmolLM2's projection shapes, 30 layers, hot cache: AMX 71 / 137 / 292 / 618 ms
# against F.linear's 82 / 141 / 358 / 540 ms at 256 / 512 / 1024 / 2048 rows
AMX_MAX_ROWS = 1024
# the AMX kernel's argmax epilogue (the greedy LM head) serves its decode-sized loop only
AMX_ARGMAX_MAX_ROWS = 128
# oneDNN picks its blocking from a row-count hint; any row count works with the result
_PACK_HINT_ROWS = 2048


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, ops=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.ops = ops
        self.packed: torch.Tensor | None = None  # oneDNN's layout
        self.amx_packed: torch.Tensor | None = None  # AMX tiles
        self.gemv_packed: torch.Tensor | None = None  # VNNI tiles for gemv_vnni (CPUs without AMX)

    def prepack(self) -> bool:
        """Make the packed copies this machine can use; True if there is at least one."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.bfloat16:
            return False
        n, k = w.shape
        if self.ops is not None and n % 16 == 0 and k % 32 == 0:
            if self.ops.amx_available():
                self.amx_packed = self.ops.amx_pack_weight(w.detach())
            else:  # the same layout, for the GEMV (the pack is a plain permute, no AMX needed)
                self.gemv_packed = self.ops.amx_pack_weight(w.detach())
        if torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_HINT_ROWS)
            except (RuntimeError, AttributeError):  # a torch build without the op
                self.packed = None
        return self.packed is not None or self.amx_packed is not None or self.gemv_packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16:
            rows = x.shape[0]
            if self.ops is not None and 0 < rows <= GEMV_MAX_ROWS:
                y = self.ops.gemv_bf16(x, self.weight) if self.gemv_packed is None else self.ops.gemv_vnni(x, self.gemv_packed)
                return y if self.bias is None else y + self.bias
            if self.amx_packed is not None and rows <= AMX_MAX_ROWS:
                return self.ops.amx_linear(x, self.amx_packed, self.bias)
            if self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def fused_argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax over this projection's outputs, taken as the AMX kernel computes
        them, so the [rows, N] product is never written (the LM head of a greedy decode step:
        64 rows × 49,152 bf16 logits). Bitwise the argmax of forward(x): same rounding, lowest
        index on ties. None where forward(x) would not use the AMX kernel: take its argmax."""
        rows = x.shape[0]
        if (
            self.amx_packed is not None
            and x.dtype == torch.bfloat16
            and GEMV_MAX_ROWS < rows <= min(AMX_MAX_ROWS, AMX_ARGMAX_MAX_ROWS)
        ):
            return self.ops.amx_linear_argmax(x, self.amx_packed, self.bias)
        return None
