"""Float weights through F.linear: any device and dtype; the reference the kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model.linear_methods.base import LinearMethod


class TorchLinearMethod(LinearMethod):
    name = "torch"

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)
