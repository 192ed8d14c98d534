"""tools/make_model.py: random-weight models of real shapes, read back and run.

The tiny shape (2 layers, hidden 256, 4/2 heads, FFN 512, the default model's 49152-token
vocabulary, untied) in every format: tensor names, types and shapes as planned, sampled
tensors dequantizing to std ≈ 0.02; the float and Q8_0/Q4_0 GGUFs and the HF directory
loaded by kvserve and decoded greedily. Files without tokenizer metadata stand in for the
structural checks, since `GGUFReader` takes seconds over a 49k-token vocabulary.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tools import make_model as rm
from tools import quant_blocks as qb

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
QUANT_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]

# files take the default model's GGUF's vocabulary and tokenizer
uses_default_model = pytest.mark.default_model


# ---- the recipe, without files -------------------------------------------------------------


def _types(shape_name: str, fmt: str) -> dict[str, str]:
    shape = rm.SHAPES[shape_name]
    return {n: rm.tensor_type(fmt, n, shape, s[-1]).name for n, s in rm.gguf_tensors(shape)}


def test_q4_k_m_recipe_is_llama_cpps():
    # tied 16 layers: the embeddings are the LM head (Q6_K); attn_v / ffn_down in use_more_bits layers
    types = _types("llama-3.2-1b", "q4_k_m")
    assert types["token_embd.weight"] == "Q6_K" and "output.weight" not in types
    more = [i for i in range(16) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]
    assert more == [i for i in range(16) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"]
    assert {types[f"blk.{i}.{n}.weight"] for i in range(16) for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} == {"Q4_K"}
    assert {v for k, v in types.items() if k.endswith("norm.weight")} == {"F32"}
    # untied 32 layers: token_embd Q4_K, output Q6_K, half the attn_v / ffn_down
    types = _types("llama-3.1-8b", "q4_k_m")
    assert (types["token_embd.weight"], types["output.weight"]) == ("Q4_K", "Q6_K")
    assert [i for i in range(32) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert types["rope_freqs.weight"] == "F32"


def test_rows_that_are_not_super_blocks_fall_back_as_llama_cpp():
    types = _types("smollm2-135m", "q4_k_m")  # hidden 576 = 2.25 super-blocks
    assert types["blk.0.attn_q.weight"] == "Q5_0"  # Q4_K → Q5_0
    assert types["blk.0.ffn_down.weight"] == "Q6_K"  # rows of F = 1536 inputs are whole super-blocks
    assert types["token_embd.weight"] == "Q8_0"  # Q6_K → Q8_0
    assert _types("smollm2-135m", "q5_k")["blk.0.attn_q.weight"] == "Q5_1"


def test_sizes_of_the_benchmark_shapes():
    assert rm.expected_bytes("llama-3.2-1b", "hf-bf16") == 2 * 1_073_809_408
    norms = 65 * 4096 + 64  # F32: two per layer, the final one, the llama3 RoPE factors
    assert rm.expected_bytes("llama-3.1-8b", "q4_0") == (7_382_241_280 - 65 * 4096) * 18 // 32 + norms * 4
    # Q4_K_M lands near llama.cpp's ~4.85 bits per weight
    bits = 8 * rm.expected_bytes("llama-3.1-8b", "q4_k_m") / 7_382_241_280
    assert 4.75 < bits < 4.9


# ---- block layouts ------------------------------------------------------------------------------


def test_packers_match_gguf_dequantize():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 64, (5, 256), dtype=np.uint8)
    blocks = qb.pack_q6_k(np.ones(5), np.ones((5, 16), np.int8), codes)
    assert np.array_equal(gguf.quants.dequantize(blocks.reshape(1, -1), T.Q6_K).reshape(5, 256), codes - 32.0)
    codes = rng.integers(0, 32, (5, 32), dtype=np.uint8)
    blocks = qb.pack_q5_0(np.ones(5), codes)
    assert np.array_equal(gguf.quants.dequantize(blocks.reshape(1, -1), T.Q5_0).reshape(5, 32), codes - 16.0)
    sc, m = rng.integers(0, 64, (2, 7, 8), dtype=np.uint8)
    got_sc, got_m = gguf.quants.Q4_K.get_scale_min(qb.pack_k_scales(sc, m))
    assert np.array_equal(got_sc, sc) and np.array_equal(got_m, m)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_random_blocks_have_std_0_02_zero_mean_and_normal_scales(qtype):
    rows = rm.tensor_data("blk.0.ffn_up.weight", (256, 1024), qtype, rm.SHAPES["tiny"], seed=1)
    w = gguf.quants.dequantize(rows, qtype).astype(np.float64)
    assert w.shape == (256, 1024) and np.isfinite(w).all()
    assert w.std() == pytest.approx(0.02, rel=0.03)
    assert abs(w.mean()) < 0.01 * 0.02
    d = rm._min_scale(rows, qtype)
    assert np.isfinite(d) and d >= 2.0**-14  # a normal fp16


def test_float_tensors_and_seeds():
    shape = rm.SHAPES["tiny"]
    a = rm.tensor_data("blk.0.attn_q.weight", (256, 256), T.F16, shape, seed=0)
    b = rm.tensor_data("blk.0.attn_q.weight", (256, 256), T.F16, shape, seed=0)
    c = rm.tensor_data("blk.0.attn_q.weight", (256, 256), T.F16, shape, seed=1)
    assert a.dtype == np.float16 and np.array_equal(a, b) and not np.array_equal(a, c)
    bf = rm.tensor_data("blk.0.attn_q.weight", (256, 256), T.BF16, shape, seed=0)
    assert np.allclose(gguf.quants.dequantize(bf.view(np.uint8), T.BF16), a.astype(np.float32), rtol=1e-2, atol=1e-4)
    assert np.array_equal(rm.tensor_data("output_norm.weight", (256,), T.F32, shape, 0), np.ones(256, np.float32))
    factors = rm.llama3_rope_factors(rm.SHAPES["llama-3.2-1b"])
    assert factors.shape == (32,) and factors[0] == 1.0 and factors[-1] == 32.0


# ---- files ------------------------------------------------------------------------------------


@uses_default_model
@pytest.mark.parametrize("fmt", rm.GGUF_FORMATS)
def test_every_gguf_format_reads_back_as_planned(tmp_path, fmt):
    made = rm.write_gguf(tmp_path / f"tiny-{fmt}.gguf", "tiny", fmt, seed=0, tokenizer=False)
    assert made.bytes >= rm.expected_bytes("tiny", fmt)
    stats = rm.verify_gguf(made.path, "tiny", fmt)  # names, types, shapes, sampled std ≈ 0.02
    assert stats and all(s.finite for s in stats)
    reader = gguf.GGUFReader(str(made.path))
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.block_count"].contents() == 2
    assert reader.fields["llama.attention.head_count_kv"].contents() == 2
    assert reader.fields["llama.vocab_size"].contents() == 49152
    names = {t.name: t for t in reader.tensors}
    assert int(names["output.weight"].shape[1]) == 49152 and "rope_freqs.weight" not in names


@pytest.fixture(scope="module")
def engine_cache(tmp_path_factory):
    """A throwaway kvserve cache for converted weights (so the tests leave none behind)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KVSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("kvserve-cache")))
    yield
    mp.undo()


