"""`kvserve bench sim-vs-real` end to end on the tiny model: it runs, and both sides give figures."""

from __future__ import annotations

import json

from kvserve.cli import main


def test_sim_vs_real_plain_scenario_reports_predicted_and_measured(tiny_llama, tmp_path, capsys):
    out = tmp_path / "sim_vs_real.json"
    # the tiny model's context is 512 positions: short prompts and outputs instead of the scenario's 128 + 128
    assert main(["bench", "sim-vs-real", "--scenario", "plain", "--num-prompts", "6", "--grid", "quick", "--model", tiny_llama,
                 "--threads", "1", "--input-len", "32", "--output-len", "16", "--json", str(out)]) == 0  # fmt: skip
    out_text = capsys.readouterr().out
    assert "simulated / measured, ms" in out_text and "the server against itself" in out_text
    data = json.loads(out.read_text())
    assert data["benchmark"] == "sim-vs-real"
    assert "through its server" in data["results"]["step_model"]["label"]
    assert "samples" not in data["results"]["step_model"]["meta"]  # they stay in the model file
    rows = data["results"]["results"]
    assert len(rows) == 6 and {r["scenario"] for r in rows} == {"plain"}  # three rates, each run twice
    assert [r["run"] for r in rows] == ["A", "B"] * 3
    rates = [r["rate_req_per_s"] for r in rows[::2]]
    assert rates == sorted(rates) and rates[0] > 0 and [r["rate_req_per_s"] for r in rows[1::2]] == rates
    for row in rows:
        for side in ("predicted", "measured"):
            assert row[side]["ttft_median"] > 0 and row[side]["tpot_median"] > 0, (side, row)
        assert row["speed_factor"] > 0 and row["probe_ttft_ratio"] > 0
        assert row["measured_preemptions"] == 0 == row["predicted_preemptions"]  # a pool ample for six requests
    summary = data["results"]["summary"]
    assert (summary["simulator_figures"], summary["again_figures"]) == (24, 12)
    assert 0 <= summary["simulator_within"] <= 24 and 0 <= summary["again_within"] <= 12


def test_a_second_run_keeps_lengths_and_shared_prefixes_with_other_ids():
    from kvserve.bench.sim_vs_real import SCENARIOS, _fresh_ids, _workload

    scenario = SCENARIOS["shared-prefix"]
    first = _workload(scenario, 12, 3, 32000)
    again = _fresh_ids(first, scenario, 3, 32000)
    n = scenario.shared_prefix_len
    assert [len(p) for p in again.prompts] == [len(p) for p in first.prompts] and again.output_lens == first.output_lens
    assert not {tuple(p[:n]) for p in again.prompts} & {tuple(p[:n]) for p in first.prompts}  # new prefixes
    for i, j in [(0, 4), (1, 5), (0, 1)]:  # requests that shared a prefix still do, and only they
        assert (first.prompts[i][:n] == first.prompts[j][:n]) == (again.prompts[i][:n] == again.prompts[j][:n])
    assert all(a[n:] != b[n:] for a, b in zip(first.prompts, again.prompts))
