"""`kvserve plan …` end to end, in process."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main

SESSION_8B = ["plan", "run", "--model", "seed-8b", "--chip", "h100", "--num-chips", "4",
              "--prompt-positions", "4096", "--step-target-ms", "20", "--reserved-gb-per-chip", "8"]


def test_examples_exit_zero_and_report_all_matching(capsys):
    assert main(["plan", "examples"]) == 0
    assert "51/51 stated values match" in capsys.readouterr().out.replace("\n", " ")


def test_examples_json(capsys):
    assert main(["plan", "examples", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["all_match"] is True
    assert {"section", "quantity", "seed", "computed", "match", "reading"} <= set(data["examples"][0])


def test_run_json_parses_with_documented_keys(capsys):
    assert main([*SESSION_8B, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    q = data["quantities"]
    assert data["inputs"]["num_chips"] == 4
    assert q["kv_bytes_per_position"]["value"] == 131072
    assert q["kv_replication_factor"]["value"] == 1  # 4 chips ≤ 8 KV heads
    assert q["step_s"]["value"] <= 0.020
    assert q["max_batch_meeting_target"]["value"] == q["decode_batch"]["value"] > 0
    for key in ("capacity_batch", "critical_batch", "tokens_per_s", "prefill_s", "ttft_s", "total_s", "allreduce_s",
                "tp_winner", "bottleneck", "handoff_bytes_per_s_needed", "cost_per_token_usd"):
        assert key in q, key
    assert q["step_s"]["formula"] and q["step_s"]["substituted"]


def test_run_table_with_explain(capsys):
    assert main([*SESSION_8B, "--explain"]) == 0
    out = capsys.readouterr().out
    assert "2·L·N_kv·H·p_kv" in out and "2·32·8·128·2" in out


def test_plot_writes_png(tmp_path, capsys):
    path = tmp_path / "plan.png"
    assert main([*SESSION_8B, "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_flag_is_one_line_naming_the_flag(capsys):
    assert main([*SESSION_8B, "--utilisation", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "--utilisation" in err and "(0, 1]" in err


def test_custom_model_needs_every_shape_flag(capsys):
    assert main(["plan", "run", "--model", "custom", "--chip", "h100", "--num-layers", "4"]) == 1
    assert "--d-model" in capsys.readouterr().err


def test_custom_model_runs(capsys):
    argv = ["plan", "run", "--model", "custom", "--chip", "h200", "--num-layers", "4", "--d-model", "256",
            "--ffn-width", "512", "--num-query-heads", "4", "--num-kv-heads", "2", "--vocab-size", "1000", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"]["model"]["head_dim"] == 64
    assert data["quantities"]["cost_per_token_usd"]["value"] is None  # h200 has no price


def test_calibrate_then_plan_on_local_chip(cache_dir, capsys):
    argv = ["plan", "calibrate", "--read-mb", "1", "--matmul-size", "32", "--seconds", "0.01"]
    assert main(argv) == 0
    assert (cache_dir / "local_chip.json").exists()
    assert main(["plan", "run", "--model", "smollm2-135m", "--chip", "local", "--json"]) == 0
    data = json.loads(capsys.readouterr().out.split("\n", 3)[3])  # after calibrate's three lines
    assert data["inputs"]["chip"]["name"] == "local"
    assert data["quantities"]["capacity_batch"]["value"] > 0


def test_presets_lists_models_and_chips(capsys):
    assert main(["plan", "presets"]) == 0
    out = capsys.readouterr().out
    assert "seed-70b" in out and "h200" in out and "local" in out


@pytest.mark.parametrize("argv", [["plan"], ["plan", "run"]])
def test_missing_subcommand_or_required_flags(argv, capsys):
    if argv == ["plan"]:
        assert main(argv) == 2
    else:
        with pytest.raises(SystemExit):
            main(argv)


def test_calibrate_measures_the_tp_link_with_a_real_allreduce(cache_dir, capsys):
    """Two gloo ranks on this host: the α and bandwidth stored for `--chip local` are the
    fit of their AllReduce times, not the memory bandwidth; without it, the old assumption."""
    from kvserve.planner import hardware

    base = ["plan", "calibrate", "--read-mb", "1", "--matmul-size", "32", "--seconds", "0.01"]
    assert main([*base, "--no-collectives"]) == 0
    assumed = hardware.load_local_chip()
    assert "assumed" in capsys.readouterr().out and assumed.link_bytes_per_s == assumed.hbm_bytes_per_s
    assert main(base) == 0
    out = capsys.readouterr().out
    measured = hardware.load_local_chip()
    assert "two-rank gloo AllReduce" in out and "two-rank gloo AllReduce" in measured.note
    assert measured.link_latency_s > 0 and measured.link_bytes_per_s > 0
    assert measured.link_bytes_per_s != measured.hbm_bytes_per_s
