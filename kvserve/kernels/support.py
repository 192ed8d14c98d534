"""Which kvserve kernels a loaded model runs, decided once at load, and why not where not.

Every limit a C++ kernel enforces is read from the compiled module (`ops.limits()`, the
constants in `kernels.h`) and checked here, against the model's shape, dtype and device and
the machine's features. A kernel whose limits the model falls outside is simply off, and its
callers take the plain-torch path: no shape reaches a kernel that would refuse it.

The model's parts ask this object, never the machine: `op(name)` hands out the compiled
module for a kernel that is on (None otherwise), and `plan_projection` says which layouts
one projection's weight is packed into and which row counts each serves. `kvserve serve`
prints `describe()` at start-up.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from kvserve.kernels.isa import bf16_pair_dots, cpu_supports_bf16
from kvserve.arch import ModelArchitecture

if TYPE_CHECKING:
    from kvserve.kernels.api import CpuOps

# AMX tiles beat oneDNN's packed weight up to this many rows; past it (prefill chunks)
# oneDNN's blocking wins. SmolLM2's projections, 30 layers, hot cache: AMX 71 / 137 / 292 /
# 618 ms against F.linear's 82 / 141 / 358 / 540 ms at 256 / 512 / 1024 / 2048 rows.
AMX_MAX_ROWS = 1024
# a decode batch of any size runs in one decode_layers call when every projection has a kernel
UNBOUNDED_ROWS = 1 << 30

@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """One kernel's verdict for this model: on or off, and the reason either way."""

    enabled: bool
    reason: str

    @classmethod
    def on(cls, reason: str) -> "KernelChoice":
        return cls(True, reason)

    @classmethod
    def off(cls, reason: str) -> "KernelChoice":
        return cls(False, reason)

    def __str__(self) -> str:
        return f"{'on ' if self.enabled else 'off'}  {self.reason}"


@dataclasses.dataclass(frozen=True)
class ProjectionPlan:
    """The layouts one [N, K] projection is kept in, and the rows each serves.

    Rows 1..gemv_max_rows go to the GEMV (on the VNNI-tile copy where `gemv_vnni`, else on
    the row-major weight); up to amx_max_rows to the AMX kernel; beyond, oneDNN's packed
    copy where `onednn`, else F.linear on the row-major weight. `keep_row_major` is False
    exactly when no path reads the row-major weight, which then goes.
    """

    gemv_max_rows: int
    gemv_vnni: bool
    amx_max_rows: int  # 0 = no AMX copy
    onednn: bool
    silu_interleaved: bool  # the AMX copy holds [gate; up] in alternating 16-row blocks
    argmax_max_rows: int  # the AMX argmax epilogue serves (gemv_max_rows, argmax_max_rows]; 0 = off
    gemv_all_rows: bool = False  # the VNNI-tile copy serves every row count (gemm_vnni): the one copy kept

    @property
    def keep_row_major(self) -> bool:
        return not self.gemv_vnni or not (self.onednn or self.gemv_all_rows)


def _onednn_packing_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (RuntimeError, AttributeError):
        return False


