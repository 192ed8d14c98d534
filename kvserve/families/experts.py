"""What every mixture-of-experts family shares: reading its expert fields from an HF config or
GGUF metadata, and llama.cpp's names of the expert tensors.

The decoder (model/moe.py) reads one naming whatever the checkpoint's: a sparse layer's router
`mlp.gate.weight` [E, d], its experts `mlp.experts.{e}.{gate,up,down}_proj.weight`, and where
there is one the shared expert `mlp.shared_expert.{gate,up,down}_proj.weight` with its gate
`mlp.shared_expert_gate.weight` [1, d]. A GGUF stacks each layer's experts in one tensor
(`ffn_gate_exps` [E, F, d], ...); the loader cuts it into those names (gguf_loader.py). So does
an HF checkpoint saved with transformers 5's own stacked layout (`mlp.experts.gate_up_proj`
[E, 2F, d], `mlp.experts.down_proj` [E, d, F]): `unstack_experts`, as each tensor is read."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.families.base import GGUFMeta

if TYPE_CHECKING:  # the planner reads families without torch (tests/planner: no torch import)
    import torch

_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def unstack_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """transformers 5's stacked experts (its modules' own parameters, in a checkpoint saved from
    its state dict): `…mlp.experts.gate_up_proj` [E, 2F, d], each expert's gate rows then its up
    rows, and `…mlp.experts.down_proj` [E, d, F], cut into each expert's weights in the
    decoder's names (views, no copy); None for any other tensor. Cut before quantization at
    load, which goes by the name and quantizes 2-D weights only."""
    match = _STACKED.match(name)
    if match is None:
        return None
    base, kind = match.groups()
    if tensor.dim() != 3 or (kind == "gate_up_proj" and tensor.shape[1] % 2):
        want = "[experts, 2 × width, hidden]" if kind == "gate_up_proj" else "[experts, hidden, width]"
        raise ModelLoadError(f"{name}: stacked experts must be {want}, got shape {list(tensor.shape)}")
    if kind == "down_proj":
        return [(f"{base}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    width = tensor.shape[1] // 2
    return [(f"{base}.{e}.{part}_proj.weight", tensor[e, lo : lo + width])
            for e in range(tensor.shape[0]) for part, lo in (("gate", 0), ("up", width))]  # fmt: skip

# llama.cpp's per-layer expert tensors -> the decoder's names; `{e}` marks a stack of experts
GGUF_EXPERT_TENSORS = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
    # llama.cpp's fused form of the two above (gate rows, then up rows, per expert): cut in two at load
    "ffn_gate_up_exps.weight": "mlp.experts.{e}.gate_up_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}


def hf_moe_options(config: dict[str, Any], expert_width_key: str, dense_layers: tuple[int, ...] = ()) -> dict[str, Any]:
    """The expert fields of an HF config, {} for a dense one. `expert_width_key`: the config's
    name for an expert's width (Mixtral's and OLMoE's `intermediate_size`, Qwen's
    `moe_intermediate_size`)."""
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if not experts:
        return {}
    k = int(config.get("num_experts_per_tok") or 0)
    if not 0 < k <= experts:
        raise UnsupportedModelError(f"num_experts_per_tok={k} must be between 1 and num_experts={experts}")
    return dict(
        num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=int(config[expert_width_key]),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
        dense_layers=dense_layers,
    )  # fmt: skip


def qwen_dense_layers(config: dict[str, Any]) -> tuple[int, ...]:
    """Qwen2-MoE's and Qwen3-MoE's dense layers: those in `mlp_only_layers`, and those off the
    `decoder_sparse_step` (layer i is sparse where (i + 1) % step == 0), as transformers builds them."""
    step = int(config.get("decoder_sparse_step") or 1)
    only = set(config.get("mlp_only_layers") or ())
    return tuple(i for i in range(config["num_hidden_layers"]) if i in only or (i + 1) % step)


def gguf_moe_options(meta: GGUFMeta, *, norm_topk_prob: bool) -> dict[str, Any]:
    """The expert fields of a GGUF (`{arch}.expert_count`, ...), {} for a dense one. llama.cpp
    writes whether the top k are renormalised only for some architectures
    (`expert_weights_norm`); `norm_topk_prob` is the architecture's rule otherwise."""
    experts = int(meta.get("expert_count", 0) or 0)
    if not experts:
        return {}
    k = int(meta.get("expert_used_count", 0) or 0)
    if not 0 < k <= experts:
        raise UnsupportedModelError(f"{meta.prefix}.expert_used_count={k} must be between 1 and expert_count={experts}")
    width = meta.get("expert_feed_forward_length") or meta.get("feed_forward_length")
    norm = meta.get("expert_weights_norm")
    return dict(
        num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=int(width),
        norm_topk_prob=norm_topk_prob if norm is None else bool(norm),
        shared_expert_intermediate_size=int(meta.get("expert_shared_feed_forward_length", 0) or 0),
    )  # fmt: skip
