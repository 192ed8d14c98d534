"""The compiled CPU kernel module, declared with types: what `kvserve.kernels.cpu_ops()` returns.

Declaration only (nothing here runs a kernel): `CpuOps` lists every name the module binds
(kernels/bindings.cpp), with its signature as pybind11 exposes it (parameters without a
name in the binding are positional-only) and a line on what it does; `Projection`,
`DecodeLayer` and `DecodeModel` are its classes (the structs of kernels/kernels.h), whose
constructors take keywords only. Tensors a Projection lacks are None. The shape limits
behind each kernel's checks come from `limits()`; kernels.h says what each key means.
tests/kernels/test_bindings.py keeps this list and the module's in step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class Projection(Protocol):
    """One projection y = x·Wᵀ (+ b) as its kernels read it, filled once per weight by the linear method."""

    def __init__(
        self,
        *,
        weight: torch.Tensor | None = None,
        gemv: torch.Tensor | None = None,
        amx: torch.Tensor | None = None,
        onednn: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        gemv_max_rows: int = 0,
        amx_max_rows: int = 0,
        silu_interleaved: bool = False,
        gemv_all_rows: bool = False,
        quant: Sequence[QuantSegment] = (),
        float_out: bool = False,
    ) -> None: ...

    @property
    def weight(self) -> torch.Tensor | None:
        """Row-major [N, K] bf16; None where no kernel reads it."""

    @property
    def gemv(self) -> torch.Tensor | None:
        """amx_pack_weight(W) for gemv_vnni; None: gemv_bf16 reads `weight`."""

    @property
    def amx(self) -> torch.Tensor | None:
        """AMX tiles for amx_linear (with silu_interleaved: the gate/up-interleaved pack for amx_linear_silu_mul)."""

    @property
    def onednn(self) -> torch.Tensor | None:
        """oneDNN's blocked layout (torch.ops.mkldnn._reorder_linear_weight)."""

    @property
    def bias(self) -> torch.Tensor | None:
        """[N] bias, or None."""

    @property
    def gemv_max_rows(self) -> int:
        """1..gemv_max_rows rows go to the GEMV; 0: no GEMV."""

    @property
    def amx_max_rows(self) -> int:
        """(gemv_max_rows, amx_max_rows] rows go to the AMX kernel; 0: no AMX."""

    @property
    def silu_interleaved(self) -> bool:
        """`amx` holds [gate; up] with their 16-row blocks interleaved."""

    @property
    def gemv_all_rows(self) -> bool:
        """`gemv` (VNNI tiles) serves every row count: gemm_vnni past gemv_max_rows."""

    @property
    def quant(self) -> list[QuantSegment]:
        """The block-quantized weight (quant_linear serves every row count); empty for float weights."""

    @property
    def float_out(self) -> bool:
        """quant: fp32 results (the LM head)."""


class QuantSegment(Protocol):
    """Output columns (a multiple of 16) of one block-quantized format, in the layout of kvserve/kernels/layouts.py."""

    def __init__(
        self, *, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None, format: int,
        sub: torch.Tensor | None = None,
    ) -> None: ...

    @property
    def codes(self) -> torch.Tensor:
        """uint8 [N/16, K/32, 512 (8-bit), 384 (6-bit) or 256 (4-bit)]."""

    @property
    def scales(self) -> torch.Tensor:
        """fp16 [N/16, K/32, 16], [N/16, 1, 16] for one scale per output column, [N/16, K/256, 16] for the K-quants' d."""

    @property
    def mins(self) -> torch.Tensor | None:
        """fp16, as `scales`, for the formats that store a minimum (the K-quants' dmin)."""

    @property
    def format(self) -> int:
        """QUANT_Q8, QUANT_Q4, QUANT_Q4_MIN, QUANT_Q8_MIN, QUANT_Q4_K or QUANT_Q6_K."""

    @property
    def sub(self) -> torch.Tensor | None:
        """The K-quants' per-block scales, uint8 [N/16, K/32, 32] (kernels/layouts.py); None otherwise."""


class MoeExperts(Protocol):
    """A layer's routed experts as moe_token reads them: each expert's quantized [gate; up] and down segments."""

    def __init__(
        self, gate_up: Sequence[Sequence[QuantSegment]], down: Sequence[Sequence[QuantSegment]], float_out: bool = False
    ) -> None: ...


