"""OLMoE: Llama's layer with routed experts (64 of width 1024, the top 8, not renormalised unless
`norm_topk_prob`), and q and k each RMSNormed over the whole projection before the heads are
split (`qk_norm_whole`: weights N_q·H and N_kv·H, not one H shared by the heads as Qwen3's).
`clip_qkv` (clamping Q, K and V) is refused: no released OLMoE sets it."""

from __future__ import annotations

from typing import Any

from kvserve.errors import UnsupportedModelError
from kvserve.families.base import Family, GGUFMeta
from kvserve.families.experts import gguf_moe_options, hf_moe_options


def hf_options(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    if config.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"unsupported OLMoE clip_qkv={config['clip_qkv']} (kvserve runs clip_qkv null)")
    return dict(qk_norm=True, qk_norm_whole=True, **hf_moe_options(config, "intermediate_size"))


def gguf_options(meta: GGUFMeta, model_type: str) -> dict[str, Any]:
    return dict(qk_norm_whole=True, **gguf_moe_options(meta, norm_topk_prob=False))


FAMILY = Family("olmoe", ("olmoe",), {"olmoe": "olmoe"}, hf_options, gguf_options)
