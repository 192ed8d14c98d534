"""`kvserve bench latency` end to end on the tiny model, with small sizes."""

from __future__ import annotations

import json

from kvserve.cli import main

SMALL = ["--prompt-lens", "16,24", "--prefill-iters", "2", "--decode-context-len", "8", "--decode-warmup-steps", "2",
         "--decode-steps", "5", "--read-share-steps", "4", "--read-mib", "8", "--gemm-size", "128", "--calibration-seconds", "0.05",
         "--kv-cache-memory", "4MiB"]


def test_latency_json_and_plot(tiny_llama, tmp_path, capsys):
    out, png = tmp_path / "lat.json", tmp_path / "lat.png"
    assert main(["bench", "latency", "--model", tiny_llama, *SMALL, "--json", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "latency" and data["machine"]["torch_threads"] >= 1
    r = data["results"]
    assert r["decode"]["steps"] == 5 and r["decode"]["tokens"] == 5  # one token per timed step at batch 1
    assert r["decode"]["tok_per_s"] > 0 and 0 < r["decode"]["fraction_of_roofline"]
    share = r["decode"]["read_share"]  # each of 4 steps between two reads of its bytes
    assert share["steps"] == 4 and share["bytes"] == int(r["decode"]["bytes_per_step"])
    assert 0 < share["p25"] <= share["median"] <= share["p75"]
    assert share["read_bytes_per_s_median"] > 0 and share["decode_bytes_per_s_median"] > 0
    assert [p["prompt_len"] for p in r["prefill"]] == [16, 24]
    assert all(p["steps_per_prefill"] == 1 and p["time_ms"]["count"] == 2 for p in r["prefill"])
    assert r["machine"]["read_bytes_per_s"] > 0 and r["machine"]["gemm_flops_per_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "decode" in capsys.readouterr().out


def test_prompt_longer_than_the_model_is_one_line(tiny_llama, capsys):
    assert main(["bench", "latency", "--model", tiny_llama, *SMALL, "--prompt-lens", "4096"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kvserve: error: --prompt-lens") and "max_model_len" in err


def test_bad_prompt_lens_flag(capsys):
    assert main(["bench", "latency", "--prompt-lens", "12,abc"]) == 1
    assert "--prompt-lens" in capsys.readouterr().err


def test_markdown_renders_the_json_with_its_command(tiny_llama, tmp_path, capsys):
    from benchmarks.markdown import render

    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", tiny_llama, *SMALL, "--prompt-lens", "16", "--json", str(out)]) == 0
    text = render(str(out))
    assert "| decode, batch 1 |" in text and "| prefill | 16 |" in text and str(out) in text


def test_read_share_steps_zero_skips_it_and_negative_is_refused(tiny_llama, tmp_path, capsys):
    out = tmp_path / "lat.json"
    args = ["bench", "latency", "--model", tiny_llama, *SMALL, "--prompt-lens", "16", "--json", str(out)]
    assert main([*args, "--read-share-steps", "0"]) == 0
    assert "read_share" not in json.loads(out.read_text())["results"]["decode"]
    capsys.readouterr()
    assert main([*args, "--read-share-steps", "-1"]) == 1
    assert "--read-share-steps" in capsys.readouterr().err


def test_read_share_steps_count_against_max_model_len(tiny_llama, capsys):
    assert main(["bench", "latency", "--model", tiny_llama, *SMALL, "--read-share-steps", "100000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kvserve: error: --read-share-steps") and "max_model_len" in err


def test_formats_table_gives_both_shares_of_the_read_bandwidth(tiny_llama, tmp_path):
    from benchmarks.formats_table import render

    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", tiny_llama, *SMALL, "--prompt-lens", "16", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"]["decode"]
    row = [line for line in render([str(out)]).splitlines() if line.startswith("| ")][2]  # header, rule, the row
    assert f"| {r['read_share']['median']:.2f} ({r['fraction_of_roofline']:.2f}) |" in row
