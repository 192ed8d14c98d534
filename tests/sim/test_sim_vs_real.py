"""`kvserve bench sim-vs-real` end to end on the tiny model: it runs, and both sides give figures."""

from __future__ import annotations

import json

from kvserve.cli import main


def test_sim_vs_real_plain_scenario_reports_predicted_and_measured(tiny_llama, tmp_path, capsys):
    out = tmp_path / "sim_vs_real.json"
    # the tiny model's context is 512 positions: short prompts and outputs instead of the scenario's 128 + 128
    assert main(["bench", "sim-vs-real", "--scenario", "plain", "--num-prompts", "6", "--grid", "quick", "--model", tiny_llama,
                 "--threads", "1", "--input-len", "32", "--output-len", "16", "--json", str(out)]) == 0  # fmt: skip
    assert "simulated / measured, ms (relative error)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["benchmark"] == "sim-vs-real"
    assert "through its server" in data["results"]["step_model"]["label"]
    assert "samples" not in data["results"]["step_model"]["meta"]  # they stay in the model file
    rows = data["results"]["results"]
    assert len(rows) == 3 and {r["scenario"] for r in rows} == {"plain"}
    rates = [r["rate_req_per_s"] for r in rows]
    assert rates == sorted(rates) and rates[0] > 0
    for row in rows:
        for side in ("predicted", "measured"):
            assert row[side]["ttft_median"] > 0 and row[side]["tpot_median"] > 0, (side, row)
        assert row["speed_factors"]["prefill"] > 0 and row["speed_factors"]["decode"] > 0