@dataclasses.dataclass(frozen=True)
class KernelSupport:
    """The verdicts for one loaded model. Build it with `decide`; `none()` is the all-torch one."""

    summary: str  # the kernel module and the machine features that matter
    decode_attention: KernelChoice
    prefill_attention: KernelChoice
    rms_norm: KernelChoice
    rope_and_cache: KernelChoice
    qk_norm: KernelChoice
    moe_route: KernelChoice
    silu_and_mul: KernelChoice
    argmax_rows: KernelChoice
    gemv: KernelChoice
    amx_linear: KernelChoice
    onednn_linear: KernelChoice
    silu_epilogue: KernelChoice
    argmax_epilogue: KernelChoice
    fused_decode: KernelChoice
    quant_linear: KernelChoice
    gemv_max_rows: int = 0
    amx_argmax_max_rows: int = 0
    tile_rows: int = 16
    tile_k: int = 32
    amx: bool = False
    level: str | None = None  # the ISA level of the loaded build (kvserve/kernels/isa.py); None: no kernels
    families: dict[str, str] = dataclasses.field(default_factory=dict)  # each family the build runs -> its level
    prepack_weights: bool = False
    deterministic: bool = False
    ops: CpuOps | None = dataclasses.field(default=None, repr=False, compare=False)

    # ---- decisions -----------------------------------------------------------------------

    @classmethod
    def none(cls, reason: str) -> "KernelSupport":
        off = KernelChoice.off(reason)
        return cls(reason, **{f.name: off for f in dataclasses.fields(cls) if f.type in ("KernelChoice", KernelChoice)})

    @classmethod
    def decide(
        cls, arch: ModelArchitecture, dtype: torch.dtype, device: torch.device, ops: CpuOps | None,
        prepack_weights: bool = True, kv_dtype: torch.dtype | None = None, deterministic: bool = False,
    ) -> "KernelSupport":
        """`ops`: the compiled module (kvserve.kernels.cpu_ops()), or None where it is off.
        `kv_dtype`: the KV pools' elements (None: the model's dtype); int8 pools carry scales.
        `deterministic`: only kernels whose sums have one order for every row count (bf16
        projections on the VNNI tiles for every row count, never AMX's or oneDNN's). Sets the
        process's bf16 tile format (ops.set_bf16_pair_dots, isa.bf16_pair_dots) for this engine."""
        if device.type != "cpu":
            return cls.none(f"the kernels are CPU kernels; this model runs on {device}")
        if ops is None:
            from kvserve.kernels import unavailable_reason

            return cls.none(f"not loaded ({unavailable_reason() or 'turned off in the engine config'})")
        if dtype not in (torch.bfloat16, torch.float32):
            return cls.none(f"the kernels take bfloat16 or float32, the model is {str(dtype).removeprefix('torch.')}")
        lim = ops.limits()
        amx = bool(ops.amx_available())
        level, families = ops.isa_level(), dict(ops.families())

        def family(*names: str) -> str | None:
            # a family the level's build has no code for: its kernels stay off
            missing = [n for n in names if n not in families]
            return f"no {' or '.join(missing)} kernels at the {level} level" if missing else None

        bf16 = dtype == torch.bfloat16
        g, hd = arch.queries_per_kv_head, arch.head_dim
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        int8_kv = kv_dtype == torch.int8
        # the attention and RoPE/cache kernels read pools of the model's dtype, or int8 ones
        kv_problem = None if int8_kv or kv_dtype == dtype else (
            f"KV pools of {str(kv_dtype).removeprefix('torch.')} under a {str(dtype).removeprefix('torch.')} model"
        )

        def multiple(value: int, of: int, what: str) -> str | None:
            return None if value % of == 0 else f"{what} {value} is not a multiple of {of}"

        def verdict(problems: list[str | None], why_on: str) -> KernelChoice:
            problems = [p for p in problems if p]
            return KernelChoice.off("; ".join(problems)) if problems else KernelChoice.on(why_on)

        # Gemma 2's cap · tanh(s / cap) on the scores, which every attention kernel applies before its softmax
        softcapped = "" if arch.attn_logit_softcapping is None else f", scores soft-capped at {arch.attn_logit_softcapping:g}"
        # int8 pools are read in 32-feature chunks, as bf16 ones
        hd_multiple = lim["decode_attention_head_dim_multiple_bf16" if bf16 or int8_kv else "decode_attention_head_dim_multiple_fp32"]
        decode_attention = verdict(
            [
                # the shared-prefix plan's parts (attention/shared_prefix_plan.py) are in the shared-prefix family
                family("decode_attention", "shared_prefix_attention"),
                kv_problem,
                multiple(hd, hd_multiple, "head_dim"),
                None if hd <= lim["decode_attention_max_head_dim"] else f"head_dim {hd} > {lim['decode_attention_max_head_dim']}",
                None if g <= lim["decode_attention_max_queries_per_kv_head"]
                else f"{g} query heads per KV head > {lim['decode_attention_max_queries_per_kv_head']}",
            ],
            f"in place over the block tables, g={g} query heads per KV row read"
            + (" (int8 K/V dequantized in registers)" if int8_kv else "") + softcapped,
        )
        prefill_attention = verdict(
            [family("prefill_attention"), None if bf16 else "bfloat16 only", kv_problem,
             multiple(hd, lim["prefill_attention_head_dim_multiple"], "head_dim")],
            # int8 K/V are packed into the same bf16 tiles (exactly), their scales applied to scores and probabilities
            "packed K/V tiles" + (" from int8 pools" if int8_kv else "") + f" at {families.get('prefill_attention')}"
            + softcapped,
        )
        rms_norm = verdict([family("norm_rope_act"), multiple(arch.hidden_size, lim["rms_norm_width_multiple"], "hidden_size")], "fused residual add")
        rope_and_cache = verdict(
            [family("norm_rope_act"), kv_problem, multiple(hd, lim["rope_head_dim_multiple"], "head_dim"),
             None if arch.rotary_dim == hd else f"partial rotary ({arch.rotary_dim} of head_dim {hd} turned)"],
            "RoPE and the K/V write" + (" (quantized to int8)" if int8_kv else "") + " in one pass",
        )
        # rms_norm's kernel over each q and k head's H features (rows of H); OLMoE's over the
        # whole Q and K projections (whole_projection_norm: any width)
        if arch.qk_norm_per_head:
            qk_norm = verdict([family("norm_rope_act"), multiple(hd, lim["rms_norm_width_multiple"], "head_dim")],
                              "rms_norm over each q and k head, before RoPE")
        elif arch.qk_norm_whole:
            qk_norm = verdict([family("norm_rope_act")], "q/k norms over the whole Q and K projections (fp32 sums), one pass")
        else:
            qk_norm = KernelChoice.off("no q/k norm in this architecture")
        # a sparse layer's router: fp32 logits, softmax and top k in one call
        moe_route = verdict([family("moe_route")], "fp32 logits, softmax and top k in one pass") if arch.num_experts \
            else KernelChoice.off("no sparse layers in this architecture")
        # the MLP's activation (SiLU, or Gemma's gelu_tanh: gelu_tanh_and_mul) times up, in one pass
        silu_and_mul = verdict([family("norm_rope_act"), multiple(arch.intermediate_size, lim["silu_width_multiple"], "intermediate_size")]
                               + [multiple(width, lim["silu_width_multiple"], name) for width, name in (
                                   (arch.moe_intermediate_size, "the experts' width"),
                                   (arch.shared_expert_intermediate_size, "the shared expert's width")) if width],
                               "one pass" if arch.hidden_act == "silu" else f"{arch.hidden_act}(gate)·up, one pass")
        argmax_rows = verdict([family("argmax")], "greedy rows of the sampler")

        # at the pair-dot levels the VNNI tiles' bf16 products take one of two formats
        # (isa.bf16_pair_dots), set here for the process: one format for every row count
        tile_format = ""
        if level in ("avx512-bf16", "amx"):
            pair, why = bf16_pair_dots(level=level, tiles_serve_every_row=not amx or deterministic)
            ops.set_bf16_pair_dots(pair)
            tile_format = f", bf16 {why}"
        # the GEMV reads the VNNI tiles wherever weights are prepacked (at amx, AMX's own copy)
        gemv = verdict([family("gemv"), None if bf16 else "bfloat16 weights only"],
                       f"1-{lim['gemv_max_rows']} rows " + ("on VNNI tiles" + tile_format if prepack_weights else "row-major"))
        amx_linear = verdict(
            [None if bf16 else "bfloat16 only",
             None if amx else "the CPU has no AMX-BF16" if level == "amx" else f"no AMX at the {level} level",
             None if prepack_weights else "weights not prepacked (--no-prepack-weights)",
             "--deterministic: the VNNI tiles serve every row count, in one summation order" if deterministic else None],
            f"{lim['gemv_max_rows'] + 1}-{AMX_MAX_ROWS} rows on AMX tiles",
        )
        onednn_linear = verdict(
            [None if bf16 else "bfloat16 only", None if prepack_weights else "weights not prepacked (--no-prepack-weights)",
             None if _onednn_packing_available() else "this torch build has no oneDNN weight packing",
             None if cpu_supports_bf16() else "oneDNN has no bf16 kernels for this CPU"],
            f"past {AMX_MAX_ROWS} rows on oneDNN's packed copy" if amx
            else "projections off the VNNI-tile grid (on it, the tiles serve every row count: one copy of the weight)",
        )
        silu_epilogue = verdict(
            [None if amx_linear.enabled else "needs the AMX linear kernel",
             multiple(arch.intermediate_size, lim["tile_rows"], "intermediate_size")],
            "silu(gate)·up applied as AMX tiles leave the accumulators",
        )
        argmax_epilogue = verdict(
            [None if amx_linear.enabled else "needs the AMX linear kernel",
             multiple(arch.vocab_size, lim["tile_rows"], "vocab_size")],
            f"greedy LM head of {lim['gemv_max_rows'] + 1}-{min(AMX_MAX_ROWS, lim['amx_argmax_max_rows'])} rows "
            "takes its argmax on AMX (no logits written)",
        )
        fused_decode = verdict(
            [None if bf16 else "bfloat16 only"]
            + [None if c.enabled else f"{name} is off"
               for name, c in (("decode attention", decode_attention), ("rms_norm", rms_norm),
                               ("rope_and_cache", rope_and_cache), ("silu_and_mul", silu_and_mul), ("GEMV", gemv))]
            + [None if qk_norm.enabled or not arch.qk_norm else "q/k norm is off",
               None if moe_route.enabled or not arch.num_experts else "the router is off",
               None if arch.fused_layer_refusal is None else f"the step does not run {arch.fused_layer_refusal}"],
            "all layers of a decode batch in one C++ call" if not arch.num_experts else
            # moe_token runs one token's experts; a batch's tokens are grouped by expert (model/moe.py)
            "all layers of a batch-1 decode step in one C++ call (its sparse layers' experts as at one "
            "token; larger batches group their tokens by expert, layer by layer)",
        )  # fmt: skip
        return cls(
            quant_linear=cls.quant_linear_choice(dtype, device, ops),
            summary=f"kvserve CPU kernels at the {level} level" + (" (AMX tiles granted)" if amx else ""),
            decode_attention=decode_attention, prefill_attention=prefill_attention, rms_norm=rms_norm,
            rope_and_cache=rope_and_cache, qk_norm=qk_norm, moe_route=moe_route, silu_and_mul=silu_and_mul,
            argmax_rows=argmax_rows, gemv=gemv,
            amx_linear=amx_linear, onednn_linear=onednn_linear, silu_epilogue=silu_epilogue,
            argmax_epilogue=argmax_epilogue, fused_decode=fused_decode, gemv_max_rows=lim["gemv_max_rows"],
            amx_argmax_max_rows=lim["amx_argmax_max_rows"], tile_rows=lim["tile_rows"], tile_k=lim["tile_k"], amx=amx,
            level=level, families=families,
            prepack_weights=prepack_weights, deterministic=deterministic, ops=ops,
        )  # fmt: skip

    @staticmethod
    def quant_linear_choice(dtype: torch.dtype, device: torch.device, ops: CpuOps | None) -> KernelChoice:
        """The verdict on quant_linear alone: the engine needs it before loading, to choose the
        format the weights are loaded in."""
        from kvserve.kernels import unavailable_reason

        if device.type != "cpu":
            return KernelChoice.off(f"a CPU kernel; this model runs on {device}")
        if ops is None:
            return KernelChoice.off(f"the CPU kernels are not loaded ({unavailable_reason() or 'turned off in the engine config'})")
        if dtype != torch.bfloat16:
            return KernelChoice.off(f"bfloat16 activations only; the model runs in {str(dtype).removeprefix('torch.')}")
        level, families = ops.isa_level(), ops.families()
        if "quant_linear" not in families:
            return KernelChoice.off(f"no quant_linear kernels at the {level} level")
        return KernelChoice.on(
            "block-quantized weights (GGUF Q8_0/Q4_0/Q4_1, repacked K-quants, int8/int4) as int8 dot products, "
            f"every row count, at {families['quant_linear']}"
        )

    def op(self, name: str):
        """The compiled module if kernel `name` (a KernelChoice field: rms_norm, rope_and_cache,
        qk_norm, moe_route, silu_and_mul, argmax_rows, decode_attention, prefill_attention) is on for this model,
        else None: the caller's plain-torch path."""
        return self.ops if getattr(self, name).enabled else None

    def plan_projection(
        self, out_features: int, in_features: int, *, silu_mul: bool = False, argmax: bool = False
    ) -> ProjectionPlan | None:
        """Where one projection's rows go; None = F.linear for every row count.

        `silu_mul`: the weight is [gate; up] and its output is read as silu(gate)·up;
        `argmax`: greedy steps read only each row's argmax (the LM head).
        """
        if not self.gemv.enabled:
            return None
        on_grid = out_features % self.tile_rows == 0 and in_features % self.tile_k == 0
        amx = self.amx_linear.enabled and on_grid
        interleaved = amx and silu_mul and self.silu_epilogue.enabled
        argmax_rows = min(AMX_MAX_ROWS, self.amx_argmax_max_rows) if amx and argmax and self.argmax_epilogue.enabled else 0
        # the GEMV reads a VNNI-tile copy, streamed in order: the row-major GEMV read ~22 GB/s
        # where the tiles read ~39 on a Zen 4, and on an AMX Xeon the default model's BF16
        # decode at amx ran 48-51 tok/s on the row-major weight, 64-70 on the tiles (BENCHMARKS)
        tiles = on_grid and self.prepack_weights
        vnni = tiles and (not self.amx or self.deterministic)
        return ProjectionPlan(
            gemv_max_rows=self.gemv_max_rows,
            gemv_vnni=tiles,
            amx_max_rows=AMX_MAX_ROWS if amx else 0,
            # without AMX the tiles also serve prefill (gemm_vnni, on a par with oneDNN's own
            # layout), so the weight is held once; oneDNN only for projections off their grid,
            # and past the AMX kernel's rows on AMX machines
            onednn=self.onednn_linear.enabled and not vnni,
            gemv_all_rows=vnni,
            silu_interleaved=interleaved,
            argmax_max_rows=argmax_rows,
        )

    def fused_decode_rows(self, projections_readable: bool) -> int:
        """The largest decode batch the fused step runs: any size when it can read every
        decoder projection (ops.linear serves every row count), else none."""
        return UNBOUNDED_ROWS if self.fused_decode.enabled and projections_readable else 0

    # ---- report ----------------------------------------------------------------------------

    def choices(self) -> dict[str, KernelChoice]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), KernelChoice)
        }

    def describe(self) -> str:
        """One line per kernel: on or off, and why; then the level each family's code runs at."""
        lines = [f"kernels: {self.summary}"]
        if self.families:
            lines.append("  families: " + ", ".join(f"{f} {lv}" for f, lv in sorted(self.families.items())))
        for name, choice in self.choices().items():
            lines.append(f"  {name.replace('_', ' '):<18} {choice}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, object]:
        return {"summary": self.summary, "level": self.level, "families": dict(self.families),
                **{n: dataclasses.asdict(c) for n, c in self.choices().items()}}
