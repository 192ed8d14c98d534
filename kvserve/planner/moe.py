"""A mixture of experts in the seed's arithmetic: what a decode step reads and computes.

A dense decode step reads every weight once, W = P·p_w, whatever the batch. A sparse layer's
token runs only its k chosen experts of E, so a step of B tokens reads the attention and
shared weights plus the experts any of its tokens chose. With routing uniform and independent
across tokens, the expected number of distinct experts per layer is

    E_touched(B) = E·(1 − (1 − k/E)^B),

between k (B = 1) and E (large B); at most min(E, k·B) (every token choosing experts no other
token chose). The weights read per step are then

    P_read(B) = P − P_routed + L_sparse·E_touched(B)·P_expert,     W(B) = P_read(B)·p_w,

and the FLOPs per token follow the active parameters, P_active = P − P_routed + L_sparse·k·P_expert.
So the projection stage of §4 is max(2·P_active·B/C, W(B)/β): the critical batch, where
compute overtakes the read, is no longer C·p_w/(2β) but the B solving
2·P_active·B/C = P_read(B)·p_w/β, which moves up with E/k (the read grows with B until every
expert is touched). Torch-free, like the rest of the planner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.arch import ModelArchitecture


@dataclass(frozen=True)
class ExpertShape:
    num_params: float  # P, every expert counted
    num_sparse_layers: int  # L_sparse
    num_experts: int  # E
    top_k: int  # k
    expert_params: float  # P_expert: one routed expert's gate, up and down

    @property
    def routed_params(self) -> float:
        """P_routed = L_sparse·E·P_expert: the weights a step reads only in part."""
        return self.num_sparse_layers * self.num_experts * self.expert_params

    @property
    def active_params(self) -> float:
        """P_active = P − P_routed + L_sparse·k·P_expert: what multiplies each token."""
        return self.num_params - self.routed_params + self.num_sparse_layers * self.top_k * self.expert_params

    def experts_touched(self, batch: float, bound: bool = False) -> float:
        """E·(1 − (1 − k/E)^B) distinct experts per layer under uniform routing; `bound`: min(E, k·B)."""
        e, k = self.num_experts, self.top_k
        if bound:
            return min(e, k * batch)
        return e * (1 - (1 - k / e) ** batch)

    def params_read(self, batch: float, bound: bool = False) -> float:
        """P_read(B) = P − P_routed + L_sparse·E_touched(B)·P_expert."""
        return self.num_params - self.routed_params + self.num_sparse_layers * self.experts_touched(batch, bound) * self.expert_params

    def read_fraction(self, batch: float) -> float:
        """P_read(B)/P: the share of the weights one step of B tokens reads."""
        return self.params_read(batch) / self.num_params

    def critical_batch(self, peak_flops_per_s: float, hbm_bytes_per_s: float, bytes_per_weight: float) -> float:
        """The B where 2·P_active·B/C = P_read(B)·p_w/β: compute overtakes the weight read (it
        always does: the read stops growing at P)."""

        def compute_minus_read(b: float) -> float:
            return 2 * self.active_params * b / peak_flops_per_s - self.params_read(b) * bytes_per_weight / hbm_bytes_per_s

        lo, hi = 0.0, 1.0
        while compute_minus_read(hi) < 0:
            lo, hi = hi, hi * 2
            if hi > 1e12:
                return math.inf
        for _ in range(100):  # bisection: compute − read is convex in B (the read is concave), negative at 0: one root
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if compute_minus_read(mid) < 0 else (lo, mid)
        return hi


def expert_shape(arch: ModelArchitecture, num_params: float | None = None) -> ExpertShape | None:
    """The expert shape of a mixture of experts (None for a dense model). `num_params`: P as the
    plan counts it (a GGUF's tensor sum), else the shape's own count."""
    if not arch.num_experts:
        return None
    return ExpertShape(
        num_params=float(num_params if num_params is not None else arch.num_params),
        num_sparse_layers=arch.num_sparse_layers, num_experts=arch.num_experts, top_k=arch.num_experts_per_tok,
        expert_params=float(arch.expert_params()),
    )  # fmt: skip