class DecodeMoe(Protocol):
    """A sparse layer's FFN as decode_layers runs it for one token: quantized experts by moe_token
    (`experts`), float ones by their projections (`expert_gate_up`, `expert_down`), with the
    shared expert where the architecture has one; each step leaves the experts it ran in `chosen`."""

    def __init__(
        self,
        *,
        router: torch.Tensor,
        top_k: int,
        norm_topk_prob: bool,
        experts: MoeExperts | None = None,
        expert_gate_up: Sequence[Projection] = (),
        expert_down: Sequence[Projection] = (),
        shared_gate_up: Projection | None = None,
        shared_down: Projection | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> None: ...

    @property
    def router(self) -> torch.Tensor:
        """fp32 [experts, d]."""

    @property
    def top_k(self) -> int:
        """Experts per token."""

    @property
    def norm_topk_prob(self) -> bool:
        """The top k's weights renormalised to sum 1."""

    @property
    def chosen(self) -> list[int]:
        """The experts the last step ran, in index order (empty before the first)."""

    @property
    def shared_gate(self) -> torch.Tensor | None:
        """fp32 [1, d]: the shared expert's sigmoid gate; None where there is no shared expert."""


class DecodeLayer(Protocol):
    """One decoder layer's RMSNorm weights and projections, as decode_layers runs them."""

    def __init__(
        self,
        *,
        input_norm: torch.Tensor,
        post_attention_norm: torch.Tensor,
        qkv: Projection,
        o: Projection,
        gate_up: Projection | None = None,
        down: Projection | None = None,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        attn_out_norm: torch.Tensor | None = None,
        mlp_out_norm: torch.Tensor | None = None,
        gelu: bool = False,
        local: bool = False,
        kv_group: int = 0,
        moe: DecodeMoe | None = None,
        qk_norm_whole: bool = False,
    ) -> None: ...

    @property
    def input_norm(self) -> torch.Tensor:
        """RMSNorm weight before attention."""

    @property
    def q_norm(self) -> torch.Tensor | None:
        """Per-head RMSNorm weight [H] of the query heads (Qwen3), applied before RoPE (with
        qk_norm_whole, over the whole Q projection); None where the model has none."""

    @property
    def k_norm(self) -> torch.Tensor | None:
        """The same for the key heads."""

    @property
    def post_attention_norm(self) -> torch.Tensor:
        """RMSNorm weight before the MLP."""

    @property
    def qkv(self) -> Projection:
        """The fused Q, K, V projection."""

    @property
    def o(self) -> Projection:
        """The attention output projection."""

    @property
    def gate_up(self) -> Projection:
        """The fused [gate; up] projection (linear_silu_mul; with gelu, linear then gelu_tanh_and_mul); unset with moe."""

    @property
    def down(self) -> Projection:
        """The MLP's down projection; unset with moe."""

    @property
    def attn_out_norm(self) -> torch.Tensor | None:
        """RMSNorm weight on the attention output before the residual add (Gemma); None where the model has none."""

    @property
    def mlp_out_norm(self) -> torch.Tensor | None:
        """RMSNorm weight on the MLP output before the residual add (Gemma); None where the model has none."""

    @property
    def gelu(self) -> bool:
        """The MLP is gelu_tanh(gate) * up (Gemma's GeGLU), else silu(gate) * up."""

    @property
    def local(self) -> bool:
        """RoPE from the model's local tables (Gemma 3's sliding-window layers)."""

    @property
    def kv_group(self) -> int:
        """Which of the step's slot mappings and block tables (one per KV group) the layer's pools are indexed by."""

    @property
    def moe(self) -> DecodeMoe | None:
        """A sparse layer's routed experts (then gate_up and down are unset); None for a dense MLP."""

    @property
    def qk_norm_whole(self) -> bool:
        """q_norm and k_norm are RMSNorms over the whole Q and whole K projection (OLMoE), not per head."""


class DecodeModel(Protocol):
    """Every layer, the KV pools and the shapes of one loaded model (rebuilt when the pools are rebound)."""

    def __init__(
        self,
        *,
        layers: Sequence[DecodeLayer],
        k_pools: Sequence[torch.Tensor],
        v_pools: Sequence[torch.Tensor],
        cos_half: torch.Tensor,
        sin_half: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        k_scales: Sequence[torch.Tensor] = (),
        v_scales: Sequence[torch.Tensor] = (),
        cos_local: torch.Tensor | None = None,
        sin_local: torch.Tensor | None = None,
        softcap: float = 0.0,
    ) -> None: ...

    @property
    def layers(self) -> list[DecodeLayer]:
        """The decoder layers, in order."""

    @property
    def k_pools(self) -> list[torch.Tensor]:
        """Each layer's K pool [num_blocks, block_size, N_kv, H]."""

    @property
    def v_pools(self) -> list[torch.Tensor]:
        """Each layer's V pool, shaped as its K pool."""

    @property
    def cos_half(self) -> torch.Tensor:
        """RoPE cosines [max_pos, H/2] fp32."""

    @property
    def sin_half(self) -> torch.Tensor:
        """RoPE sines [max_pos, H/2] fp32."""

    @property
    def num_heads(self) -> int:
        """Query heads."""

    @property
    def num_kv_heads(self) -> int:
        """KV heads."""

    @property
    def head_dim(self) -> int:
        """Features per head."""

    @property
    def eps(self) -> float:
        """RMSNorm epsilon."""

    @property
    def scale(self) -> float:
        """Attention scale (head_dim ** -0.5)."""

    @property
    def k_scales(self) -> list[torch.Tensor]:
        """int8 K pools' scales [num_blocks, block_size, N_kv] fp32, one per layer; empty for float pools."""

    @property
    def v_scales(self) -> list[torch.Tensor]:
        """int8 V pools' scales, shaped as k_scales; empty for float pools."""

    @property
    def cos_local(self) -> torch.Tensor | None:
        """The local layers' RoPE cosines (their own base), shaped as cos_half; None where no layer is local."""

    @property
    def sin_local(self) -> torch.Tensor | None:
        """The local layers' RoPE sines; None where no layer is local."""

    @property
    def softcap(self) -> float:
        """The attention scores' soft-cap (Gemma 2), 0.0 where there is none."""


class SharedPrefixLevel(Protocol):
    """One shared level of a decode step's plan (attention/shared_prefix_plan.py SharedLevel)."""

    def __init__(self, *, members: torch.Tensor, blocks: torch.Tensor, num_positions: int) -> None: ...

    @property
    def members(self) -> torch.Tensor:
        """int64 [n]: the decode rows that share the level, ascending."""

    @property
    def blocks(self) -> torch.Tensor:
        """int32 [P]: the level's physical blocks, the same at these table indices in every member's table."""

    @property
    def num_positions(self) -> int:
        """Positions of the blocks the level covers (<= P * block_size)."""


class SharedPrefixDecodePlan(Protocol):
    """A decode step's shared-prefix plan, shared by all layers."""

    def __init__(self, *, suffix_start: torch.Tensor, levels: Sequence[SharedPrefixLevel]) -> None: ...

    @property
    def suffix_start(self) -> torch.Tensor:
        """int32 [B]: each row's first position after its deepest level (0 without one)."""

    @property
    def levels(self) -> list[SharedPrefixLevel]:
        """The levels, outer before the levels inside them."""


class CpuOps(Protocol):
    """Every name the compiled module binds."""

    Projection: type[Projection]
    QuantSegment: type[QuantSegment]
    MoeExperts: type[MoeExperts]
    QUANT_Q8: int
    QUANT_Q4: int
    QUANT_Q4_MIN: int
    QUANT_Q8_MIN: int
    QUANT_Q4_K: int
    QUANT_Q6_K: int
    DecodeMoe: type[DecodeMoe]
    DecodeLayer: type[DecodeLayer]
    DecodeModel: type[DecodeModel]
    SharedPrefixLevel: type[SharedPrefixLevel]
    SharedPrefixDecodePlan: type[SharedPrefixDecodePlan]

    def isa_level(self) -> str:
        """The ISA level this build was compiled for (kvserve/kernels/isa.py LEVELS)."""

    def families(self) -> dict[str, str]:
        """Each kernel family this build has code for -> the level that code is compiled at."""

    def limits(self) -> dict[str, int]:
        """Every shape limit the kernels enforce, by snake_case key (kernels.h lists what each means)."""

    def amx_available(self) -> bool:
        """AMX-BF16 present and granted to this process."""

    def amx_pack_weight(self, w: torch.Tensor, /) -> torch.Tensor:
        """[N, K] bf16 weight -> VNNI tiles [N/16, K/32, 16, 32] for the AMX kernels and gemv_vnni."""

    def bf16_tile_rows(self, tiles: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64 [T]) of the weight amx_pack_weight packed -> [T, K] bf16: an embedding
        lookup with no row-major copy (layouts.bf16_tile_rows in one call, the same bits)."""

    def amx_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ w.T (+ bias) on AMX tiles."""

    def amx_linear_silu_mul(self, x: torch.Tensor, packed: torch.Tensor, /) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) on AMX tiles, gate/up packed with their 16-row blocks interleaved."""

    def amx_linear_argmax(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's argmax of x @ w.T (+ bias) rounded to bf16, without writing the product (amx_argmax_max_rows rows at most)."""

    def gemv_bf16(self, x: torch.Tensor, w: torch.Tensor, /) -> torch.Tensor:
        """y = x @ w.T for 1..gemv_max_rows rows, bf16, w row-major."""

    def gemv_vnni(self, x: torch.Tensor, packed: torch.Tensor, /) -> torch.Tensor:
        """y = x @ w.T for 1..gemv_max_rows rows, bf16, on amx_pack_weight(w)."""

    def set_bf16_pair_dots(self, on: bool) -> bool:
        """The bf16 GEMM on the VNNI tiles by VDPBF16PS pair dots (True) or weights widened to fp32 FMAs
        (False), for every later call of the process; returns what is in effect (always False at a level
        without pair dots). kvserve/kernels/__init__.py sets it once at load (isa.bf16_pair_dots)."""

    def bf16_pair_dots(self) -> bool:
        """Whether the bf16 GEMM on the VNNI tiles takes VDPBF16PS pair dots."""

    def gemm_vnni(self, x: torch.Tensor, packed: torch.Tensor, /) -> torch.Tensor:
        """y = x @ w.T for any number of rows, bf16, on amx_pack_weight(w)."""

    def quant_linear(
        self, x: torch.Tensor, segments: Sequence[QuantSegment], bias: torch.Tensor | None = None,
        float_out: bool = False,
    ) -> torch.Tensor:
        """y = x @ W.T (+ bias), W the segments stacked by rows; x (bf16 or fp32, any rows) quantized to int8 per
        row and block of 32 and multiplied as int8 dot products (the result in x's dtype, fp32 if float_out)."""

    def quant_linear_rows(
        self, x: torch.Tensor, per_row: Sequence[Sequence[QuantSegment]], float_out: bool = False
    ) -> torch.Tensor:
        """y[r] = x[r] @ W_r.T, W_r = per_row[r]'s segments stacked by rows (the same out features for every
        row, no bias), in one parallel pass; row r's bits are quant_linear(x[r:r+1], per_row[r])'s."""

    def moe_token(
        self, x: torch.Tensor, router: torch.Tensor, experts: MoeExperts, top_k: int, norm_topk_prob: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token [1, d]'s routed experts: the fp32 router's top k (softmax, then renormalised where
        norm_topk_prob), their [gate; up] in one quant_linear, silu·up, the downs in one quant_linear_rows,
        the fp32 sum in expert order; (out [1, d] fp32, the experts run in index order). moe.py's one-token path."""

    def quant_embedding(
        self, ids: torch.Tensor, segments: Sequence[QuantSegment], in_features: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows `ids` of the block-quantized W, dequantized to [len(ids), in_features] in dtype."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """RMSNorm(x) * weight; with residual, residual += x first (in place) and the norm reads it."""

    def rope_and_cache(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        /,
    ) -> torch.Tensor:
        """RoPE on Q and K of the fused QKV rows, K/V written to their pool slots; returns Q [T, N_q, H]."""

    def rope_and_cache_int8(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        /,
    ) -> torch.Tensor:
        """rope_and_cache into int8 pools: K (after RoPE) and V quantized per (slot, KV head), scales into
        k_scale / v_scale [num_blocks, block_size, N_kv] fp32 (kvserve/attention/kv_pool.py quantize_kv); returns Q."""

    def qk_sum_squares(self, qkv: torch.Tensor, q_size: int, kv_size: int) -> torch.Tensor:
        """(Σ q², Σ k²) of each QKV row [T, q_size + 2·kv_size] in fp32: [T, 2] (a rank's partial sums)."""

    def whole_projection_norm(
        self,
        qkv: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        q_size: int,
        kv_size: int,
        q_width: float,
        k_width: float,
        eps: float,
        sums: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """OLMoE's q/k norms: q·rsqrt(Σq²/q_width + eps)·q_weight, the same for k, v as it is, each product
        rounded to the dtype as RMSNorm's; `sums` [T, 2] fp32 (qk_sum_squares, AllReduced under tensor
        parallelism), else each row's own."""

    def moe_route(
        self, x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's router choice: softmax over x·routerᵀ in fp32, the top k (largest first, ties to the
        lower expert), renormalised to sum 1 where norm_topk_prob: (weights fp32 [T, k], experts int64 [T, k])."""

    def silu_and_mul(self, gate_up: torch.Tensor, /) -> torch.Tensor:
        """[T, 2F] -> silu(gate) * up, [T, F]."""

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor, /) -> torch.Tensor:
        """[T, 2F] -> gelu_tanh(gate) * up, [T, F] (Gemma's GeGLU)."""

    def argmax_rows(self, x: torch.Tensor, /) -> torch.Tensor:
        """Row-wise argmax of [R, V], ties to the lowest index (int64 [R])."""

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """One new query per request over its cached positions, read from the paged pool; [B, N_q, H].
        int8 pools come with their scales (AVX512 path, never AMX). `softcap` > 0 caps each score to
        softcap * tanh(score / softcap) before the softmax (Gemma 2), as every attention kernel here does."""

    def paged_decode_attention_lse(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        start_positions: torch.Tensor,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        softcap: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """paged_decode_attention over each row's positions [start_positions[b], context_lens[b]) only (the suffix
        after a shared prefix): (out [B, N_q, H] fp32, normalised; lse [B, N_q] fp32 = max + log sum exp(scale q.k)).
        An empty range gives out 0, lse -inf. bf16, fp32 or int8 pools (int8 with their scales)."""

    def shared_prefix_attention(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        prefix_blocks: torch.Tensor,
        prefix_len: int,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        softcap: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A group's query rows q [n, N_q, H] bf16 against the first prefix_len positions of the shared blocks
        prefix_blocks (int32 [P]), non-causal, each K/V row read once for the group: (out [n, N_q, H] fp32,
        normalised; lse [n, N_q] fp32). prefix_len 0 gives out 0, lse -inf. A row's result does not depend on the
        group's other rows (bitwise). bf16 or int8 pools (int8 with their scales)."""

    def merge_attention_states(
        self,
        out_a: torch.Tensor,
        lse_a: torch.Tensor,
        out_b: torch.Tensor,
        lse_b: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two attention parts of the same rows (out [..., H] fp32, lse [...] fp32) merged through their
        log-sum-exp in fp32: (out in out_dtype (fp32 or bf16), merged lse fp32). lse -inf is an empty part; both
        empty give 0 and -inf."""

    def shared_prefix_decode_attention(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        plan: SharedPrefixDecodePlan,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Decode attention of q [B, N_q, H] bf16 in the plan's parts: every row's suffix
        (paged_decode_attention_lse), then each level's members against its blocks (shared_prefix_attention),
        merged into the rows in place in fp32, suffix first, levels outer to inner. Returns [B, N_q, H] bf16."""

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        segments: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        shared: torch.Tensor | None = None,
        softcap: float = 0.0,
    ) -> None:
        """Causal attention of prompt tokens over the paged pool, written into out at the segments' rows.
        int8 pools come with their scales. `shared` int64 [n, 2] (leader, shared_len): a segment's first
        shared_len positions (a multiple of 64 within its history) are read from its leader's packed K/V."""

    def linear(self, x: torch.Tensor, projection: Projection) -> torch.Tensor:
        """y = x @ W.T (+ b), the kernel chosen by x's rows from the projection's fields (kernels.h)."""

    def linear_silu_mul(self, x: torch.Tensor, projection: Projection) -> torch.Tensor:
        """silu(gate) * up of a [gate; up] projection of x: the fused AMX kernel where it applies, else linear then silu_and_mul."""

    def decode_layers(
        self,
        model: DecodeModel,
        h: torch.Tensor,
        positions: torch.Tensor,
        slot_mappings: Sequence[torch.Tensor],
        block_tables: Sequence[torch.Tensor],
        context_lens: torch.Tensor,
        shared_prefixes: Sequence[SharedPrefixDecodePlan | None] = (),
        window_starts: Sequence[torch.Tensor | None] = (),
    ) -> torch.Tensor:
        """Every decoder layer of a decode batch in one call; the residual stream after the last (before the final
        norm). slot_mappings, block_tables: one per KV group, each layer reading its kv_group's. shared_prefixes:
        empty, or one shared-prefix plan per KV group over its blocks (None where a group has none); a layer of a
        group with a plan attends by shared_prefix_decode_attention.
        window_starts: empty, or per layer each row's first visible position (int32 [B], max(0, len - W)) where
        the layer's sliding window is seen past this step, else None; such a layer attends over [start, len)
        only (paged_decode_attention_lse, as attention/sliding_window.py)."""
