"""The one decoder every family runs (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, and the mixtures of
experts Mixtral, Qwen2/3-MoE, OLMoE: their sparse layers' FFN is model/moe.py's) over a flat
batch of tokens from many requests.

`forward(input_ids[T], positions[T], meta)` runs every layer for all T new positions of
the step, reading and appending the paged KV cache; `compute_logits` projects only the
hidden states of positions that will be sampled. Which kernel runs each part was decided
once at load (`KernelSupport`); the layers only call what they were given.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from kvserve.attention.metadata import AttentionMetadata, GroupedMetadata
from kvserve.attention.kv_pool import write_kv
from kvserve.attention.paged import paged_attention
from kvserve.distributed.request_layout import RequestExchange, RequestHeads, RequestShardedMetadata, RequestStep
from kvserve.kernels.support import KernelSupport
from kvserve.memory import release_free_memory
from kvserve.arch import ModelArchitecture, RopeScaling
from kvserve.model.layers import GeluTanhMLP, RMSNorm, RotaryEmbedding, SiluMLP, apply_rotary, longrope_long
from kvserve.model.linear import Linear, cat_rows
from kvserve.model.moe import ExpertCounts, SparseMoE
from kvserve.model.quant_formats import QuantizedWeight


class RopeInputs:
    """The step's positions, with cos/sin rows looked up once (lazily) for all layers."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype):
        self.positions = positions
        self.cos_half = rotary.cos_half
        self.sin_half = rotary.sin_half
        self._rotary = rotary
        self._dtype = dtype
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos_sin is None:
            self._cos_sin = self._rotary.lookup(self.positions, self._dtype)
        return self._cos_sin


