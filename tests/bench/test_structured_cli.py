"""`kvserve bench structured` on the default model: compile times, mask cost per step, bad flags."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main

pytestmark = pytest.mark.default_model


def test_prints_compile_and_mask_cost(tmp_path, capsys):
    out = tmp_path / "structured.json"
    flags = ["--steps", "4", "--batch-sizes", "1,4", "--kv-cache-memory", "64MiB", "--json", str(out)]
    assert main(["bench", "structured", *flags]) == 0
    printed = capsys.readouterr().out
    assert "compile ms" in printed and "tool call" in printed and "of a step" in printed
    data = json.loads(out.read_text())
    assert set(data["masks"]) == {"1", "4"}
    for row in data["masks"].values():
        assert row["mask_us"] > 0 and row["decode_step_ms"] > 0 and 0 < row["fraction_of_step"]
    assert all(r["compile_ms"] > 0 for r in data["compile"]["schemas"].values())


def test_bad_flags_are_named(capsys):
    assert main(["bench", "structured", "--steps", "0"]) == 1
    assert "--steps" in capsys.readouterr().err
