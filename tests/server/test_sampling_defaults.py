"""Server sampling defaults: the model's own generation config, llama.cpp's defaults, flags."""

from __future__ import annotations

import json
import shutil

import pytest

from kvserve.errors import ConfigError
from kvserve.model.generation_config import read_generation_config
from kvserve.server.sampling_defaults import LLAMA_CPP_DEFAULTS, resolve_sampling_defaults
from tests.server.conftest import ServerProcess


def test_hf_generation_config_is_read(tmp_path, tiny_llama):
    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 64, "eos_token_id": 2}))
    assert read_generation_config(model) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    # do_sample false: transformers would decode greedily, so the default is greedy
    (model / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6, "top_k": 20}))
    assert read_generation_config(model) == {"temperature": 0.0}
    (model / "generation_config.json").write_text("{not json")
    assert read_generation_config(model) == {}  # logged and ignored, the model still serves


def test_gguf_sampling_metadata_is_read(tmp_path, tiny_llama):
    from pathlib import Path

    from tests.support.tiny_gguf import write_gguf

    assert read_generation_config(write_gguf(Path(tiny_llama), tmp_path / "plain.gguf")) == {}
    tagged = write_gguf(Path(tiny_llama), tmp_path / "tagged.gguf", metadata={"general.sampling.temp": 0.3, "general.sampling.top_k": 7})
    assert read_generation_config(tagged) == {"temperature": pytest.approx(0.3), "top_k": 7}


def test_resolution_order():
    d = resolve_sampling_defaults("auto", {"temperature": 0.6}, {"top_k": 5, "min_p": None})
    assert d.values["temperature"] == 0.6 and d.sources["temperature"] == "model"
    assert d.values["top_k"] == 5 and d.sources["top_k"] == "flag"
    assert d.values["min_p"] == LLAMA_CPP_DEFAULTS["min_p"] and d.sources["min_p"] == "llama.cpp"
    plain = resolve_sampling_defaults("none", {"temperature": 0.6}, {})
    assert plain.values["temperature"] == 1.0 and plain.values["top_k"] == 0 and plain.sources["temperature"] == "openai"
    with pytest.raises(ConfigError, match="top_p"):
        resolve_sampling_defaults("auto", {}, {"top_p": 0.0})
    with pytest.raises(ConfigError, match="generation_config"):
        resolve_sampling_defaults("model", {}, {})


def test_server_reports_and_applies_its_defaults(tiny_llama, tmp_path):
    import openai

    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    proc = ServerProcess(str(model), tmp_path / "serve.log", "--top-k", "3", "--max-tokens", "5")
    try:
        assert "temperature 0 (model)" in proc.log() and "top_k 3 (flag)" in proc.log()
        client = openai.OpenAI(base_url=proc.base_url, api_key="none", max_retries=0, timeout=60)
        card = client.models.list().data[0].model_dump()
        assert card["sampling_defaults"]["temperature"] == 0.0 and card["sampling_defaults"]["top_k"] == 3
        # unset temperature = the model's 0: greedy, so two answers agree; max_tokens from the flag
        kw = dict(model=proc.model_name, prompt="hello", extra_body={"ignore_eos": True})
        a, b = client.completions.create(**kw), client.completions.create(**kw)
        assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 5
        greedy = client.completions.create(**kw, temperature=0, max_tokens=5)
        assert greedy.choices[0].text == a.choices[0].text
        chat = client.chat.completions.create(model=proc.model_name, messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 5
    finally:
        proc.terminate()


def test_bad_default_flag_fails_before_loading(tiny_llama, tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", tiny_llama, "--top-p", "2"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0 and "top_p" in out.stderr and "Traceback" not in out.stderr
