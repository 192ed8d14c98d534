"""Write a tiny HF checkpoint as a llama.cpp-style GGUF (F32, or its projections and embedding
in a quantized type gguf-py can quantize: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), Q/K rows permuted as
llama.cpp's converter does, with the tokenizer in GGUF metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


# llama.cpp's Phi-3 tensors: Q/K/V in one, and ffn_up holding gate and up
_ARCH_NAMES = {
    "phi3": {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
    "gemma3": {"post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
}  # fmt: skip
_ARCH_NAMES["gemma2"] = _ARCH_NAMES["gemma3"]
GEMMA = ("gemma2", "gemma3")


# the decoder's names of a sparse layer (Mixtral's renamed by the test: families/llama.py) -> llama.cpp's
_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
_SHARED_NAMES = {"shared_expert.gate_proj": "ffn_gate_shexp", "shared_expert.up_proj": "ffn_up_shexp",
                 "shared_expert.down_proj": "ffn_down_shexp"}  # fmt: skip


def _add_experts(add, weights: dict, i: int, experts: int, fused_gate_up: bool = False) -> None:
    """Layer i's router, its experts stacked [E, rows, cols] per projection (`fused_gate_up`:
    gate and up as llama.cpp's one `ffn_gate_up_exps` [E, 2F, d]), and a shared expert with its
    gate (a vector in llama.cpp), where the layer is sparse."""
    mixtral = f"model.layers.{i}.block_sparse_moe.gate.weight" in weights
    mlp = f"model.layers.{i}." + ("block_sparse_moe" if mixtral else "mlp")
    if f"{mlp}.gate.weight" not in weights:
        return  # a dense layer (Qwen's mlp_only_layers)
    add(f"blk.{i}.ffn_gate_inp.weight", weights[f"{mlp}.gate.weight"])

    def stack(proj: str) -> np.ndarray:
        own = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj] if mixtral else proj
        return np.stack([weights[f"{mlp}.experts.{e}.{own}.weight"] for e in range(experts)])

    for proj, gguf_name in _EXPERT_NAMES.items():
        if fused_gate_up and proj != "down_proj":
            continue
        add(f"blk.{i}.{gguf_name}.weight", stack(proj))
    if fused_gate_up:
        add(f"blk.{i}.ffn_gate_up_exps.weight", np.concatenate([stack("gate_proj"), stack("up_proj")], axis=1))
    for hf_name, gguf_name in _SHARED_NAMES.items():
        if f"{mlp}.{hf_name}.weight" in weights:
            add(f"blk.{i}.{gguf_name}.weight", weights[f"{mlp}.{hf_name}.weight"])
    if f"{mlp}.shared_expert_gate.weight" in weights:
        add(f"blk.{i}.ffn_gate_inp_shexp.weight", weights[f"{mlp}.shared_expert_gate.weight"].reshape(-1))


def write_gguf(
    hf_dir: Path, out: Path, architecture: str = "llama", quant_type: str | None = None, metadata: dict | None = None,
    fused_gate_up: bool = False,
) -> Path:
    """`metadata`: extra keys, int -> int32, float -> float32 (e.g. general.sampling.*).
    `fused_gate_up`: experts' gate and up as one `ffn_gate_up_exps` stack."""
    import gguf

    def add(name: str, t: np.ndarray) -> None:
        if architecture in GEMMA and name.endswith("norm.weight"):
            t = t + np.float32(1.0)  # llama.cpp's converter stores Gemma's norms as the 1 + w they apply
        # as llama.cpp's quantize: the router (ffn_gate_inp) stays float; a stack of experts is quantized
        if quant_type and name.endswith(".weight") and t.ndim in (2, 3) and "norm" not in name and "gate_inp" not in name:
            qtype = gguf.GGMLQuantizationType[quant_type]
            w.add_tensor(name, gguf.quants.quantize(t.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(t))

    config = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    w = gguf.GGUFWriter(str(out), architecture)
    a = architecture
    w.add_uint32(f"{a}.block_count", config["num_hidden_layers"])
    w.add_uint32(f"{a}.context_length", config["max_position_embeddings"])
    w.add_uint32(f"{a}.embedding_length", config["hidden_size"])
    w.add_uint32(f"{a}.feed_forward_length", config["intermediate_size"])
    w.add_uint32(f"{a}.attention.head_count", n_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", n_kv)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: one set per layer kind; the global one is the file's
    w.add_float32(f"{a}.rope.freq_base", float(config.get("rope_theta") or rope["rope_theta"]))
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    partial = config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    w.add_uint32(f"{a}.rope.dimension_count", int(head_dim * partial))
    if architecture in GEMMA and config.get("sliding_window"):
        w.add_uint32(f"{a}.attention.sliding_window", config["sliding_window"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if architecture == "gemma2" and config.get(key):
            w.add_float32(f"{a}.{key}", config[key])
    if rope.get("rope_type") == "longrope":  # the factors as tensors, as llama.cpp's converter writes them
        w.add_uint32(f"{a}.rope.scaling.original_context_length", config["original_max_position_embeddings"])
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:  # a mixture of experts' fields, as llama.cpp's converter writes them
        w.add_uint32(f"{a}.expert_count", experts)
        w.add_uint32(f"{a}.expert_used_count", config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            w.add_uint32(f"{a}.expert_feed_forward_length", config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            w.add_uint32(f"{a}.expert_shared_feed_forward_length", config["shared_expert_intermediate_size"])
    if head_dim != config["hidden_size"] // n_heads:  # as llama.cpp's converter: only where it differs
        w.add_uint32(f"{a}.attention.key_length", head_dim)
        w.add_uint32(f"{a}.attention.value_length", head_dim)

    vocab = tok["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = [None] * (max(max(vocab.values()), max(added.values())) + 1)
    for text, idx in {**vocab, **added}.items():
        tokens[idx] = text
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in added else 1 for t in tokens])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_token_merges(merges)
    if architecture in GEMMA:  # transformers builds a Gemma GGUF's tokenizer with an unknown token
        w.add_unk_token_id(tokens.index("<|endoftext|>"))
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_chat_template((hf_dir / "chat_template.jinja").read_text())
    for key, value in (metadata or {}).items():
        (w.add_int32 if isinstance(value, int) else w.add_float32)(key, value)

    if rope.get("rope_type") == "longrope":
        add("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        add("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    add("token_embd.weight", weights["model.embed_tokens.weight"])
    add("output_norm.weight", weights["model.norm.weight"])
    if "lm_head.weight" in weights and not config.get("tie_word_embeddings"):
        add("output.weight", weights["lm_head.weight"])
    for i in range(config["num_hidden_layers"]):
        for hf_name, gguf_name in {**_NAMES, **_ARCH_NAMES.get(architecture, {})}.items():
            if f"model.layers.{i}.{hf_name}" not in weights:  # q/k norms: Qwen3's only
                continue
            t = weights[f"model.layers.{i}.{hf_name}"]
            if hf_name.startswith("self_attn.q_proj") and architecture == "llama":
                t = _llama_cpp_permute(t, n_heads)
            elif hf_name.startswith("self_attn.k_proj") and architecture == "llama":
                t = _llama_cpp_permute(t, n_kv)
            add(f"blk.{i}.{gguf_name}", np.ascontiguousarray(t))
        _add_experts(add, weights, i, experts or 0, fused_gate_up)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
