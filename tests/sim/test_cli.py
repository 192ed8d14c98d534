"""`kvserve sim` and `kvserve plan check-sim`, in process."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from tests.sim.helpers import synthetic_model

SMALL = ["--num-requests", "20", "--input-len", "64", "--output-len", "16", "--kv-cache-memory", "64MiB"]


@pytest.fixture
def step_model(tmp_path) -> str:
    return str(synthetic_model().save(tmp_path / "step_model.json"))


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_sim_prints_the_latency_table(step_model, capsys):
    assert main(["sim", "--step-model", step_model, *SMALL, "--rate", "5"]) == 0
    out = capsys.readouterr().out
    assert "simulated latency, ms (p50 / p90)" in out and "simulated load and cost" in out
    assert "step times: synthetic" in out and "deployment: one instance" in out


def test_sim_json_has_a_run_per_rate(step_model, capsys):
    assert main(["sim", "--step-model", step_model, *SMALL, "--rate", "2", "--rate", "8", "--rate", "inf",
                 "--slo-ttft-ms", "500", "--chip-cost-usd-per-hour", "2", "--json"]) == 0  # fmt: skip
    data = _json(capsys)
    assert [run["rate_req_per_s"] for run in data["runs"]] == [2.0, 8.0, "inf"]
    assert all(run["completed"] == 20 and run["rejected"] == 0 for run in data["runs"])
    assert all("slo_attainment" in run and run["cost_per_million_output_tokens_usd"] > 0 for run in data["runs"])
    assert data["step_model"] == {"source": "fit", "label": "synthetic", "model": "synthetic"}
    assert data["slo_ms"]["ttft_ms"] == 500 and data["slo_ms"]["tpot_ms"] is None
    assert "max_rate" not in data


def test_sim_json_deployment_flags(step_model, capsys):
    assert main(["sim", "--step-model", step_model, *SMALL, "--replicas", "2", "--policy", "least-loaded",
                 "--tensor-parallel-size", "2", "--json"]) == 0  # fmt: skip
    data = _json(capsys)
    assert data["deployment"] == "2 replica(s), least-loaded routing, TP 2 each"
    assert [i["name"] for i in data["runs"][0]["instances"]] == ["replica-0", "replica-1"]
    assert main(["sim", "--step-model", step_model, *SMALL, "--prefill", "1", "--decode", "1", "--json"]) == 0
    run = _json(capsys)["runs"][0]
    assert run["handoff_bytes"] > 0 and run["completed"] == 20


@pytest.mark.parametrize("rates", [["--rate", "4"], ["--rate", "2", "--rate", "16"]])  # a distribution, then a sweep
def test_sim_plot_writes_a_png(step_model, tmp_path, capsys, rates):
    path = tmp_path / "out" / "latency.png"
    assert main(["sim", "--step-model", step_model, *SMALL, *rates, "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {path}" in capsys.readouterr().out


def test_sim_find_max_rate(step_model, capsys):
    args = ["sim", "--step-model", step_model, "--num-requests", "30", "--input-len", "64", "--output-len", "16",
            "--kv-cache-memory", "64MiB", "--rate", "1", "--find-max-rate", "--slo-tpot-ms", "10"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert "highest rate with ≥90% of requests within the SLOs:" in out and "req/s (trials:" in out
    assert main([*args, "--json"]) == 0
    search = _json(capsys)["max_rate"]
    assert search["max_rate_req_per_s"] > 1 and search["target_attainment"] == 0.9
    assert search["at_max"]["slo_attainment"] >= 0.9


@pytest.mark.parametrize(("flags", "message"), [
    (["--input-len", "uniform:9"], "kvserve: error: --input-len: expected N, fixed:N or uniform:LO:HI"),
    (["--output-len", "0"], "kvserve: error: --output-len: "),
    (["--slo-tpot-ms", "0"], "kvserve: error: --slo-tpot-ms: must be > 0 ms"),
    (["--rate", "0"], "kvserve: error: --rate: every rate must be > 0"),
    (["--tensor-parallel-size", "0"], "kvserve: error: --tensor-parallel-size: "),
    (["--num-requests", "0"], "kvserve: error: --num-requests: "),
    (["--chip-cost-usd-per-hour", "-1"], "kvserve: error: --chip-cost-usd-per-hour: "),
    (["--model", "seed-8b"], "kvserve: error: --model: the model comes with the step model"),
    (["--find-max-rate"], "kvserve: error: slo: the rate search needs at least one SLO (--slo-ttft-ms"),
])  # fmt: skip
def test_sim_errors_are_one_line_naming_the_flag(step_model, capsys, flags, message):
    assert main(["sim", "--step-model", step_model, *SMALL, *flags]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith(message), captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_sim_missing_step_model_names_the_calibration(tmp_path, capsys):
    absent = tmp_path / "absent.json"
    assert main(["sim", "--step-model", str(absent), *SMALL]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(absent) in err and "kvserve plan calibrate --engine" in err


def test_sim_chip_needs_a_model(capsys):
    assert main(["sim", "--chip", "h100", *SMALL]) == 1
    assert capsys.readouterr().err == "kvserve: error: --model: --chip needs --model\n"


def test_sim_chip_and_step_model_exclude_each_other(step_model, capsys):
    assert main(["sim", "--chip", "h100", "--model", "seed-8b", "--step-model", step_model, *SMALL]) == 1
    assert capsys.readouterr().err.startswith("kvserve: error: --chip: give --step-model or --chip, not both")


def test_sim_on_a_datasheet_says_it_is_not_measured(capsys):
    assert main(["sim", "--chip", "h100", "--model", "seed-8b", "--num-requests", "20", "--json"]) == 0
    data = _json(capsys)
    assert data["step_model"]["source"] == "datasheet" and data["step_model"]["model"] == "seed-8b"
    assert "not measured" in data["step_model"]["label"]
    assert data["runs"][0]["completed"] == 20 and data["runs"][0]["rate_req_per_s"] == 4.0


def test_plan_check_sim_json(capsys):
    assert main(["plan", "check-sim", "--model", "seed-8b", "--chip", "h100", "--prompt-positions", "256",
                 "--output-tokens", "16", "--batch", "4", "--json"]) == 0  # fmt: skip
    rows = _json(capsys)
    assert [r["quantity"] for r in rows][:2] == ["decode step at B=4", "prefill time per request"]
    assert len(rows) == 6
    for r in rows:
        assert set(r) == {"quantity", "planner", "simulator", "unit", "difference", "note"}
        assert r["planner"] > 0 and r["simulator"] > 0


def test_plan_check_sim_table(capsys):
    assert main(["plan", "check-sim", "--model", "seed-8b", "--chip", "h100", "--prompt-positions", "256",
                 "--output-tokens", "16", "--batch", "4"]) == 0  # fmt: skip
    assert "plan run (closed form) against kvserve sim" in capsys.readouterr().out
