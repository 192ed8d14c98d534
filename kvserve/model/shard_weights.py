"""Cutting a loaded model's weights down to one tensor-parallel rank's share
(kvserve/distributed/sharding.py decides the share: heads, FFN columns, vocabulary rows)."""

from __future__ import annotations

import torch

from kvserve.arch import ModelArchitecture
from kvserve.distributed.sharding import TensorParallelShard
from kvserve.errors import ConfigError
from kvserve.model.quant_formats import QuantizedWeight, slice_cols, slice_rows


def shard_weights(weights: dict[str, torch.Tensor], arch: ModelArchitecture, shard: TensorParallelShard) -> None:
    """Cut `weights` (HF names; float tensors or QuantizedWeights in their packed formats)
    down to this rank's share, in place: each sliced and copied (contiguous), so the model's
    whole tensors can be freed. A quantized weight is cut in its packed layout, never unpacked,
    between its groups of rows or blocks of columns (kvserve/kernels/layouts.py); a boundary
    inside one is refused."""
    if shard.world == 1:
        return
    H = arch.head_dim
    q0, q1 = shard.q_heads[0] * H, shard.q_heads[1] * H
    k0, k1 = shard.kv_heads[0] * H, shard.kv_heads[1] * H
    v0, v1 = shard.vocab

    def rows(t, lo, hi):
        if isinstance(t, QuantizedWeight):  # whole packed groups of rows, no unpacking
            return _quantized(slice_rows, t, lo, hi, name)
        return t[lo:hi].contiguous()

    def cols(t, lo, hi):
        if isinstance(t, QuantizedWeight):  # whole blocks of input columns
            return _quantized(slice_cols, t, lo, hi, name)
        return t[:, lo:hi].contiguous()

    def ffn_of(name: str) -> tuple[int, int]:  # the width this FFN's columns are cut from
        return shard.expert_ffn if ".mlp.experts." in name else shard.shared_ffn if ".mlp.shared_expert." in name else shard.ffn

    for name in list(weights):
        t = weights[name]
        if arch.qk_norm_whole and name.endswith("q_norm.weight"):  # OLMoE's norm over the whole Q projection
            weights[name] = t[q0:q1].contiguous()
        elif arch.qk_norm_whole and name.endswith("k_norm.weight"):
            weights[name] = t[k0:k1].contiguous()
        elif name.endswith(("q_proj.weight", "q_proj.bias")):
            weights[name] = rows(t, q0, q1)
        elif name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            weights[name] = rows(t, k0, k1)
        elif name.endswith("o_proj.weight"):
            weights[name] = cols(t, q0, q1)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            weights[name] = rows(t, *ffn_of(name))
        elif name.endswith("down_proj.weight"):
            weights[name] = cols(t, *ffn_of(name))
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            weights[name] = rows(t, v0, v1)


def _quantized(cut, w: QuantizedWeight, lo: int, hi: int, name: str) -> QuantizedWeight:
    try:
        return cut(w, lo, hi)
    except ValueError as exc:  # a shard boundary inside a packed group or block
        raise ConfigError("tensor_parallel_size", f"{name} in its quantized format cannot be split there: {exc}; "
                          "load with --quantization none") from None  # fmt: skip
