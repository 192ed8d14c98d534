"""RoPE scaling as transformers computes it: each type's inverse frequencies and cos/sin factor
against transformers' own ROPE_INIT_FUNCTIONS on the same config, and a tiny Llama with YaRN
scaling through the engine against transformers' logits; dynamic NTK is served up to the
original context, where it is plain RoPE."""

from __future__ import annotations

import pytest
import torch

from kvserve.arch import ModelArchitecture
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.model.layers import rope_attention_factor, rope_inverse_frequencies
from tests.support.paged_driver import assert_follows_reference
from tests.support.tiny_models import load_reference, make_tiny_model

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "beta_fast": 16.0,
                   "beta_slow": 2.0},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                    "mscale_all_dim": 0.707},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                              "attention_factor": 1.5},
}  # fmt: skip


def _configs(params: dict, head_dim: int = 64):
    from transformers import LlamaConfig

    hf = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=512,
                     rope_parameters={"rope_theta": 10000.0, **params})  # fmt: skip
    return hf, ModelArchitecture.from_hf_config(hf.to_dict())


@pytest.mark.parametrize("name", list(SCALINGS))
def test_frequencies_and_factor_equal_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf, arch = _configs(SCALINGS[name])
    assert arch.rope_scaling.rope_type == SCALINGS[name]["rope_type"]
    inv_freq, factor = ROPE_INIT_FUNCTIONS[arch.rope_scaling.rope_type](hf, "cpu")
    torch.testing.assert_close(rope_inverse_frequencies(arch), inv_freq.float(), rtol=1e-6, atol=0)
    assert rope_attention_factor(arch) == pytest.approx(factor, rel=1e-12)


def test_a_yarn_model_follows_transformers(tmp_path):
    """YaRN changes every frequency past the ramp and scales cos/sin: the fp32 logits of a tiny
    Llama with it equal transformers' (torch path and kernels)."""
    path = make_tiny_model(tmp_path / "yarn", rope_parameters=SCALINGS["yarn"])
    ref = load_reference(path)
    for cpu_kernels in (False, True):
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory="8MiB", cpu_kernels=cpu_kernels))
        assert engine.arch.rope_scaling.rope_type == "yarn"
        prompt = engine.tokenizer.encode("What is the capital of France? The capital")
        assert_follows_reference(engine, ref, prompt, steps=4, atol=1e-4, rtol=1e-4)


def test_dynamic_ntk_is_served_up_to_its_original_context(tmp_path):
    path = make_tiny_model(tmp_path / "dynamic", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                   "original_max_position_embeddings": 128})
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory="8MiB"))
    assert engine.max_model_len == 128
    ref = load_reference(path)
    prompt = engine.tokenizer.encode("What is the capital of France? The capital")
    assert_follows_reference(engine, ref, prompt, steps=4, atol=1e-4, rtol=1e-4)


def test_longrope_takes_its_short_or_long_factors_by_the_context_served():
    """Phi-3's LongRoPE over 3/4 of each head: served within the original context, the short
    factors (transformers' for a sequence that short); served beyond it, the long ones
    (transformers' once a sequence is longer); the same cos/sin factor either way."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tests.support.tiny_models import PHI3_LONGROPE

    kw = PHI3_LONGROPE
    hf = Phi3Config(hidden_size=kw["hidden_size"], num_attention_heads=kw["num_heads"], max_position_embeddings=512,
                    original_max_position_embeddings=kw["original_max_position_embeddings"],
                    partial_rotary_factor=kw["partial_rotary_factor"],
                    rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": kw["partial_rotary_factor"],
                                     **kw["rope_parameters"]})  # fmt: skip
    arch = ModelArchitecture.from_hf_config(hf.to_dict())
    assert arch.rotary_dim == 24 and arch.rope_scaling.rope_type == "longrope"
    for served, seq_len in ((128, 10), (512, 1000)):
        inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=seq_len)
        table = rope_inverse_frequencies(arch, max_positions=served + 1)  # a table of the context + 1 rows
        torch.testing.assert_close(table, inv_freq.float(), rtol=1e-6, atol=0)
        assert rope_attention_factor(arch) == pytest.approx(factor, rel=1e-12)


def test_a_gguf_yarn_header_reads_as_llama_cpp_reads_it(tmp_path):
    """llama.cpp's yarn keys: its cos/sin factor is its own 1 + 0.1·ln(factor) times the file's
    attn_factor; the ramp's betas where written, transformers' defaults otherwise."""
    import math

    from gguf import GGUFWriter

    from kvserve.model.gguf_metadata import open_gguf, read_architecture

    path = tmp_path / "yarn.gguf"
    w = GGUFWriter(str(path), "qwen3")
    for key, value in (("block_count", 2), ("embedding_length", 64), ("feed_forward_length", 128),
                       ("attention.head_count", 4), ("vocab_size", 300), ("context_length", 4096),
                       ("rope.scaling.original_context_length", 1024)):  # fmt: skip
        w.add_uint32(f"qwen3.{key}", value)
    w.add_string("qwen3.rope.scaling.type", "yarn")
    w.add_float32("qwen3.rope.scaling.factor", 4.0)
    w.add_float32("qwen3.rope.scaling.attn_factor", 0.5)
    w.add_float32("qwen3.rope.scaling.yarn_beta_fast", 16.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    arch = read_architecture(open_gguf(path))
    s = arch.rope_scaling
    assert (s.rope_type, s.factor, s.original_max_position_embeddings, s.beta_fast, s.beta_slow) == ("yarn", 4.0, 1024, 16.0, 1.0)
    assert rope_attention_factor(arch) == pytest.approx(0.5 * (1 + 0.1 * math.log(4.0)))
