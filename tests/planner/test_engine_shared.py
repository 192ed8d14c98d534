"""What the planner shares with the engine: the model-shape readers, c_kv, P and the cache directory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvserve.engine.describe import describe
from kvserve.errors import UnsupportedModelError
from kvserve.arch import ModelArchitecture, llama_num_params
from kvserve.model.gguf_metadata import open_gguf, read_architecture
from kvserve.planner import from_gguf, from_hf_config, hardware, kv
from tests.planner.conftest import transformers_param_count
from tests.planner.test_models import _write_tiny_gguf
from tests.support.tiny_gguf import write_gguf

ENGINE_FIELDS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size")


def _same_shape(shape, arch: ModelArchitecture) -> None:
    assert {f: getattr(shape.arch, f) for f in ENGINE_FIELDS} == {f: getattr(arch, f) for f in ENGINE_FIELDS}


def test_planner_reads_hf_config_and_gguf_without_torch(tmp_path):
    config = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(config))
    gguf_path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(gguf_path)
    script = textwrap.dedent(f"""
        import sys
        from kvserve.planner import CHIP_PRESETS, PlanInputs, from_gguf, from_hf_config, make_plan
        for shape in (from_hf_config({str(tmp_path)!r}), from_gguf({str(gguf_path)!r})):
            make_plan(PlanInputs(shape, CHIP_PRESETS["h100"]))
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not loaded, loaded
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-tied", "qwen2-bias", "llama-hd64"])
def test_planner_shape_of_an_hf_dir_is_the_engines(tiny_model_dirs, variant):
    from kvserve.model.hf_loader import read_architecture

    model_dir = Path(tiny_model_dirs[variant])
    arch = read_architecture(model_dir)
    shape = from_hf_config(model_dir)
    _same_shape(shape, arch)
    assert shape.num_params == arch.num_params


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-tied"])
def test_planner_shape_of_a_gguf_is_the_engines(tiny_model_dirs, tmp_path, variant):
    # read_architecture is what the engine's loader (kvserve.model.loader) reads a GGUF with
    path = write_gguf(Path(tiny_model_dirs[variant]), tmp_path / f"{variant}.gguf")
    arch = read_architecture(open_gguf(path))
    shape = from_gguf(path)
    _same_shape(shape, arch)
    # summed over the tensors (exact) and counted from the shape: the same P for a complete GGUF
    assert shape.num_params == arch.num_params


def test_qwen2_parameter_count_includes_the_qkv_bias(tmp_path):
    expected = transformers_param_count(tmp_path, "Qwen2")
    arch = ModelArchitecture.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert arch.attention_bias and arch.num_params == expected
    no_bias = llama_num_params(2, 48, 96, 6, 2, 8, 300, tied_embeddings=False)
    assert expected - no_bias == 2 * (6 + 2 * 2) * 8  # (N_q + 2·N_kv)·H per layer


def test_planner_plans_what_the_engine_refuses(tmp_path):
    """A multimodal config (decoder in `text_config`, a RoPE scaling kvserve lacks) and a falcon GGUF: shapes
    the planner reads with the engine's readers, which the engine itself refuses to run."""
    text = {"model_type": "mistral", "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 500,
            "rope_scaling": {"rope_type": "proportional", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": text}))
    shape = from_hf_config(tmp_path)
    assert (shape.arch.num_layers, shape.arch.num_kv_heads, shape.arch.head_dim) == (4, 2, 8)
    with pytest.raises(UnsupportedModelError, match="rope scaling 'proportional'"):
        ModelArchitecture.from_hf_config(text)

    from gguf import GGUFWriter

    path = tmp_path / "falcon.gguf"
    writer = GGUFWriter(str(path), "falcon")
    writer.add_block_count(2)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_uint32("falcon.vocab_size", 50)
    writer.add_tensor("token_embd.weight", np.zeros((50, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shape = from_gguf(path)
    assert (shape.arch.num_layers, shape.arch.hidden_size, shape.arch.num_kv_heads, shape.arch.vocab_size) == (2, 32, 4, 50)
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'falcon'"):
        read_architecture(open_gguf(path))


def test_one_kv_bytes_formula():
    from kvserve import arch as engine_arch

    assert kv.kv_bytes_per_position is engine_arch.kv_bytes_per_position
    arch = ModelArchitecture.from_hf_config({"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
                                             "intermediate_size": 14336, "num_attention_heads": 32,
                                             "num_key_value_heads": 8, "vocab_size": 128256})
    assert arch.kv_bytes_per_position(2) == kv.kv_bytes_per_position(32, 8, 128, 2) == 131072
    assert arch.kv_bytes_per_position(0.5) == 32768  # 4-bit KV, as the planner allows


def test_both_caches_live_under_xdg_cache_home(tmp_path, monkeypatch):
    from kvserve.model import weight_cache

    monkeypatch.delenv("KVSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "xdg" / "kvserve"
    chip = hardware.save_local_chip(hardware.PRESETS["h100"])
    assert chip == root / "local_chip.json" and chip.exists()
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")
    weight_cache.file_sha256(source)
    assert (root / "hashes.json").exists()
    assert weight_cache.entry_dir("0" * 64).parent == root / "converted"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "override"))  # still wins over XDG
    assert hardware.local_chip_path() == weight_cache.cache_root() / "local_chip.json" == tmp_path / "override" / "local_chip.json"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_planner_kv_bytes_per_position_is_the_engines_report(tiny_model_dirs, capsys, kv_cache_dtype):
    """`kvserve plan run --kv-cache-dtype X` gives the c_kv the engine's start-up report gives
    for the same model and flag (an int8 cache's scales included)."""
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import LLMEngine
    from kvserve.cli import main

    model = tiny_model_dirs["llama-hd64"]
    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory="4MiB", kv_cache_dtype=kv_cache_dtype))
    assert main(["plan", "run", "--model", model, "--chip", "h100", "--kv-cache-dtype", kv_cache_dtype, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["quantities"]["kv_bytes_per_position"]["value"]
    assert planned == engine.layout.kv_bytes_per_position
    assert f"c_kv {engine.layout.kv_bytes_per_position} bytes/position" in describe(engine)