class LlamaAttention(nn.Module):
    def __init__(
        self, arch: ModelArchitecture, w: dict[str, torch.Tensor], prefix: str, kernels: KernelSupport,
        window: int | None = None, tp=None, kv_replication: int = 1,
    ):
        super().__init__()
        self.window = window  # a sliding window's width, None for full attention (attention/sliding_window.py)
        self.softcap = arch.attn_logit_softcapping  # Gemma 2: scores capped before the softmax (kernels and torch alike)
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.attention_scale
        # Q, K and V in one matmul: one pass over the activations instead of three
        qkv = cat_rows([w.pop(f"{prefix}.{n}_proj.weight") for n in "qkv"])
        bias = torch.cat([w.pop(f"{prefix}.{n}_proj.bias") for n in "qkv"], dim=0) if arch.attention_bias else None
        self.qkv = Linear(qkv, bias, kernels)
        self.o = Linear(w.pop(f"{prefix}.o_proj.weight"), None, kernels)
        # Qwen3: RMSNorm over each q and k head (weights [H], shared by the heads), before RoPE
        self.q_norm = self.k_norm = None
        self.whole_norm: WholeProjectionNorm | None = None
        if arch.qk_norm_whole:  # OLMoE: over all of q's and all of k's features, this rank's share of them
            self.whole_norm = WholeProjectionNorm(
                w.pop(f"{prefix}.q_norm.weight"), w.pop(f"{prefix}.k_norm.weight"), self.q_size, self.kv_size,
                arch.rms_norm_eps, tp, kv_replication, kernels.op("qk_norm"),
            )  # fmt: skip
        elif arch.qk_norm:
            ops = kernels.op("qk_norm")
            self.q_norm = _norm(arch, w, f"{prefix}.q_norm.weight", ops)
            self.k_norm = _norm(arch, w, f"{prefix}.k_norm.weight", ops)
        self.rope_ops = kernels.op("rope_and_cache")
        self.decode_ops = kernels.op("decode_attention")
        self.prefill_ops = kernels.op("prefill_attention")
        self.k_pool: torch.Tensor | None = None
        self.v_pool: torch.Tensor | None = None
        # int8 pools' scales [blocks, block_size, N_kv] fp32 (kvserve/attention/kv_pool.py quantize_kv); None for float pools
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, rope: RopeInputs, meta: AttentionMetadata | RequestStep) -> torch.Tensor:
        qkv = self.qkv(x)
        if self.whole_norm is not None:  # before the requests layout's exchange: its statistics span the ranks' heads
            qkv = self.whole_norm(qkv)
        if isinstance(meta, RequestStep):
            # the requests KV layout (distributed/request_layout.py): this rank's heads of every
            # row go to the rows' ranks; all heads of this rank's own rows come back, attend
            # over its pool, and return to the ranks whose heads they are
            ex = meta.exchange
            full = ex.to_requests(qkv)
            heads = ex.heads
            if ex.local_rows:
                out = self.attend(full, meta.rope, meta.local, heads.num_heads, heads.num_kv_heads)
            else:
                out = full.new_empty((0, heads.num_heads * self.head_dim))
            return self.o(ex.to_heads(out))
        return self.o(self.attend(qkv, rope, meta, self.num_heads, self.num_kv_heads))

    def attend(
        self, qkv: torch.Tensor, rope: RopeInputs, meta: AttentionMetadata, num_heads: int, num_kv_heads: int
    ) -> torch.Tensor:
        """RoPE, the new K/V into the pool, attention: [T, (N_q + 2·N_kv)·H] → [T, N_q·H]."""
        tokens = qkv.shape[0]
        q = self.rope_and_cache(qkv, rope, meta, num_heads, num_kv_heads)
        out = paged_attention(
            q, self.k_pool, self.v_pool, meta, self.scale, self.decode_ops, self.prefill_ops, self.k_scale, self.v_scale,
            self.window, self.softcap,
        )
        return out.reshape(tokens, num_heads * self.head_dim)

    def rope_and_cache(
        self, qkv: torch.Tensor, rope: RopeInputs, meta: AttentionMetadata, num_heads: int, num_kv_heads: int
    ) -> torch.Tensor:
        """RoPE on Q and K; the new K/V written to their slots before anyone attends. Returns Q."""
        if self.q_norm is not None:
            qkv = norm_heads_(qkv.contiguous(), self.q_norm, self.k_norm, num_heads, num_kv_heads, self.head_dim)
        if self.rope_ops is not None and self.k_scale is not None:
            return self.rope_ops.rope_and_cache_int8(
                qkv, rope.positions, rope.cos_half, rope.sin_half, self.k_pool, self.v_pool, self.k_scale, self.v_scale,
                meta.slot_mapping, num_heads, num_kv_heads, self.head_dim,
            )  # fmt: skip
        if self.rope_ops is not None:
            return self.rope_ops.rope_and_cache(
                qkv, rope.positions, rope.cos_half, rope.sin_half, self.k_pool, self.v_pool, meta.slot_mapping,
                num_heads, num_kv_heads, self.head_dim,
            )  # fmt: skip
        tokens = qkv.shape[0]
        q_size, kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        cos, sin = rope.cos_sin()
        q = apply_rotary(q.reshape(tokens, num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.reshape(tokens, num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(tokens, num_kv_heads, self.head_dim)
        write_kv(self.k_pool, self.v_pool, meta.slot_mapping, k, v, self.k_scale, self.v_scale)
        return q


def norm_heads_(
    qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_heads: int, num_kv_heads: int, head_dim: int
) -> torch.Tensor:
    """Qwen3's q/k norm on a QKV output [T, (N_q + 2·N_kv)·H], in place: each query head's H
    features through q_norm, each key head's through k_norm, V as it is. Rows of H, so the
    kernel path is rms_norm's own (kernels/fused_decode.cpp norm_heads_ does the same)."""
    tokens = qkv.shape[0]
    heads = qkv.view(tokens, num_heads + 2 * num_kv_heads, head_dim)
    for first, count, norm in ((0, num_heads, q_norm), (num_heads, num_kv_heads, k_norm)):
        rows = heads[:, first : first + count]
        # contiguous: with one KV head the key rows are a strided view, which rms_norm's kernel does not take
        rows.copy_(norm(rows.reshape(tokens * count, head_dim).contiguous()).view(tokens, count, head_dim))
    return qkv


class WholeProjectionNorm(nn.Module):
    """OLMoE's q and k norms: RMSNorm over the whole Q projection (N_q·H features) and the whole
    K projection, on a QKV output [T, (N_q + 2·N_kv)·H], V as it is. Under tensor parallelism a
    rank holds some heads: the sums of squares are AllReduced (a KV head held by r ranks counted
    once: its sum divided by r), so every rank normalises by the whole projection's RMS.
    `ops`: the compiled module where KernelSupport turned qk_norm on (whole_projection_norm:
    the sums and the normalised rows in one pass each, no ATen op between), else None."""

    def __init__(self, q_weight, k_weight, q_size: int, kv_size: int, eps: float, tp=None, kv_replication: int = 1,
                 ops=None):  # fmt: skip
        super().__init__()
        self.ops = ops
        self.q_weight = nn.Parameter(q_weight, requires_grad=False)
        self.k_weight = nn.Parameter(k_weight, requires_grad=False)
        self.q_size, self.kv_size, self.eps = q_size, kv_size, eps
        self.tp = tp if tp is not None and tp.world > 1 else None
        self.kv_replication = kv_replication
        world = 1 if self.tp is None else self.tp.world
        # the whole projections' widths: every rank's share of q; of k, each KV head once
        self.q_width, self.k_width = q_size * world, kv_size * world // kv_replication

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and qkv.is_contiguous() and qkv.dtype == self.q_weight.dtype:
            return self._kernel(qkv)
        q, k, v = qkv.float().split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        sums = torch.stack([q.pow(2).sum(-1), k.pow(2).sum(-1) / self.kv_replication], dim=-1)  # [T, 2]
        if self.tp is not None:
            sums = self.tp.all_reduce(sums)
        q = q * torch.rsqrt(sums[:, :1] / self.q_width + self.eps)
        k = k * torch.rsqrt(sums[:, 1:] / self.k_width + self.eps)
        # as transformers' RMSNorm: the normalised features in the model's dtype, then times w
        dtype = qkv.dtype
        return torch.cat([self.q_weight * q.to(dtype), self.k_weight * k.to(dtype), v.to(dtype)], dim=-1)

    def _kernel(self, qkv: torch.Tensor) -> torch.Tensor:
        sums = None
        if self.tp is not None:  # this rank's partial sums, AllReduced as the torch path's
            sums = self.ops.qk_sum_squares(qkv, self.q_size, self.kv_size)
            if self.kv_replication != 1:
                sums[:, 1] /= self.kv_replication
            sums = self.tp.all_reduce(sums)
        return self.ops.whole_projection_norm(qkv, self.q_weight, self.k_weight, self.q_size, self.kv_size,
                                              float(self.q_width), float(self.k_width), self.eps, sums)  # fmt: skip


def _rope_divisors(weights: dict, arch: ModelArchitecture, max_positions: int) -> torch.Tensor | None:
    """A GGUF's per-frequency RoPE divisors: llama3's `rope_freqs`, or LongRoPE's long or short
    factors (the set the served context calls for); None where the config's scaling says it all."""
    if "rope_factors_long" in weights:
        return weights["rope_factors_long" if longrope_long(arch, max_positions) else "rope_factors_short"]
    return weights.get("rope_freqs")


def _all_reduce(tp, x: torch.Tensor) -> torch.Tensor:
    """Σ over the tensor-parallel ranks (none without a group), in fp32 whatever the model's
    dtype: each rank's partial output is added without a bf16 rounding after every addition,
    and the total is rounded to the model's dtype once."""
    if tp is None or tp.world == 1:
        return x
    if x.dtype == torch.float32:
        return tp.all_reduce(x)
    return tp.all_reduce(x.float()).to(x.dtype)


def _norm(arch: ModelArchitecture, w: dict[str, torch.Tensor], name: str, ops) -> RMSNorm:
    """An RMSNorm from weight `name`, its stored w made the (offset + w) it is applied as (Gemma)."""
    weight = w.pop(name)
    if arch.norm_weight_offset:
        weight = (weight.float() + arch.norm_weight_offset).to(weight.dtype)
    return RMSNorm(weight, arch.rms_norm_eps, ops)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP; with `arch.sandwich_norms` (Gemma 3) each branch's output is
    normalised too before it joins the residual stream, and the MLP is GeGLU where the
    architecture says so. `local`: the layer attends with the local RoPE base (Gemma 3)."""

    def __init__(
        self, arch: ModelArchitecture, w: dict[str, torch.Tensor], index: int, kernels: KernelSupport, tp=None,
        expert_counts: ExpertCounts | None = None, kv_replication: int = 1,
    ):  # fmt: skip
        super().__init__()
        self.tp = tp  # distributed/group.py TensorParallelGroup, or None
        self.local = arch.layer_is_local(index)
        self.kv_group = 0  # its KV group (engine/kv_groups.py), set with its pools
        p = f"model.layers.{index}"
        norm_ops = kernels.op("rms_norm")
        self.input_layernorm = _norm(arch, w, f"{p}.input_layernorm.weight", norm_ops)
        self.self_attn = LlamaAttention(arch, w, f"{p}.self_attn", kernels, arch.layer_window(index), tp, kv_replication)
        # the norm before the MLP: Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm
        self.attn_out_norm = self.mlp_out_norm = None
        if arch.sandwich_norms:
            self.attn_out_norm = _norm(arch, w, f"{p}.post_attention_layernorm.weight", norm_ops)
            self.post_attention_layernorm = _norm(arch, w, f"{p}.pre_feedforward_layernorm.weight", norm_ops)
            self.mlp_out_norm = _norm(arch, w, f"{p}.post_feedforward_layernorm.weight", norm_ops)
        else:
            self.post_attention_layernorm = _norm(arch, w, f"{p}.post_attention_layernorm.weight", norm_ops)
        if arch.layer_is_sparse(index):  # routed experts (model/moe.py)
            self.mlp = SparseMoE(arch, w, f"{p}.mlp", kernels, expert_counts if expert_counts is not None else ExpertCounts())
        else:
            gate, up, down = (w.pop(f"{p}.mlp.{n}_proj.weight") for n in ("gate", "up", "down"))
            mlp = GeluTanhMLP if arch.hidden_act == "gelu_tanh" else SiluMLP
            self.mlp = mlp(gate, up, down, kernels)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm residual stream: `residual` carries the sum, `h` the latest branch output.
        Under tensor parallelism O and down are row-parallel: their partial sums are AllReduced."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x = self.input_layernorm(h, residual)
        h = _all_reduce(self.tp, self.self_attn(x, rope, meta))
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)
        x = self.post_attention_layernorm(h, residual)
        h = _all_reduce(self.tp, self.mlp(x))
        if self.mlp_out_norm is not None:
            h = self.mlp_out_norm(h)
        return h, residual


class LlamaForCausalLM(nn.Module):
    """`arch` is this rank's share under tensor parallelism (distributed/sharding.py: its
    heads and FFN columns), and `weights` are cut to it; `tp` and `vocab` (this rank's
    [first, end) of the vocabulary, and every rank's share size) join the shares;
    `request_heads`: the requests KV layout's head bookkeeping (None: the heads layout)."""

    def __init__(
        self, arch: ModelArchitecture, weights: dict[str, torch.Tensor], max_positions: int, kernels: KernelSupport,
        tp=None, vocab: tuple[int, int] | None = None, vocab_sizes: list[int] | None = None,
        request_heads: RequestHeads | None = None, kv_replication: int = 1,
    ):  # fmt: skip
        super().__init__()
        self.arch = arch
        self.expert_counts = ExpertCounts()  # what the sparse layers' experts read, all steps (model/moe.py)
        self.kernels = kernels
        self.tp = tp if tp is not None and tp.world > 1 else None
        self.vocab = vocab or (0, arch.vocab_size)
        self.vocab_sizes = vocab_sizes or [arch.vocab_size]
        # the layers take (pop) their weights from `weights` as they are built
        embed = weights.pop("model.embed_tokens.weight")
        self._dtype = torch.bfloat16 if isinstance(embed, QuantizedWeight) else embed.dtype
        self.layers = nn.ModuleList()
        for i in range(arch.num_layers):
            self.layers.append(LlamaDecoderLayer(arch, weights, i, kernels, self.tp, self.expert_counts, kv_replication))
            if kernels.ops is not None:
                # packed as each layer is built, so the float copies a packing replaces go layer
                # by layer and the load's peak memory stays near the model's final footprint
                for lin in self.layers[-1].modules():
                    if isinstance(lin, Linear):
                        lin.process_weights_after_loading()
                release_free_memory()  # the float copies just replaced, given back before the next layer
        # the sparse layers, listed once: every fused decode step counts their experts
        self._sparse_layers = tuple(layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE))
        self.norm = _norm(arch, weights, "model.norm.weight", kernels.op("rms_norm"))
        self.lm_head = Linear(embed if arch.tie_word_embeddings else weights.pop("lm_head.weight"), None, kernels, argmax=True)
        # the embedding table is a Linear too, read row by row from whatever layout it is held
        # in; tied, it is the LM head itself (one copy, in the head's layout)
        self.embed_tokens = self.lm_head if arch.tie_word_embeddings else Linear(embed, None, kernels)
        for lin in (self.lm_head, self.embed_tokens):
            if kernels.ops is not None:
                lin.process_weights_after_loading()
        self.rotary = RotaryEmbedding(arch, max_positions, _rope_divisors(weights, arch, max_positions))
        # Gemma 3's local layers: their own base, no scaling
        self.local_rotary = None
        if arch.rope_local_theta is not None:
            local = dataclasses.replace(arch, rope_theta=arch.rope_local_theta, rope_scaling=RopeScaling())
            self.local_rotary = RotaryEmbedding(local, max_positions)
        # Gemma: embeddings × √hidden, the factor rounded to the activations' dtype first as transformers does
        self._embed_scale = None if arch.embedding_scale == 1.0 else torch.tensor(arch.embedding_scale, dtype=self._dtype)
        self.fused_decode = True  # tests turn it off to compare with the layer-by-layer path
        self.request_heads = request_heads
        self._decode_model = None  # ops.DecodeModel, built on the first fused step
        self._fused_rows = 0  # set once the weights are processed

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype."""
        return self._dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self._embed_rows(input_ids)
        return h if self._embed_scale is None else h * self._embed_scale

    def _embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.embed_tokens.embedding_rows(input_ids)
        # vocab-parallel: this rank's rows where the id is in its share, zeros elsewhere, summed
        lo, hi = self.vocab
        mine = (input_ids >= lo) & (input_ids < hi)
        rows = self.embed_tokens.embedding_rows(torch.where(mine, input_ids - lo, torch.zeros_like(input_ids)))
        return _all_reduce(self.tp, rows * mine.unsqueeze(-1).to(rows.dtype))

    def projections(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    def process_weights_after_loading(self) -> None:
        """Let every projection's method pack its weight (once the model is on its device)."""
        for lin in self.projections():
            lin.process_weights_after_loading()
        self._decode_model = None
        # the step reads every decoder projection through its method (the LM head is not part of it)
        readable = all(
            lin.fused_projection() is not None for lin in self.projections() if lin not in (self.lm_head, self.embed_tokens)
        )
        rows = self.kernels.fused_decode_rows(readable)
        # a sparse layer runs one token in the step (moe_token); larger batches group tokens by expert
        sparse = self.sparse_layers()
        if sparse and rows:
            rows = 1 if all(moe.decode_moe(self.kernels.ops) is not None for moe in sparse) else 0
        self._fused_rows = rows

    def bind_kv_cache(
        self, k_pools: list[torch.Tensor], v_pools: list[torch.Tensor],
        k_scales: list[torch.Tensor] | None = None, v_scales: list[torch.Tensor] | None = None,
        kv_groups: list[int] | None = None,
    ) -> None:
        """Each layer's K/V pools; with int8 pools, their scale pools too. `kv_groups`: each
        layer's KV group (engine/kv_groups.py), whose tables index its pool; all 0 without groups."""
        no_scales = [None] * len(self.layers)
        for layer, group in zip(self.layers, kv_groups or [0] * len(self.layers)):
            layer.kv_group = group
        for layer, k_pool, v_pool, k_scale, v_scale in zip(
            self.layers, k_pools, v_pools, k_scales or no_scales, v_scales or no_scales
        ):
            attn = layer.self_attn
            attn.k_pool, attn.v_pool, attn.k_scale, attn.v_scale = k_pool, v_pool, k_scale, v_scale
        self._decode_model = None

    def projection_kinds(self) -> dict[str, list[Linear]]:
        """Every projection by kind (qkv, o, gate_up, down, lm_head)."""
        kinds: dict[str, list[Linear]] = {"qkv": [], "o": [], "gate_up": [], "down": []}
        for layer in self.layers:
            kinds["qkv"].append(layer.self_attn.qkv)
            kinds["o"].append(layer.self_attn.o)
            # a sparse layer's experts by kind: expert.gate_up, expert.down, shared_expert.*
            mlps = layer.mlp.mlps() if isinstance(layer.mlp, SparseMoE) else [("", layer.mlp)]
            for prefix, mlp in mlps:
                for part in ("gate_up", "down"):
                    kinds.setdefault(f"{prefix}.{part}" if prefix else part, []).append(getattr(mlp, part))
        kinds["lm_head"] = [self.lm_head]
        return {kind: lins for kind, lins in kinds.items() if lins}

    def weight_bytes(self, exclude: tuple[nn.Module, ...] = (), decode: bool = False) -> int:
        """Bytes of every weight as held (each packed copy once; a tied table once), leaving
        out the modules in `exclude` (and everything inside them). `decode`: of each bf16
        projection only the copy a decode step's GEMV reads (its VNNI tiles, else the
        row-major weight), not the copies kept for larger row counts."""
        skipped = {id(p) for m in exclude for p in m.parameters()}
        left_out = {id(sub) for m in exclude for sub in m.modules()}
        lins = [lin for lin in self.projections() if id(lin) not in left_out]
        if decode:  # the row-major copies a GEMV on its tiles does not read
            skipped |= {id(lin.weight) for lin in lins if lin.weight is not None and getattr(lin.kernel, "gemv", None) is not None}
        tensors = [p for p in self.parameters() if id(p) not in skipped]
        tables = {id(b) for r in (self.rotary, self.local_rotary) if r is not None for b in r.buffers()}
        tensors += [b for b in self.buffers() if id(b) not in tables]
        for lin in lins:
            if lin.kernel is not None and hasattr(lin.kernel, "gemv"):
                k = lin.kernel
                copies = ((k.gemv if k.gemv is not None else k.weight),) if decode else (k.weight, k.gemv, k.amx, k.onednn)
                tensors += [t for t in copies if t is not None]
            if lin.qweight is not None:
                tensors += [t for seg in lin.qweight.segments for t in seg.tensors]
        # one count per storage (a tied table is held once); an opaque oneDNN copy has no data pointer
        return sum({(t.data_ptr() if t.layout == torch.strided else id(t)): t.numel() * t.element_size() for t in tensors}.values())

    def stored_weight_bytes(self) -> int:
        """Bytes of the weights in their loaded format, one copy each (a tied table once):
        what `kvserve plan run --num-chips N` computes per chip (planner/weight_shares.py).
        `weight_bytes` adds the copies the kernels packed beside or instead of them."""
        total = 0
        for module in self.modules():  # each module once: a tied embedding is the LM head
            if isinstance(module, Linear):
                total += module.stored_bytes
            else:
                total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        return total

    def decode_weight_bytes(self, routed_experts: bool = True) -> int:
        """Bytes of the weights a decode step reads in full: all but an untied embedding table
        (one row of it is read), each projection in the copy its GEMV reads. A quantized format
        counts its codes, scales and minima.
        `routed_experts=False`: without a mixture of experts' routed experts, of which a step
        reads only those chosen (ExpertCounts says which: model/moe.py)."""
        untied = () if self.embed_tokens is self.lm_head else (self.embed_tokens,)
        experts = () if routed_experts else tuple(moe.experts for moe in self.sparse_layers())
        return self.weight_bytes(exclude=untied + experts, decode=True)

    def sparse_layers(self) -> list[SparseMoE]:
        """The routed-expert FFNs of a mixture of experts' sparse layers (none for a dense model)."""
        return list(self._sparse_layers)

    def describe_projections(self) -> str:
        """Each projection kind's format, kernels and compute format, and the weights' bytes."""
        lines = [f"weights: {self.weight_bytes() / 2**20:,.1f} MiB as held"]
        for kind, lins in self.projection_kinds().items():
            counts: dict[str, int] = {}
            for lin in lins:
                key = lin.method.describe(lin)
                counts[key] = counts.get(key, 0) + 1
            for key, n in counts.items():
                lines.append(f"  {kind:<8} x{n:<3} {key}")
        if self.embed_tokens is self.lm_head:
            lines.append("  embedding      the LM head's table (tied), rows read from its layout")
        else:
            lines.append(f"  embedding      {self.embed_tokens.method.describe(self.embed_tokens)}")
        return "\n".join(lines)

    # ---- the forward pass ------------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | RequestShardedMetadata,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """`after_layer(i)` is called once layer i's K/V of this step are in the pool (a KV
        handoff sends each layer as it is done), on the layer-by-layer path."""
        h = self.embed(input_ids)
        if isinstance(meta, RequestShardedMetadata):  # the requests KV layout: this rank's rows' attention
            rank = self.tp.rank
            first = sum(meta.rows_per_rank[:rank])
            local_positions = positions[first : first + meta.rows_per_rank[rank]]
            exchange = RequestExchange(self.tp, self.request_heads, meta.rows_per_rank)
            steps = {local: RequestStep(meta.per_rank[rank], rope, exchange)
                     for local, rope in self._ropes(local_positions, h.dtype).items()}  # fmt: skip
            residual = None
            for layer in self.layers:
                h, residual = layer(h, residual, None, steps[layer.local])
            return residual.add_(h)
        # tables per KV group: the fused step takes each group's slots and tables, a layer reading its group's
        groups = meta.groups if isinstance(meta, GroupedMetadata) else [meta]
        plan = meta.shared_prefix
        windowed = [rows for m in groups for rows in m.windowed.values()]
        if (not meta.prefills and (plan is None or plan.on_kernels) and all(rows.on_kernels for rows in windowed)
                and 0 < input_ids.shape[0] <= self.fused_decode_rows()):
            # a shared-prefix plan built for the kernels runs inside the fused step, each layer's
            # attention in its parts (kernels/shared_prefix_decode.cpp), each KV group's plan over
            # its own blocks; a layer whose window a row sees past reads each row's last W
            # positions there, from the start positions the step's WindowedRows hold for its
            # window (attention/sliding_window.py, the same call)
            starts = [] if not windowed else [
                None if (rows := groups[layer.kv_group].windowed.get(layer.self_attn.window)) is None
                else rows.start_positions
                for layer in self.layers
            ]  # fmt: skip
            out = self.kernels.ops.decode_layers(
                self.decode_model(), h, positions, [m.slot_mapping for m in groups],
                [m.decode_block_tables for m in groups], groups[0].decode_context_lens,
                [] if plan is None else [None if m.shared_prefix is None else m.shared_prefix.kernel_plan for m in groups],
                starts,
            )
            for moe in self.sparse_layers():  # the experts each sparse layer ran, as its forward() counts them
                moe.count_fused_step()
            return out
        ropes = self._ropes(positions, h.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, ropes[layer.local], meta.for_group(layer.kv_group))
            if after_layer is not None:
                after_layer(i)
        return residual.add_(h)

    def _ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[bool, RopeInputs]:
        """The step's RoPE inputs by layer kind: global (False) and, where the model has them, local (True)."""
        ropes = {False: RopeInputs(self.rotary, positions, dtype)}
        if self.local_rotary is not None:
            ropes[True] = RopeInputs(self.local_rotary, positions, dtype)
        return ropes

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (model dtype) for the selected positions only; the LM head is the largest
        matmul. Vocab-parallel: every rank's share gathered, so each rank holds all of them."""
        logits = self.lm_head(self.norm(hidden))
        if self.tp is not None:
            logits = self.tp.all_gather_last(logits, self.vocab_sizes)
        cap = self.arch.final_logit_softcapping
        if cap is not None:  # Gemma 2: cap · tanh(logits / cap), in fp32 as transformers computes it
            logits = (torch.tanh(logits.float() / cap) * cap).to(logits.dtype)
        return logits

    def greedy_tokens(self, hidden: torch.Tensor, argmax: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`argmax` of compute_logits(hidden), taken inside the LM head where its method can
        (no logits written; bitwise the same result)."""
        # the argmax needs every share (the gathered logits), or the capped logits (a monotone cap,
        # but one that ties values it saturates, as transformers' argmax then sees them)
        if self.tp is not None or self.arch.final_logit_softcapping is not None:
            return argmax(self.compute_logits(hidden))
        normed = self.norm(hidden)
        ids = self.lm_head.argmax(normed)
        return ids if ids is not None else argmax(self.lm_head(normed))

    # ---- the fused decode step (kernels/fused_decode.cpp) ----------------------------------

    def fused_decode_rows(self) -> int:
        """The largest decode batch that runs all layers in one C++ call; 0 if none (also
        under tensor parallelism: the C++ step has no AllReduce between its layers)."""
        return self._fused_rows if self.fused_decode and self.tp is None else 0

    @staticmethod
    def _decode_layer(ops, layer: LlamaDecoderLayer):
        """ops.DecodeLayer: one layer's norms and projections (a sparse layer's experts by
        SparseMoE.decode_moe; OLMoE's whole-projection q/k norms as their weights)."""
        attn = layer.self_attn
        if attn.whole_norm is not None:
            q_norm, k_norm = attn.whole_norm.q_weight.detach(), attn.whole_norm.k_weight.detach()
        else:
            q_norm = None if attn.q_norm is None else attn.q_norm.weight.detach()
            k_norm = None if attn.k_norm is None else attn.k_norm.weight.detach()
        sparse = isinstance(layer.mlp, SparseMoE)
        return ops.DecodeLayer(
            input_norm=layer.input_layernorm.weight.detach(),
            post_attention_norm=layer.post_attention_layernorm.weight.detach(),
            qkv=attn.qkv.fused_projection(),
            o=attn.o.fused_projection(),
            gate_up=None if sparse else layer.mlp.gate_up.fused_projection(),
            down=None if sparse else layer.mlp.down.fused_projection(),
            moe=layer.mlp.decode_moe(ops) if sparse else None,
            q_norm=q_norm, k_norm=k_norm, qk_norm_whole=attn.whole_norm is not None,
            attn_out_norm=None if layer.attn_out_norm is None else layer.attn_out_norm.weight.detach(),
            mlp_out_norm=None if layer.mlp_out_norm is None else layer.mlp_out_norm.weight.detach(),
            gelu=isinstance(layer.mlp, GeluTanhMLP), local=layer.local, kv_group=layer.kv_group,
        )  # fmt: skip

    def decode_model(self):
        """ops.DecodeModel: each layer's norms and its projections as their methods packed them."""
        if self._decode_model is None:
            ops = self.kernels.ops
            layers = [self._decode_layer(ops, layer) for layer in self.layers]
            arch = self.arch
            attns = [layer.self_attn for layer in self.layers]
            int8 = attns[0].k_scale is not None
            self._decode_model = ops.DecodeModel(
                layers=layers,
                k_pools=[a.k_pool for a in attns],
                v_pools=[a.v_pool for a in attns],
                k_scales=[a.k_scale for a in attns] if int8 else [],  # empty: float pools
                v_scales=[a.v_scale for a in attns] if int8 else [],
                cos_half=self.rotary.cos_half, sin_half=self.rotary.sin_half,
                cos_local=None if self.local_rotary is None else self.local_rotary.cos_half,
                sin_local=None if self.local_rotary is None else self.local_rotary.sin_half,
                num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                eps=arch.rms_norm_eps, scale=arch.attention_scale, softcap=arch.attn_logit_softcapping or 0.0,
            )  # fmt: skip
        return self._decode_model
