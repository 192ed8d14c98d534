"""Tiny random Llama-family checkpoints (Llama, Qwen2, Qwen3, Phi-3) for tests, written as real HF directories.

A byte-level BPE tokenizer is trained on a few sentences (milliseconds) and given a
ChatML template, so the tiny models exercise the same load path as real ones.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Once upon a time there was a small engine that served many requests at once.",
    "Prefill computes the prompt; decode appends one token at a time to the KV cache.",
    "0123456789 !?.,;:'\"()[]{}<>+-*/=_ hello world stop STOP end",
] * 20
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(
    path: Path,
    *,
    model_type: str = "llama",
    num_kv_heads: int = 2,
    num_heads: int = 4,
    tie_word_embeddings: bool = False,
    hidden_size: int = 64,
    num_layers: int = 2,
    head_dim: int | None = None,
    rope_parameters: dict | None = None,
    partial_rotary_factor: float = 1.0,
    original_max_position_embeddings: int | None = None,
    sliding_window: int = 64,
    sliding_window_pattern: int = 6,
    seed: int = 0,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    mlp_only_layers: tuple[int, ...] = (),
    norm_topk_prob: bool | None = None,
) -> Path:
    """Write a random model + tokenizer to `path` (an HF directory); returns `path`.
    `head_dim`: Qwen3's own (its config names it; hidden_size / num_heads otherwise);
    `rope_parameters`: a Llama's or Phi-3's RoPE scaling, as transformers' config takes it;
    `partial_rotary_factor`, `original_max_position_embeddings`: Phi-3's; `sliding_window`,
    `sliding_window_pattern`: Gemma 3's (the window also Mistral's); `num_experts`,
    `num_experts_per_tok`, `moe_intermediate_size`, `mlp_only_layers`, `norm_topk_prob`: a
    mixture of experts' (mixtral, qwen2_moe, qwen3_moe, olmoe)."""
    from transformers import (
        LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
        Qwen3ForCausalLM,
    )  # fmt: skip

    tokenizer = build_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2 + 32,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    if model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(rope_theta=1_000_000.0, use_sliding_window=False, **common))
        with torch.no_grad():  # random init leaves biases at zero; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif model_type == "qwen3":
        config = Qwen3Config(rope_theta=1_000_000.0, head_dim=head_dim or hidden_size // num_heads, **common)
        model = Qwen3ForCausalLM(config)
        with torch.no_grad():  # the q/k norms start at 1; make them matter
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.normal_(1.0, 0.3)
    elif model_type == "gemma3_text":  # every `sliding_window_pattern`-th layer global; the norms' w made to matter
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(
            head_dim=head_dim or hidden_size // num_heads, sliding_window=sliding_window,
            sliding_window_pattern=sliding_window_pattern,
            query_pre_attn_scalar=head_dim or hidden_size // num_heads, pad_token_id=tokenizer.eos_token_id, **common,
        )  # fmt: skip
        model = Gemma3ForCausalLM(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1 and "norm" in name:
                    p.normal_(0.0, 0.3)
    elif model_type == "gemma2":  # even layers local; soft-caps low enough to bite on these weights
        from transformers import Gemma2Config, Gemma2ForCausalLM

        model = Gemma2ForCausalLM(Gemma2Config(
            head_dim=head_dim or hidden_size // num_heads, sliding_window=sliding_window,
            query_pre_attn_scalar=head_dim or hidden_size // num_heads, attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0, pad_token_id=tokenizer.eos_token_id, **common,
        ))  # fmt: skip
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1 and "norm" in name:
                    p.normal_(0.0, 0.3)
    elif model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        model = _tiny_moe(model_type, common, head_dim, num_experts, num_experts_per_tok, moe_intermediate_size,
                          mlp_only_layers, norm_topk_prob)  # fmt: skip
    elif model_type == "mistral":  # every layer within `sliding_window` (Mistral v0.1)
        from transformers import MistralConfig, MistralForCausalLM

        model = MistralForCausalLM(MistralConfig(rope_theta=10000.0, sliding_window=sliding_window, **common))
    elif model_type == "phi3":  # Q/K/V and gate/up stored fused; partial rotary, LongRoPE where given
        rope = {"rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor, **(rope_parameters or {})}
        model = Phi3ForCausalLM(Phi3Config(
            rope_parameters=rope, partial_rotary_factor=partial_rotary_factor, pad_token_id=tokenizer.eos_token_id,
            original_max_position_embeddings=original_max_position_embeddings or common["max_position_embeddings"],
            **common,
        ))  # fmt: skip
    else:
        rope = {"rope_parameters": {"rope_theta": 10000.0, **rope_parameters}} if rope_parameters else {"rope_theta": 10000.0}
        model = LlamaForCausalLM(LlamaConfig(**rope, **common))
    with torch.no_grad():  # a wider init than the default, so logits are not all near zero
        for p in model.parameters():
            if p.dim() >= 2:  # a mixture of experts holds its experts stacked, 3-D
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _tiny_moe(model_type, common, head_dim, experts, k, width, mlp_only_layers, norm_topk_prob):
    """A random mixture of experts from transformers' own config class; its router's weights
    wide enough that tokens spread over the experts."""
    import transformers

    moe = dict(num_experts_per_tok=k)
    if model_type == "mixtral":
        cls, config = transformers.MixtralForCausalLM, transformers.MixtralConfig(
            num_local_experts=experts, rope_theta=10000.0, sliding_window=None, **moe, **{**common, "intermediate_size": width})
    elif model_type == "olmoe":
        cls, config = transformers.OlmoeForCausalLM, transformers.OlmoeConfig(
            num_experts=experts, norm_topk_prob=bool(norm_topk_prob), pad_token_id=common["eos_token_id"], **moe,
            **{**common, "intermediate_size": width})  # fmt: skip
    else:
        qwen = dict(num_experts=experts, moe_intermediate_size=width, mlp_only_layers=list(mlp_only_layers),
                    norm_topk_prob=bool(norm_topk_prob if norm_topk_prob is not None else model_type == "qwen3_moe"),
                    rope_theta=1_000_000.0, use_sliding_window=False, **moe)  # fmt: skip
        if model_type == "qwen2_moe":
            cls, config = transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
                shared_expert_intermediate_size=64, **qwen, **common)
        else:
            cls, config = transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
                head_dim=head_dim or common["hidden_size"] // common["num_attention_heads"], **qwen, **common)
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:  # q/k norms start at 1; make them matter
                p.normal_(1.0, 0.3)
    return model


def load_reference(path: Path):
    """The same checkpoint in transformers, fp32, eager attention: the independent reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


# the variants every test module can ask for by name (tests/conftest.py builds them once)
TINY_VARIANTS = {
    "llama-gqa": dict(model_type="llama", num_heads=4, num_kv_heads=2),
    "llama-tied": dict(model_type="llama", num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
    "qwen2-bias": dict(model_type="qwen2", num_heads=6, num_kv_heads=2, hidden_size=96),
    # per-head q/k norm; head_dim 32 from the config, not hidden / heads (16), as Qwen3's 128
    "qwen3": dict(model_type="qwen3", num_heads=4, num_kv_heads=2, hidden_size=64, head_dim=32),
    # fused QKV and gate/up weights (Phi-3-mini's layout, full rotary, plain RoPE)
    "phi3": dict(model_type="phi3", num_heads=4, num_kv_heads=2, hidden_size=128),
    # head_dim 64, as the default model: the fused RoPE kernel's path (the others run torch's)
    "llama-hd64": dict(model_type="llama", num_heads=4, num_kv_heads=2, hidden_size=256),
    # tensor parallelism's shapes (tests/distributed): 8 / 2 heads (TP 4 > KV heads) and 12 / 4
    "llama-8x2": dict(model_type="llama", num_heads=8, num_kv_heads=2, hidden_size=128),
    "llama-12x4": dict(model_type="llama", num_heads=12, num_kv_heads=4, hidden_size=192),
    "llama-8x2-hd64": dict(model_type="llama", num_heads=8, num_kv_heads=2, hidden_size=512),  # the CPU kernels' head_dim
}

# mixtures of experts (tests/model/test_moe.py): 8 experts of width 32, the top 2 per token
# (OLMoE and Qwen3-MoE the top 4); Qwen2-MoE with its shared expert and a QKV bias, Qwen3-MoE
# with a dense first layer (`mlp_only_layers`) and per-head q/k norms, OLMoE with its norms over
# the whole projections
MOE_VARIANTS = {
    "mixtral": dict(model_type="mixtral", num_heads=4, num_kv_heads=2),
    "qwen2-moe": dict(model_type="qwen2_moe", num_heads=4, num_kv_heads=2),
    "qwen3-moe": dict(model_type="qwen3_moe", num_heads=4, num_kv_heads=2, head_dim=32, num_experts_per_tok=4,
                      mlp_only_layers=(0,), num_layers=3),
    "olmoe": dict(model_type="olmoe", num_heads=4, num_kv_heads=2, num_experts_per_tok=4),
}

# Phi-4-mini's shape of RoPE: over 3/4 of each head, LongRoPE factors, original context 128
# of 512. Not among the session's variants: served at its full context it takes the long
# factors, where transformers takes the short ones for a short sequence (tests/model/test_architectures.py)
PHI3_LONGROPE = dict(
    model_type="phi3", num_heads=4, num_kv_heads=2, hidden_size=128, partial_rotary_factor=0.75,
    original_max_position_embeddings=128,
    rope_parameters={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(12)],
                     "long_factor": [2.0 + 0.3 * i for i in range(12)]},
)  # fmt: skip
