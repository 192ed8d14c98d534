"""The Llama family (Llama, Mistral, Qwen2) over a flat batch of tokens from many requests.

`forward(input_ids[T], positions[T], meta)` runs every layer for all T new positions of
the step, reading and appending the paged KV cache; `compute_logits` projects only the
hidden states of positions that will be sampled.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.paged import paged_attention, write_kv
from kvserve.model.arch import ModelArchitecture
from kvserve.model.layers import RMSNorm, RotaryEmbedding, SiluMLP, apply_rotary
from kvserve.model.linear import AMX_MAX_ROWS, GEMV_MAX_ROWS, Linear

# decode batches of any size run in one decode_layers call on oneDNN's packed weights
FUSED_DECODE_MAX_ROWS = 1 << 30


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
    def __init__(self, arch: ModelArchitecture, w: dict[str, torch.Tensor], prefix: str, ops=None):
        super().__init__()
        self.ops = ops
        # the decode-attention kernel vectorises head_dim in 32s (bf16 pairs), up to 128; RoPE in 16-pairs
        self.attention_ops = ops if arch.head_dim % 32 == 0 and arch.head_dim <= 128 else None
        self.rope_ops = ops if arch.head_dim % 32 == 0 else None
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.head_dim**-0.5
        # Q, K and V in one matmul: one pass over the activations instead of three
        qkv = torch.cat([w[f"{prefix}.{n}_proj.weight"] for n in "qkv"], dim=0)
        bias = torch.cat([w[f"{prefix}.{n}_proj.bias"] for n in "qkv"], dim=0) if arch.attention_bias else None
        self.qkv = Linear(qkv, bias, ops)
        self.o = Linear(w[f"{prefix}.o_proj.weight"], ops=ops)
        self.k_pool: torch.Tensor | None = None
        self.v_pool: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, rope: "RopeInputs", meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv(x)
        if self.rope_ops is not None and qkv.dtype in (torch.float32, torch.bfloat16):
            q = self.rope_ops.rope_and_cache(
                qkv, rope.positions, rope.cos_half, rope.sin_half, self.k_pool, self.v_pool, meta.slot_mapping,
                self.num_heads, self.num_kv_heads, self.head_dim,
            )  # fmt: skip
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            cos, sin = rope.cos_sin()
            q = apply_rotary(q.view(tokens, self.num_heads, self.head_dim), cos, sin)
            k = apply_rotary(k.view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
            v = v.view(tokens, self.num_kv_heads, self.head_dim)
            write_kv(self.k_pool, self.v_pool, meta.slot_mapping, k, v)
        out = paged_attention(q, self.k_pool, self.v_pool, meta, self.scale, self.attention_ops)
        return self.o(out.reshape(tokens, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchitecture, w: dict[str, torch.Tensor], index: int, ops=None):
        super().__init__()
        prefix = f"model.layers.{index}"
        self.input_layernorm = RMSNorm(w[f"{prefix}.input_layernorm.weight"], arch.rms_norm_eps, ops)
        self.self_attn = LlamaAttention(arch, w, f"{prefix}.self_attn", ops)
        self.post_attention_layernorm = RMSNorm(w[f"{prefix}.post_attention_layernorm.weight"], arch.rms_norm_eps, ops)
        self.mlp = SiluMLP(
            w[f"{prefix}.mlp.gate_proj.weight"], w[f"{prefix}.mlp.up_proj.weight"], w[f"{prefix}.mlp.down_proj.weight"], ops
        )

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, rope: "RopeInputs", meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm residual stream: `residual` carries the sum, `h` the latest branch output."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x = self.input_layernorm(h, residual)
        h = self.self_attn(x, rope, meta)
        x = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArchitecture, weights: dict[str, torch.Tensor], max_positions: int, ops=None):
        """`ops`: the optional CPU kernels (kvserve.kernels); None runs the plain-torch path."""
        super().__init__()
        self.arch = arch
        self.ops = ops
        self.embed_tokens = nn.Parameter(weights["model.embed_tokens.weight"], requires_grad=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, weights, i, ops) for i in range(arch.num_layers))
        self.norm = RMSNorm(weights["model.norm.weight"], arch.rms_norm_eps, ops)
        if arch.tie_word_embeddings:
            self.lm_head = Linear(weights["model.embed_tokens.weight"], ops=ops)
            self.lm_head.weight = self.embed_tokens  # one tensor, two uses
        else:
            self.lm_head = Linear(weights["lm_head.weight"], ops=ops)
        self.rotary = RotaryEmbedding(arch, max_positions, weights.get("rope_freqs"))
        self.fused_decode = True  # tests turn it off to compare with the layer-by-layer path
        self._fused_weights: list[torch.Tensor] | None = None
        self._fused_kind = "none"  # which packed copies _fused_weights holds
        self._fused_rows: int | None = None
        self._k_pools: list[torch.Tensor] = []
        self._v_pools: list[torch.Tensor] = []

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    def bind_kv_cache(self, k_pools: list[torch.Tensor], v_pools: list[torch.Tensor]) -> None:
        for layer, k_pool, v_pool in zip(self.layers, k_pools, v_pools):
            layer.self_attn.k_pool = k_pool
            layer.self_attn.v_pool = v_pool
        self._k_pools, self._v_pools = list(k_pools), list(v_pools)

    def fused_decode_rows(self) -> int:
        """The largest decode batch that runs all layers in one C++ call (ops.decode_layers); 0 if none."""
        if not self.fused_decode:
            return 0
        if self._fused_rows is None:  # walking the modules costs ~1 ms: once, after prepack
            self._fused_rows = self._find_fused_decode_rows()
        return self._fused_rows

    def _find_fused_decode_rows(self) -> int:
        arch = self.arch
        if not (
            self.ops is not None
            and self.dtype == torch.bfloat16
            and self.layers[0].self_attn.attention_ops is not None
            and self.layers[0].self_attn.rope_ops is not None
            and arch.hidden_size % 16 == 0
            and arch.intermediate_size % 16 == 0
        ):
            return 0
        kind = self._decode_packed_kind()
        # oneDNN serves any row count; the AMX kernel up to AMX_MAX_ROWS; the GEMV alone up to 8
        return {"amx": AMX_MAX_ROWS, "onednn": FUSED_DECODE_MAX_ROWS}.get(kind, GEMV_MAX_ROWS)

    def _packed_per_layer(self, kind: str) -> list[tuple]:
        """Each layer's packed QKV, O, gate_up and down of one kind (None where missing)."""
        if kind == "amx":
            return [(layer.self_attn.qkv.amx_packed, layer.self_attn.o.amx_packed, layer.mlp.silu_packed,
                     layer.mlp.down.amx_packed) for layer in self.layers]  # fmt: skip
        return [(layer.self_attn.qkv.packed, layer.self_attn.o.packed, layer.mlp.gate_up.packed,
                 layer.mlp.down.packed) for layer in self.layers]  # fmt: skip

    def _decode_packed_kind(self) -> str:
        """The packed copies decode_layers gets: AMX tiles where every projection has them,
        else oneDNN's layout (CPUs without AMX), else none (GEMV batches of <= 8 rows only)."""
        for kind in ("amx", "onednn"):
            if all(p is not None for packed in self._packed_per_layer(kind) for p in packed):
                return kind
        return "none"

    def _decode_weights(self) -> list[torch.Tensor]:
        if self._fused_weights is None:
            self._fused_weights = []
            empty = torch.empty(0, dtype=self.dtype)
            kind = self._fused_kind = self._decode_packed_kind()
            packed_layers = self._packed_per_layer(kind) if kind != "none" else [(None,) * 4] * len(self.layers)
            for layer, packed in zip(self.layers, packed_layers):
                attn, mlp = layer.self_attn, layer.mlp
                # the GEMV's weights: each projection's VNNI copy where it has one, as Linear.forward reads
                qkv, o, gate_up, down = (lin.weight if lin.gemv_packed is None else lin.gemv_packed
                                         for lin in (attn.qkv, attn.o, mlp.gate_up, mlp.down))  # fmt: skip
                self._fused_weights += [
                    layer.input_layernorm.weight, qkv, empty if attn.qkv.bias is None else attn.qkv.bias,
                    o, layer.post_attention_layernorm.weight, gate_up, down,
                    *(empty if p is None else p for p in packed),
                ]  # fmt: skip
        return self._fused_weights

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed_tokens)
        tokens = input_ids.shape[0]
        if not meta.prefills and 0 < tokens <= self.fused_decode_rows():
            arch = self.arch
            weights = self._decode_weights()
            return self.ops.decode_layers(
                h, weights, self._k_pools, self._v_pools, positions,
                self.rotary.cos_half, self.rotary.sin_half, meta.slot_mapping, meta.decode_block_tables,
                meta.decode_context_lens, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.rms_norm_eps,
                arch.head_dim**-0.5, self._fused_kind,
            )  # fmt: skip
        rope = RopeInputs(self.rotary, positions, h.dtype)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, rope, meta)
        return residual.add_(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (model dtype) for the selected positions only; the LM head is the largest matmul."""
        return self.lm_head(self.norm(hidden))

    def greedy_tokens(self, hidden: torch.Tensor, argmax: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`argmax` of compute_logits(hidden), taken inside the LM head where its kernel can
        (no logits written; bitwise the same result)."""
        normed = self.norm(hidden)
        ids = self.lm_head.fused_argmax(normed)
        return ids if ids is not None else argmax(self.lm_head(normed))

    def prepack(self) -> int:
        """Pack every projection for AMX or oneDNN (CPU, bf16); returns how many were packed."""
        self._fused_weights, self._fused_rows = None, None
        packed = sum(m.prepack() for m in self.modules() if isinstance(m, Linear))
        for layer in self.layers:
            layer.mlp.fuse_silu()
        return packed
