"""`kvserve bench quality` on the tiny model: the reference against itself, bf16 against
fp32, the teacher-forced log-probs against transformers, bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvserve.cli import main

FAST = ["--ppl-window", "64", "--ppl-tokens", "128", "--greedy-tokens", "8", "--kv-cache-memory", "4MiB"]


def _run(tiny_llama, tmp_path, *flags) -> dict:
    out = tmp_path / "quality.json"
    assert main(["bench", "quality", "--model", tiny_llama, *FAST, *flags, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "quality"
    return data["results"]


def test_the_reference_against_itself_agrees_exactly(tiny_llama, tmp_path, capsys):
    r = _run(tiny_llama, tmp_path, "--dtype", "float32", "--quantization", "none")
    assert r["kl"]["mean"] < 1e-9 and r["kl"]["max"] < 1e-9
    assert r["candidate"]["perplexity"] == r["reference"]["perplexity"]
    assert r["candidate"]["teacher_forced_top1_agreement"] == 1.0
    g = r["greedy"]
    assert g["prefix_agreement"] == 1.0 and g["position_match"] == 1.0 and g["identical"] == g["prompts"] == 20
    assert g["positions"] == 20 * 8
    assert r["text"]["positions_evaluated"] == 128 and r["text"]["windows"] == 2
    assert r["reference"]["positions"] == r["candidate"]["positions"] == 128
    captured = capsys.readouterr()
    assert "quality against the reference" in captured.out
    assert "perplexity window 2/2" in captured.err and "greedy, 20 prompts" in captured.err


def test_bf16_against_fp32_has_a_small_positive_kl(tiny_llama, tmp_path):
    from kvserve.bench.quality import quality_table

    r = _run(tiny_llama, tmp_path, "--dtype", "bfloat16", "--quantization", "none", "--greedy-prompts", "6")
    assert 0 < r["kl"]["mean"] < 0.05, r["kl"]
    assert r["kl"]["median"] <= r["kl"]["p99"] <= r["kl"]["max"]
    assert r["candidate"]["dtype"] == "bfloat16" and r["reference"]["dtype"] == "float32"
    ratio = r["candidate"]["perplexity"] / r["reference"]["perplexity"]
    assert 0.9 < ratio < 1.1
    g = r["greedy"]
    assert g["prompts"] == 6 and 0 <= g["prefix_agreement"] <= g["position_match"] <= 1
    assert len(g["per_prompt"]) == 6 and all("prompt" in p for p in g["per_prompt"])
    assert any("| bfloat16" in line for line in quality_table(r))


def test_teacher_forced_logprobs_match_transformers_over_chunks(tiny_llama):
    """Every position's log-probs, computed in chunks of 16 over the paged KV cache (the
    later chunks attend to cached history), equal the reference model's full forward."""
    from kvserve.bench.quality import teacher_forced_logprobs
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import LLMEngine
    from tests.support.tiny_models import load_reference

    engine = LLMEngine(EngineConfig(model=tiny_llama, dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=16))
    tokens = engine.tokenizer.encode("Once upon a time there was a small engine that served many requests at once. " * 2)
    assert len(tokens) > 40
    ours = teacher_forced_logprobs(engine, tokens, "t")
    with torch.no_grad():
        expected = torch.log_softmax(load_reference(Path(tiny_llama))(torch.tensor([tokens])).logits[0].float(), dim=-1)
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)
    assert engine.kv_cache.num_free_blocks() == engine.kv_cache.num_blocks  # its blocks were freed


def test_kl_and_agreement_arithmetic():
    from kvserve.bench.quality import greedy_agreement, kl_per_position, windows

    p = torch.log_softmax(torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]), dim=-1)
    q = torch.log_softmax(torch.tensor([[1.0, 2.0, 3.0], [1.0, 0.0, 0.0]]), dim=-1)
    kl = kl_per_position(p, q)
    assert kl[0] == 0 and kl[1] > 0
    assert torch.isclose(kl[1], (p[1].exp() * (p[1] - q[1])).sum().double())
    g = greedy_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert g["prefix_agreement"] == 6 / 8 and g["position_match"] == 7 / 8 and g["identical"] == 1
    assert g["per_prompt"][0]["first_divergence"] == 2 and g["per_prompt"][1]["first_divergence"] is None
    assert windows(130, 64) == [(0, 64), (64, 128), (128, 130)]


def test_the_shipped_text_and_prompts():
    from kvserve.bench.quality import read_prompts, read_text

    text, source = read_text(None)
    assert source.endswith("quality.txt") and 3000 < len(text.split()) < 8000
    prompts = read_prompts()
    assert len(prompts) == 20 and len(set(prompts)) == 20
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"kvserve.bench" = ["data/*' in pyproject  # shipped in a wheel too


@pytest.mark.parametrize("flags, needle", [
    (["--ppl-window", "0"], "--ppl-window"),
    (["--ppl-tokens", "many"], "--ppl-tokens"),
    (["--greedy-prompts", "21"], "--greedy-prompts"),
    (["--quantization", "int3"], "--quantization"),
    (["--ref-dtype", "int8"], "--ref-dtype"),
])
def test_bad_flags_are_usage_errors(flags, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "quality", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_bad_flag_combination_is_a_usage_error_before_loading(capsys):
    # int8 weights compute with bf16 activations: not with --dtype float32; nothing is loaded
    assert main(["bench", "quality", "--model", "/nonexistent.gguf", "--quantization", "int8", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvserve bench quality: error: quantization") and "Traceback" not in "\n".join(err)


def test_a_window_longer_than_the_model_is_one_line(tiny_llama, capsys):
    assert main(["bench", "quality", "--model", tiny_llama, *FAST, "--ppl-window", "4096"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kvserve: error: --ppl-window") and "max_model_len" in err
