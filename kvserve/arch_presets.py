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
    "tiny": "two layers of hidden 256, the test shape of tools/make_model.py",
}
