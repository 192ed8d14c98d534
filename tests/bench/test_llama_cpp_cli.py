"""`--compare-llama-cpp DIR` on `kvserve bench latency` and `throughput`: skipped with one
line when DIR or the GGUF is missing; a real side-by-side run where llama.cpp is built."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvserve.cli import main
from tests.support.tiny_gguf import write_gguf

LLAMA_CPP_DIR = Path(os.environ.get("KVSERVE_LLAMA_CPP_DIR", "/work/llama.cpp/bin"))
needs_llama_cpp = pytest.mark.skipif(not (LLAMA_CPP_DIR / "llama-bench").is_file()
                                     or not (LLAMA_CPP_DIR / "llama-batched-bench").is_file(),
                                     reason=f"llama.cpp is not built in {LLAMA_CPP_DIR}")

LATENCY = ["--prompt-lens", "16,24", "--prefill-iters", "2", "--decode-context-len", "8", "--decode-warmup-steps", "2",
           "--decode-steps", "5", "--read-mib", "8", "--gemm-size", "128", "--calibration-seconds", "0.05",
           "--kv-cache-memory", "4MiB"]
THROUGHPUT = ["--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--kv-cache-memory", "4MiB"]


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, tmp_path_factory) -> str:
    return str(write_gguf(Path(tiny_llama), tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


def _skip_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "llama.cpp comparison skipped" in line]


def test_latency_with_a_missing_dir_says_skipped_and_carries_on(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", tiny_gguf, *LATENCY, "--compare-llama-cpp", str(tmp_path / "nope"),
                 "--json", str(out)]) == 0
    captured = capsys.readouterr()
    (line,) = _skip_lines(captured.out + captured.err)
    assert "is not a directory" in line
    r = json.loads(out.read_text())["results"]
    assert "is not a directory" in r["llama_cpp"]["skipped"] and r["decode"]["tokens"] == 5


def test_throughput_with_a_dir_lacking_the_binary_says_skipped(tiny_gguf, tmp_path, capsys):
    empty = tmp_path / "bin"
    empty.mkdir()
    out = tmp_path / "thr.json"
    assert main(["bench", "throughput", "--model", tiny_gguf, *THROUGHPUT, "--compare-llama-cpp", str(empty),
                 "--json", str(out)]) == 0
    captured = capsys.readouterr()
    (line,) = _skip_lines(captured.out + captured.err)
    assert "no executable llama-batched-bench" in line
    r = json.loads(out.read_text())["results"]
    assert [e["engine"] for e in r["engines"]] == ["kvserve"] and "skipped" in r["llama_cpp"]


def test_a_model_that_is_not_a_gguf_is_skipped(tiny_llama, tmp_path, capsys):
    (tmp_path / "llama-bench").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "llama-bench").chmod(0o755)
    assert main(["bench", "latency", "--model", tiny_llama, *LATENCY, "--compare-llama-cpp", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    (line,) = _skip_lines(captured.out + captured.err)
    assert "not a .gguf" in line


def test_llama_bench_flags_follow_the_latency_settings(tmp_path):
    from kvserve.bench.latency import LatencySettings
    from kvserve.bench.llama_cpp import LlamaCpp, batched_bench_args, llama_bench_args

    lc = LlamaCpp(tmp_path, tmp_path / "m.gguf", threads=3)
    decode, prefill = llama_bench_args(lc, LatencySettings(prompt_lens=(128, 512), prefill_iters=4, decode_context_len=100,
                                                           decode_warmup_steps=8, decode_steps=32), depth=True)
    assert decode[decode.index("-n") + 1] == "32" and decode[decode.index("-d") + 1] == "108"
    assert decode[decode.index("-p") + 1] == "0" and decode[decode.index("-t") + 1] == "3"
    assert prefill[prefill.index("-p") + 1] == "128,512" and prefill[prefill.index("-r") + 1] == "4"
    args = batched_bench_args(lc, 64, 128, 128)
    assert args[args.index("-npl") + 1].split(",")[0] == "64" and args[args.index("-c") + 1] == str(64 * 256)


@needs_llama_cpp
def test_latency_beside_llama_bench(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", tiny_gguf, *LATENCY, "--compare-llama-cpp", str(LLAMA_CPP_DIR),
                 "--json", str(out)]) == 0
    c = json.loads(out.read_text())["results"]["llama_cpp"]
    assert "error" not in c, c
    assert [row["phase"] for row in c["rows"]] == ["decode", "prefill", "prefill"]
    assert len(c["rounds"]) == 2  # kvserve, llama.cpp, kvserve, llama.cpp
    for row in c["rows"]:
        assert row["llama_cpp_tok_per_s"] > 0 and row["ratio"] == row["kvserve_tok_per_s"] / row["llama_cpp_tok_per_s"]
        assert len(row["kvserve_rounds"]) == len(row["llama_cpp_rounds"]) == 2
    assert "latency against llama.cpp" in capsys.readouterr().out


@needs_llama_cpp
def test_throughput_beside_llama_batched_bench(tiny_gguf, tmp_path):
    out = tmp_path / "thr.json"
    assert main(["bench", "throughput", "--model", tiny_gguf, *THROUGHPUT, "--compare-llama-cpp", str(LLAMA_CPP_DIR),
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"]
    ours, peer = r["engines"]
    assert peer["engine"].startswith("llama.cpp") and "error" not in peer, peer
    assert peer["generated_tokens"] == 16 and peer["total_tok_per_s"] > 0
    assert r["ratios"][peer["engine"]] == ours["output_tok_per_s"] / peer["output_tok_per_s"]
