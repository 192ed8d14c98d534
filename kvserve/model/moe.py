"""A sparse layer's FFN (mixture of experts): each token's top-k experts, each chosen expert's
weights read once per step for all the tokens routed to it, experts nobody chose not read.

The router runs in fp32 whatever the model's dtype: logits x·Rᵀ, a softmax over all E experts,
the top k, renormalised to sum 1 where the architecture says (`norm_topk_prob`; Mixtral always).
The step's (token, expert) pairs are sorted by expert (a stable sort: within an expert its tokens
keep their order), so each chosen expert runs once, as a SiLU MLP (model/layers.py) over the rows
routed to it, through the same linear methods as a dense FFN: every weight format and kernel
level the engine runs. Each row's contribution, times its routing weight, is added into an fp32
sum in expert order, so a row's result depends neither on which other tokens share its experts
(the quantized kernels' rows are batch-invariant) nor on the order of the batch. A shared
expert (Qwen2-MoE) runs on every token, gated by sigmoid(x·g), and joins the sum last, as in
transformers. A batch-1 step (one token) skips the sort, and where the experts are quantized
runs its k experts' [gate; up] as one quant_linear call over their stacked segments (the same
bits as k calls: each output row is one weight row's dot with the same quantized x). That
batch-1 path also runs inside the fused decode step (`decode_moe`, kernels/fused_decode.cpp),
the same calls in C++, so a batch-1 step of a mixture of experts is one call as well.

`ExpertCounts` tallies what the steps read: experts touched per sparse layer and their weight
bytes (as held: a quantized expert's codes, scales and minima), for the metrics and the benches.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kvserve.arch import ModelArchitecture
from kvserve.kernels.support import KernelSupport
from kvserve.model.layers import SiluMLP
from kvserve.model.linear_methods.cpu_quant import CpuQuantLinearMethod


@dataclasses.dataclass
class ExpertCounts:
    """Running totals over every forward pass of the model: (layer, expert) pairs that ran, the
    bytes of their weights, the sparse-layer passes (each layer of each step once), and the
    bytes a pass reading every expert would have read (the dense equivalent). Under tensor
    parallelism, this rank's share of each expert's bytes."""

    experts_touched: int = 0
    expert_weight_bytes: int = 0
    layer_passes: int = 0
    all_experts_bytes: int = 0

    def snapshot(self) -> tuple[int, int, int]:
        return self.experts_touched, self.expert_weight_bytes, self.layer_passes


def _mlp_bytes(mlp: SiluMLP) -> int:
    return mlp.gate_up.stored_bytes + mlp.down.stored_bytes


class SparseMoE(nn.Module):
    """Routed experts (and a shared one where the architecture has it) from the weights under
    `prefix` (`model.layers.{i}.mlp`, families/experts.py's names), popped as they are built."""

    def __init__(
        self, arch: ModelArchitecture, w: dict[str, torch.Tensor], prefix: str, kernels: KernelSupport, counts: ExpertCounts,
    ):  # fmt: skip
        super().__init__()
        self.num_experts = arch.num_experts
        self.top_k = arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        self.counts = counts
        self.router = nn.Parameter(w.pop(f"{prefix}.gate.weight").float().contiguous(), requires_grad=False)  # [E, d], fp32
        self.route_ops = kernels.op("moe_route")  # the router in one kernel call (moe_route), else torch
        self.experts = nn.ModuleList(
            SiluMLP(*(w.pop(f"{prefix}.experts.{e}.{p}_proj.weight") for p in ("gate", "up", "down")), kernels)
            for e in range(arch.num_experts)
        )
        self.shared_expert = self.shared_expert_gate = None
        if arch.shared_expert_intermediate_size:
            self.shared_expert = SiluMLP(*(w.pop(f"{prefix}.shared_expert.{p}_proj.weight") for p in ("gate", "up", "down")), kernels)
            gate = w.pop(f"{prefix}.shared_expert_gate.weight").float().reshape(1, -1)
            self.shared_expert_gate = nn.Parameter(gate, requires_grad=False)
        self._expert_bytes: list[int] | None = None  # each expert's, once its weights are processed
        self._token_experts = None  # (ops, ops.MoeExperts) for moe_token, False where it cannot run, once decided
        self._decode_moe = None  # the ops.DecodeMoe of decode_moe(), built once: its `chosen` after each fused step
        self._all_bytes = 0

    def expert_bytes(self, e: int) -> int:
        """Bytes of expert e's weights as loaded (its format's codes, scales and minima)."""
        if self._expert_bytes is None:  # counted once, after the weights are in their format
            self._expert_bytes = [_mlp_bytes(m) for m in self.experts]
            self._all_bytes = sum(self._expert_bytes)
        return self._expert_bytes[e]

    @property
    def all_bytes(self) -> int:
        """Bytes of every routed expert of this layer."""
        self.expert_bytes(0)
        return self._all_bytes

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, experts [T, k]) of each token: softmax over all experts in fp32, the top k.
        On the kernel, as moe_token and the fused step route (kernels/core/moe_route.h)."""
        if self.route_ops is not None:  # on only for bf16 and fp32 models (KernelSupport.decide)
            return self.route_ops.moe_route(x.contiguous(), self.router, self.top_k, self.norm_topk_prob)
        probs = torch.nn.functional.linear(x.float(), self.router).softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        kernel = self._token_kernel() if tokens == 1 else None
        if kernel is not None:  # batch-1 decode, the whole layer in C++
            ops, experts = kernel
            out, chosen = ops.moe_token(x, self.router, experts, self.top_k, self.norm_topk_prob)
            self._count(self.top_k, sum(self.expert_bytes(e) for e in chosen.tolist()))
            return self._add_shared(x, out)
        weights, chosen = self.route(x)
        if tokens == 1:  # batch-1 decode: the k experts in index order, the same sums as below without the sort
            return self._one_token(x, weights, chosen)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # the (token, expert) pairs grouped by expert, tokens in order
        rows_of = order // self.top_k
        weight_of = weights.flatten()[order]
        out = torch.zeros(tokens, x.shape[1], dtype=torch.float32)
        start = touched = read = 0
        for e, n in enumerate(torch.bincount(flat, minlength=self.num_experts).tolist()):
            if not n:
                continue
            rows, w = rows_of[start : start + n], weight_of[start : start + n]
            start += n
            y = self.experts[e](x.index_select(0, rows))
            out.index_add_(0, rows, y.float() * w.unsqueeze(1))
            touched += 1
            read += self.expert_bytes(e)
        self._count(touched, read)
        return self._add_shared(x, out)

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        pairs = sorted(zip(chosen[0].tolist(), weights[0].tolist()))
        experts = [e for e, _ in pairs]
        hidden = self._gate_up_at_once(experts, x)
        out = torch.zeros(1, x.shape[1], dtype=torch.float32)
        read = 0
        for j, (e, w) in enumerate(pairs):
            mlp = self.experts[e]
            y = mlp(x) if hidden is None else mlp.down(hidden[j : j + 1])
            out += y.float() * w
            read += self.expert_bytes(e)
        self._count(len(pairs), read)
        return self._add_shared(x, out)

    def _token_kernel(self):
        """(ops, ops.MoeExperts) where every expert is on the quantized kernels with the silu
        kernel (then kernels/moe_token.cpp runs one token's layer: the same ops as
        _one_token, without the Python between them), else None. Decided once."""
        if self._token_experts is None:
            ups = [m.gate_up for m in self.experts]
            downs = [m.down for m in self.experts]
            quant = all(isinstance(lin.method, CpuQuantLinearMethod) and lin.method.segments and lin.bias is None
                        for lin in ups + downs)  # fmt: skip
            method = ups[0].method
            if quant and method.silu_ops is not None and not downs[0].method.float_out:
                ops = method.ops
                self._token_experts = (ops, ops.MoeExperts([u.method.segments for u in ups], [d.method.segments for d in downs]))
            else:
                self._token_experts = False
        return self._token_experts or None

    def decode_moe(self, ops):
        """ops.DecodeMoe: this layer as the fused decode step runs it for one token
        (kernels/fused_decode.cpp: moe_token for quantized experts, else each expert's
        projections; the shared expert after), the same calls as forward() at one token; None
        where forward() would take a path it does not (an activation off the silu kernel, a
        projection with no fused form). Its `chosen` then says what each step ran (count_fused_step).
        Built once: the projections are packed once (Linear.process_weights_after_loading), and
        the load's fused-step check and every DecodeModel build share it."""
        if self._decode_moe is not None:
            return self._decode_moe
        shared = {}
        if self.shared_expert is not None:
            mlp = self.shared_expert
            gate_up, down = mlp.gate_up.fused_projection(), mlp.down.fused_projection()
            if gate_up is None or down is None or mlp.gate_up.method.silu_ops is None:
                return None
            shared = dict(shared_gate_up=gate_up, shared_down=down, shared_gate=self.shared_expert_gate.detach())
        token = self._token_kernel()
        if token is not None:
            experts = dict(experts=token[1])
        else:  # forward()'s _one_token: each float expert whole (SiluMLP on the silu kernel)
            ups, downs = [m.gate_up for m in self.experts], [m.down for m in self.experts]
            projections = [lin.fused_projection() for lin in ups + downs]
            if (None in projections or any(isinstance(lin.method, CpuQuantLinearMethod) for lin in ups + downs)
                    or any(lin.method.silu_ops is None for lin in ups)):
                return None
            experts = dict(expert_gate_up=projections[: len(ups)], expert_down=projections[len(ups) :])
        self._decode_moe = ops.DecodeMoe(router=self.router.detach(), top_k=self.top_k,
                                         norm_topk_prob=self.norm_topk_prob, **experts, **shared)  # fmt: skip
        return self._decode_moe

    def count_fused_step(self) -> None:
        """Count the step the fused decode step just ran (the experts it left in `chosen`)."""
        self._count(self.top_k, sum(self.expert_bytes(e) for e in self._decode_moe.chosen))

    def _gate_up_at_once(self, experts: list[int], x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate)·up [k, F] of one token's k experts in one quant_linear call over their
        segments stacked (each output row is its own weight row's dot with the same quantized
        x, so the bits are each expert's own call's); None where their [gate; up] are not on
        the quantized kernels (then each expert runs whole)."""
        lins = [self.experts[e].gate_up for e in experts]
        if not all(isinstance(lin.method, CpuQuantLinearMethod) and lin.method.segments for lin in lins):
            return None
        method = lins[0].method
        stacked = method.ops.Projection(quant=[s for lin in lins for s in lin.method.segments], float_out=False, bias=None)
        gate_up = method.ops.linear(x, stacked).view(len(lins), -1)
        if method.silu_ops is not None:
            return method.silu_ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def _count(self, touched: int, read: int) -> None:
        counts = self.counts
        counts.experts_touched += touched
        counts.expert_weight_bytes += read
        counts.layer_passes += 1
        counts.all_experts_bytes += self.all_bytes

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is not None:
            gate = torch.sigmoid(torch.nn.functional.linear(x.float(), self.shared_expert_gate))
            out += gate * self.shared_expert(x).float()
        return out.to(x.dtype)

    def mlps(self) -> list[tuple[str, SiluMLP]]:
        """(kind, MLP) of each expert, routed then shared: their projections' kinds in reports."""
        shared = [("shared_expert", self.shared_expert)] if self.shared_expert is not None else []
        return [("expert", m) for m in self.experts] + shared
