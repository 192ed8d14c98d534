"""bf16 weights on the CPU with kvserve's kernels: GEMV, AMX tiles, oneDNN's packed layout.

The plan (`KernelSupport.plan_projection`) says which layouts to keep; this method makes
them once after loading and hands them to the C++ `linear` as one `ops.Projection`, which
dispatches by row count. Python and the fused decode step call that same `linear`, so they
can never choose differently. The layouts:
- the GEMV (1-8 rows, decode of a few requests) streams the weights once near memory
  bandwidth, on the VNNI-tile copy (`amx_pack_weight`'s layout, a plain permute), which on
  AMX machines is the AMX kernel's copy too (but for an interleaved [gate; up]);
- AMX tiles (9-1024 rows: batched decode, mixed steps), where oneDNN waits on memory far
  more than it computes; for [gate; up] the tiles interleave gate and up 16-row blocks so the
  kernel applies silu(gate)·up as it writes (no [T, 2I] product written and read back; 30
  layers at 64 rows: 10.1-10.4 ms against 11.1-11.6);
- oneDNN's blocked copy past that on AMX machines (prefill chunks): on SmolLM2's gate/up (3072 × 576) at 2048 rows, 30 layers took 82-88 ms packed
  against 148-166 ms through F.linear, which re-packs per call.
Without AMX the VNNI-tile copy serves every row count (gemm_vnni: tiles of 8 rows of the
GEMV's kernel, on a par with oneDNN on its own layout), so the weight is held once; oneDNN is
kept only for projections off the tile grid. `--no-prepack-weights` keeps only the
row-major weight.
"""

from __future__ import annotations

import torch

from kvserve.kernels import layouts
from kvserve.kernels.support import ProjectionPlan
from kvserve.model.linear_methods.base import LinearMethod

# oneDNN picks its blocking from a row-count hint; any row count works with the result
_ONEDNN_HINT_ROWS = 2048


class CpuBf16LinearMethod(LinearMethod):
    name = "cpu-bf16"

    def __init__(self, ops, plan: ProjectionPlan, silu_ops=None):
        super().__init__(silu_ops)
        self.ops = ops
        self.plan = plan

    def process_weights_after_loading(self, layer) -> None:
        plan, ops = self.plan, self.ops
        w = layer.weight.detach()
        gemv = ops.amx_pack_weight(w) if plan.gemv_vnni else None
        amx = None
        if plan.amx_max_rows:  # the GEMV's tiles are the AMX kernel's layout: one copy unless gate/up interleave
            amx = gemv if gemv is not None and not plan.silu_interleaved else ops.amx_pack_weight(
                layouts.interleave_gate_up(w) if plan.silu_interleaved else w)
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, _ONEDNN_HINT_ROWS) if plan.onednn else None
        if not plan.keep_row_major:
            layer.weight = None  # the packed copies serve every row count
        layer.kernel = ops.Projection(
            weight=layer.weight.detach() if layer.weight is not None else None,
            gemv=gemv,
            amx=amx,
            onednn=onednn,
            bias=layer.bias.detach() if layer.bias is not None else None,
            gemv_max_rows=plan.gemv_max_rows,
            amx_max_rows=plan.amx_max_rows,
            silu_interleaved=plan.silu_interleaved,
            gemv_all_rows=plan.gemv_all_rows,
        )

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, layer.kernel)

    def apply_silu_mul(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.silu_ops is None:  # intermediate size off the kernel's grid: torch's silu
            return super().apply_silu_mul(layer, x)
        return self.ops.linear_silu_mul(x, layer.kernel)

    def argmax(self, layer, x: torch.Tensor) -> torch.Tensor | None:
        """The AMX kernel's argmax epilogue: each row's argmax of the bf16 outputs, taken as
        the tiles are computed, so the [rows, N] product is never written (the LM head of a
        greedy step: 64 rows × 49,152 logits). Bitwise the argmax of apply(): same rounding,
        lowest index on ties. None where apply() would not use the AMX kernel."""
        if self.plan.gemv_max_rows < x.shape[0] <= self.plan.argmax_max_rows:
            return self.ops.amx_linear_argmax(x, layer.kernel.amx, layer.kernel.bias)
        return None

    def fused_projection(self, layer):
        return layer.kernel

    def embedding_rows(self, layer, ids: torch.Tensor) -> torch.Tensor:
        if layer.weight is not None:
            return super().embedding_rows(layer, ids)
        return self.ops.bf16_tile_rows(layer.kernel.gemv, ids)  # no row-major copy kept for lookups

    def batch_invariant(self, layer) -> bool:
        # the GEMV and gemm_vnni's tiles sum each output in one order (kernels/gemv.cpp);
        # AMX's tiles, oneDNN and F.linear each have orders of their own
        p = self.plan
        return p.gemv_vnni and p.gemv_all_rows and not p.amx_max_rows

    def describe(self, layer) -> str:
        p = self.plan
        parts = [f"GEMV 1-{p.gemv_max_rows} rows ({'VNNI tiles' if p.gemv_vnni else 'row-major'})"]
        if p.amx_max_rows:
            parts.append(f"AMX {p.gemv_max_rows + 1}-{p.amx_max_rows}" + (" with silu·up" if p.silu_interleaved else ""))
        parts.append("VNNI tiles beyond (one copy)" if p.gemv_all_rows else "oneDNN packed beyond" if p.onednn else "F.linear beyond")
        if not p.keep_row_major:
            parts.append("no row-major copy")
        return f"{self.name}: " + ", ".join(parts)
