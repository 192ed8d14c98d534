"""Named model shapes: the one set the planner (`kvserve plan --model NAME`), the simulator
(`kvserve sim --chip … --model NAME`) and tools/make_model.py (random-weight files) share.

Shapes only, no weights. The planner ignores what only running a model needs (RoPE, norm
epsilon, context); tools/make_model.py writes them into its files as the real models have them.
"""

from __future__ import annotations

from kvserve.arch import ModelArchitecture, RopeScaling
from kvserve.families.gemma import gemma_layer_types


def _llama(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int, vocab: int, tied: bool,
           rope_theta: float, context: int, rope_scaling: RopeScaling = RopeScaling()) -> ModelArchitecture:  # fmt: skip
    return ModelArchitecture("llama", vocab, hidden, ffn, layers, heads, kv_heads, head_dim, 1e-5, rope_theta, context,
                             tied, rope_scaling=rope_scaling)  # fmt: skip


def _llama3_rope(factor: float) -> RopeScaling:
    return RopeScaling("llama3", factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def _qwen3(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int, tied: bool, context: int) -> ModelArchitecture:
    return ModelArchitecture("qwen3", vocab, hidden, ffn, layers, heads, kv_heads, 128, 1e-6, 1_000_000.0, context, tied,
                             qk_norm=True)  # fmt: skip


def _gemma3(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int, vocab: int, context: int,
            window: int) -> ModelArchitecture:  # fmt: skip
    return ModelArchitecture(
        "gemma3_text", vocab, hidden, ffn, layers, heads, kv_heads, head_dim, 1e-6, 1_000_000.0, context, True,
        qk_norm=True, norm_weight_offset=1.0, embedding_scale=hidden**0.5, sandwich_norms=True, hidden_act="gelu_tanh",
        query_pre_attn_scalar=float(head_dim), layer_types=gemma_layer_types(layers), rope_local_theta=10000.0, sliding_window=window,
    )  # fmt: skip


def _gemma2(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int, context: int,
            window: int) -> ModelArchitecture:  # fmt: skip
    return ModelArchitecture(
        "gemma2", 256000, hidden, ffn, layers, heads, kv_heads, head_dim, 1e-6, 10000.0, context, True,
        norm_weight_offset=1.0, embedding_scale=hidden**0.5, sandwich_norms=True, hidden_act="gelu_tanh",
        query_pre_attn_scalar=float(head_dim), layer_types=gemma_layer_types(layers, 2), sliding_window=window,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    )  # fmt: skip


def _moe(model_type: str, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, experts: int, k: int, width: int,
         norm_topk: bool, rope_theta: float, context: int, **extra) -> ModelArchitecture:  # fmt: skip
    """A mixture of experts: every layer sparse, `experts` of `width`, the top `k` per token."""
    return ModelArchitecture(
        model_type, vocab, hidden, width, layers, heads, kv_heads, 128, 1e-6, rope_theta, context, False,
        num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=width, norm_topk_prob=norm_topk, **extra,
    )  # fmt: skip


_LLAMA_3_8B = _llama(32, 4096, 14336, 32, 8, 128, 128256, False, 500000.0, 131072, _llama3_rope(8.0))

PRESETS: dict[str, ModelArchitecture] = {
    "seed-70b": _llama(80, 8192, 28672, 64, 8, 128, 128256, False, 500000.0, 8192),
    "seed-8b": _LLAMA_3_8B,
    "smollm2-135m": _llama(30, 576, 1536, 9, 3, 64, 49152, True, 100000.0, 8192),
    "llama-3.2-1b": _llama(16, 2048, 8192, 32, 8, 64, 128256, True, 500000.0, 131072, _llama3_rope(32.0)),
    "llama-3.1-8b": _LLAMA_3_8B,
    "qwen3-1.7b": _qwen3(28, 2048, 6144, 16, 8, 151936, True, 40960),
    "gemma-3-1b": _gemma3(26, 1152, 6912, 4, 1, 256, 262144, 32768, 512),
    "gemma-2-2b": _gemma2(26, 2304, 9216, 8, 4, 256, 8192, 4096),
    "qwen3-30b-a3b": _moe("qwen3_moe", 48, 2048, 32, 4, 151936, 128, 8, 768, True, 1_000_000.0, 40960, qk_norm=True),
    "olmoe-1b-7b": _moe("olmoe", 16, 2048, 16, 16, 50304, 64, 8, 1024, False, 10000.0, 4096, qk_norm=True, qk_norm_whole=True),
    "mixtral-8x7b": _moe("mixtral", 32, 4096, 32, 8, 32000, 8, 2, 14336, True, 1_000_000.0, 32768),
    # OLMoE's layer at the tiny shape's size: 8 experts of 256, the top 2 (the MoE test shape of tools/make_model.py)
    "tiny-moe": _moe("olmoe", 2, 256, 2, 2, 49152, 8, 2, 256, False, 10000.0, 8192, qk_norm=True, qk_norm_whole=True),
    # every tensor kind (an untied LM head too), every row a whole number of 256-weight super-blocks
    "tiny": _llama(2, 256, 512, 4, 2, 64, 49152, False, 10000.0, 8192),
}

NOTES: dict[str, str] = {
    "seed-70b": "the seed's 70B approximation (LLaMA 3-70B shape); P = 70e9 as the seed counts it",
    "seed-8b": "§3 states only L=32, N_kv=8, H=128; the other fields are LLaMA 3-8B's",
    "smollm2-135m": "SmolLM2-135M (tied embeddings), the engine's default model",
    "llama-3.2-1b": "Llama-3.2-1B (tied embeddings)",
    "llama-3.1-8b": "Llama-3.1-8B",
    "qwen3-1.7b": "Qwen3-1.7B (tied embeddings; head_dim 128, per-head q/k RMSNorm)",
    "gemma-3-1b": "Gemma-3-1B text (tied embeddings; head_dim 256; 5 of every 6 layers local, window 512)",
    "gemma-2-2b": "Gemma-2-2B (tied embeddings; head_dim 256; every other layer local, window 4096; soft-capped scores and logits)",
    "qwen3-30b-a3b": "Qwen3-30B-A3B (48 layers, 128 experts of width 768, the top 8 renormalised; ~3.3B active)",
    "olmoe-1b-7b": "OLMoE-1B-7B (16 layers, 64 experts of width 1024, the top 8; ~1.3B active)",
    "mixtral-8x7b": "Mixtral-8x7B (32 layers, 8 experts of width 14336, the top 2; ~12.9B active)",
    "tiny-moe": "two OLMoE layers of hidden 256, 8 experts of width 256, the top 2: the MoE test shape of tools/make_model.py",
    "tiny": "two layers of hidden 256, the test shape of tools/make_model.py",
}