def _greedy_tokens(path) -> list[int]:
    from kvserve import LLM, SamplingParams

    llm = LLM(model=str(path), quantization="none", cpu_kernels=False, dtype="float32", kv_cache_memory="32MiB")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    tokens = list(out[0].outputs[0].token_ids)
    assert len(tokens) == 4 and all(0 <= t < 49152 for t in tokens)
    return tokens


@uses_default_model
def test_cli_makes_a_verified_gguf_with_the_default_tokenizer(tmp_path, capsys, engine_cache):
    out = tmp_path / "tiny-q4_0.gguf"
    assert rm.main(["--shape", "tiny", "--format", "q4_0", "--out", str(out), "--seed", "3"]) == 0
    text = capsys.readouterr().out
    assert "wrote" in text and "verified" in text
    # every tokenizer field, the chat template among them, is the default model's
    _, fields, _ = rm._default_gguf_metadata()
    reader = gguf.GGUFReader(str(out))
    assert "tokenizer.chat_template" in {k for k, _, _ in fields}
    for key, value, _ in fields:
        assert reader.fields[key].contents() == value, key
    _greedy_tokens(out)


@uses_default_model
@pytest.mark.parametrize("fmt", ["f16", "bf16", "q8_0"])
def test_kvserve_runs_the_gguf(tmp_path, fmt, engine_cache):
    made = rm.write_gguf(tmp_path / f"tiny-{fmt}.gguf", "tiny", fmt, seed=0)
    _greedy_tokens(made.path)


@uses_default_model
def test_hf_directory_in_shards_loads_and_runs(tmp_path, engine_cache):
    from safetensors import safe_open

    out = tmp_path / "tiny-hf"
    made = rm.write_hf(out, "tiny", seed=0, max_shard_bytes=16 * 2**20)  # small shards: several files
    files = sorted(out.glob("*.safetensors"))
    assert len(files) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {n for n, _ in rm.hf_tensors(rm.SHAPES["tiny"])}
    for f in files:  # a shard is within the limit, or one tensor bigger than it
        assert f.stat().st_size <= 16 * 2**20 + 2**16 or list(index["weight_map"].values()).count(f.name) == 1
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (2, 256, 49152)
    assert config["tie_word_embeddings"] is False
    assert (out / "tokenizer.json").exists() and (out / "generation_config.json").exists()
    with safe_open(str(out / index["weight_map"]["model.layers.0.mlp.up_proj.weight"]), framework="pt") as f:
        w = f.get_tensor("model.layers.0.mlp.up_proj.weight")
    assert str(w.dtype) == "torch.bfloat16" and tuple(w.shape) == (512, 256)
    assert float(w.float().std()) == pytest.approx(0.02, rel=0.05)
    assert made.bytes > rm.expected_bytes("tiny", "hf-bf16")
    _greedy_tokens(out)


@uses_default_model
def test_a_mixture_of_experts_gguf_stacks_its_experts_and_runs(tmp_path, engine_cache):
    """The tiny OLMoE shape in Q4_0: each layer's router in F32 and its experts stacked
    [E, rows, cols] (verify_gguf: every tensor named, typed and shaped as planned); kvserve
    loads every expert in the file's format and decodes."""
    from kvserve import LLM, SamplingParams
    from kvserve.model.moe import SparseMoE

    planned = dict(rm.gguf_tensors(rm.SHAPES["tiny-moe"]))
    assert planned["blk.0.ffn_gate_exps.weight"] == (8, 256, 256) and planned["blk.0.ffn_gate_inp.weight"] == (8, 256)
    assert rm.tensor_type("q4_0", "blk.0.ffn_gate_inp.weight", rm.SHAPES["tiny-moe"], 256) == T.F32
    made = rm.write_gguf(tmp_path / "tiny-moe-q4_0.gguf", "tiny-moe", "q4_0", seed=0)
    rm.verify_gguf(made.path, "tiny-moe", "q4_0")
    llm = LLM(model=str(made.path), kv_cache_memory="32MiB")
    moe = llm.engine.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and len(moe.experts) == 8
    if llm.engine.model.kernels.quant_linear.enabled:  # held in the file's format, not expanded
        assert all(m.gate_up.qweight is not None and m.down.qweight is not None for m in moe.experts)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
