"""What a linear method is: the one owner of a projection's weight format and kernel path.

A method is chosen once per projection at load (`choose_linear_method`), from the model,
dtype, machine and flags that `KernelSupport` has already weighed. It then
- `process_weights_after_loading(layer)`: packs `layer.weight` into the layouts its kernels
  read, and drops any copy none of them reads;
- `apply(layer, x)`: y = x·Wᵀ (+ b), dispatching by row count;
- `apply_silu_mul(layer, x)`: silu(gate)·up for a [gate; up] layer, where it has an epilogue;
- `argmax(layer, x)`: each row's argmax of apply(layer, x) without writing it, or None;
- `fused_projection(layer)`: what the fused decode step (kernels/fused_decode.cpp) reads for
  this projection, or None if that step cannot run it;
- `embedding_rows(layer, ids)`: rows of the weight, read from whichever layout is held (an
  embedding table is a Linear too, tied or not, so it is held once).

A new weight format is one new method beside this one plus its kernels; the model code
never asks which format it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvserve.model.linear import Linear


class LinearMethod:
    name = "abstract"

    def __init__(self, silu_ops=None):
        self.silu_ops = silu_ops  # the compiled silu_and_mul, where KernelSupport allows it

    def process_weights_after_loading(self, layer: "Linear") -> None:
        """Pack the weight for this method's kernels (nothing to do by default)."""

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply_silu_mul(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        gate_up = self.apply(layer, x)
        if self.silu_ops is not None:
            return self.silu_ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def argmax(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor | None:
        return None

    def fused_projection(self, layer: "Linear"):
        return None

    def embedding_rows(self, layer: "Linear", ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight: the lookup of an embedding table held as this layer (a tied
        LM head's table is held once, in its head's layout)."""
        return F.embedding(ids, layer.weight)

    def batch_invariant(self, layer: "Linear") -> bool:
        """Whether a row's output bits are the same whatever the number of rows in the call
        (one summation order over K for every row count): --deterministic needs it."""
        return False

    def describe(self, layer: "Linear") -> str:
        return self.name
