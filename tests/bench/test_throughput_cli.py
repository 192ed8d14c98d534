"""`kvserve bench throughput` on the tiny model, alone and against transformers."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main

TINY = ["--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--kv-cache-memory", "4MiB"]


def test_kvserve_alone_counts_exact_tokens(tiny_llama, tmp_path):
    out = tmp_path / "thr.json"
    assert main(["bench", "throughput", "--model", tiny_llama, *TINY, "--range-ratio", "0.5", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"]
    (ours,) = r["engines"]
    assert ours["engine"] == "kvserve" and "warning" not in ours
    assert ours["generated_tokens"] == r["workload"]["output_tokens"]  # ignore_eos: every length exact
    # the rate is tokens / elapsed: multiplied back it is the count up to one rounding
    assert ours["output_tok_per_s"] * ours["elapsed_s"] == pytest.approx(r["workload"]["output_tokens"], rel=1e-12)
    assert ours["peak_rss_mib"] > 0


def test_compare_hf_runs_both_transformers_modes(tiny_llama, tmp_path, capsys):
    out, png = tmp_path / "thr.json", tmp_path / "thr.png"
    assert main(["bench", "throughput", "--model", tiny_llama, *TINY, "--compare", "hf",
                 "--json", str(out), "--plot", str(png)]) == 0
    r = json.loads(out.read_text())["results"]
    names = [e["engine"] for e in r["engines"]]
    assert names == ["kvserve", "transformers generate", "transformers generate_batch"]
    for peer in r["engines"][1:]:
        assert "error" not in peer, peer
        assert peer["generated_tokens"] == 16 and peer["peak_rss_mib"] > 0
    assert set(r["ratios"]) == {"transformers generate", "transformers generate_batch"}
    assert png.read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "kvserve ×" in out and "transformers generate_batch" in out


def test_rounds_take_turns_and_keep_each_engines_fastest(tiny_llama, tmp_path, capsys):
    from benchmarks.markdown import throughput_table

    out = tmp_path / "thr.json"
    assert main(["bench", "throughput", "--model", tiny_llama, *TINY, "--compare", "hf", "--hf-modes", "generate",
                 "--rounds", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"]
    ours, peer = r["engines"]
    assert ours["prefix_cache_hit_rate"] == 0  # round 2 did not find round 1's prompts cached
    for e in (ours, peer):
        assert len(e["elapsed_s_rounds"]) == 2 and e["elapsed_s"] == min(e["elapsed_s_rounds"])
    assert [set(x) for x in r["round_ratios"]] == [{"transformers generate"}] * 2
    assert len(r["round_read_gb_s"]) == 2 and all(x > 0 for x in r["round_read_gb_s"])
    assert r["ratios"]["transformers generate"] == ours["output_tok_per_s"] / peer["output_tok_per_s"]
    assert "round by round" in capsys.readouterr().out
    assert any("round by round" in line for line in throughput_table(r))


def test_rounds_must_be_positive(capsys):
    assert main(["bench", "throughput", "--rounds", "0"]) == 1
    assert "--rounds" in capsys.readouterr().err


def test_unknown_hf_mode_is_one_line(capsys):
    assert main(["bench", "throughput", "--compare", "hf", "--hf-modes", "generate,beam"]) == 1
    assert "--hf-modes" in capsys.readouterr().err


def test_peer_process_reports_its_own_peak_rss():
    """ru_maxrss carries a parent's peak into a child across fork and exec; the peers' figure must not."""
    import subprocess
    import sys

    from kvserve.bench.hf_peer import peak_rss_mib

    ballast = bytearray(400 * 2**20)  # touched pages: this process's peak rises by 400 MiB
    code = "from kvserve.bench.hf_peer import peak_rss_mib; print(peak_rss_mib())"
    child_mib = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert peak_rss_mib() >= 400 and child_mib < peak_rss_mib() - 300
    del ballast


def test_shared_prefix_reports_prefix_cache_hits(tiny_llama, tmp_path, capsys):
    out = tmp_path / "thr.json"
    args = ["bench", "throughput", "--model", tiny_llama, *TINY, "--num-prompts", "8", "--shared-prefix-len", "64",
            "--max-num-batched-tokens", "80", "--json", str(out)]
    assert main(args) == 0
    (ours,) = json.loads(out.read_text())["results"]["engines"]
    # the first request of each step computes the prefix; the others find its blocks
    assert ours["prefix_cache_hit_rate"] > 0.3
    assert "prefix-cache hit rate" in capsys.readouterr().out
