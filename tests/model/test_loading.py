"""Model sources: HF safetensors directories, GGUF files (cached after conversion), clear errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.model.loader import load_model
from tests.support.paged_driver import PagedDriver
from tests.support.tiny_gguf import write_gguf
from tests.support.tiny_models import load_reference


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(d))
    return d


@pytest.fixture()
def tiny_gguf(tiny_llama, tmp_path):
    return write_gguf(__import__("pathlib").Path(tiny_llama), tmp_path / "tiny.gguf")


def test_safetensors_dir_loads(tiny_llama):
    loaded = load_model(tiny_llama, torch.float32)
    assert loaded.arch.architecture == "llama"
    assert loaded.weights["model.embed_tokens.weight"].dtype == torch.float32
    assert loaded.tokenizer.chat_template


def test_gguf_matches_the_checkpoint_it_came_from(tiny_llama, tiny_gguf, cache_dir):
    """Dequantized, un-permuted GGUF weights give the original model's logits."""
    engine = LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32", device="cpu", kv_cache_memory="4MiB"))
    ref = load_reference(tiny_llama)
    prompt = engine.tokenizer.encode("The quick brown fox jumps")
    assert prompt == ref_tokens(tiny_llama, "The quick brown fox jumps")
    driver = PagedDriver(engine)
    ours = driver.prefill(driver.new_request(prompt))
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)


def ref_tokens(model_dir, text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).encode(text)


def test_gguf_second_load_comes_from_cache(tiny_gguf, cache_dir):
    first = load_model(str(tiny_gguf), torch.float32)
    assert not first.from_cache
    assert list(cache_dir.glob("converted/*/weights-float32.safetensors"))
    second = load_model(str(tiny_gguf), torch.float32)
    assert second.from_cache
    assert second.arch == first.arch
    # bf16 is a separate entry, converted from the source
    assert not load_model(str(tiny_gguf), torch.bfloat16).from_cache


def test_missing_model_file():
    with pytest.raises(ModelLoadError, match="model not found: /no/such/model.gguf"):
        load_model("/no/such/model.gguf")


def test_missing_config_and_weights(tmp_path, tiny_llama):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="missing config.json"):
        load_model(str(empty))
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_llama, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors"):
        load_model(str(no_weights))


def test_unsupported_hf_architecture(tmp_path, tiny_llama):
    bad = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama, bad)
    config = json.loads((bad / "config.json").read_text())
    config["model_type"] = "gpt2"
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'gpt2'"):
        load_model(str(bad))


def test_unsupported_gguf_architecture(tiny_llama, tmp_path, cache_dir):
    path = write_gguf(__import__("pathlib").Path(tiny_llama), tmp_path / "falcon.gguf", architecture="falcon")
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'falcon'"):
        load_model(str(path))


def test_cli_reports_a_missing_model_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", "--model", "/no/such/dir", "hello"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "model not found: /no/such/dir" in proc.stderr
    assert "Traceback" not in proc.stderr
