"""BENCHMARKS.md shows exactly what the committed benchmark JSON files say."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.markdown import render

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "docs/benchmarks").glob("*.json"))


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_every_result_is_rendered_verbatim_in_the_doc(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the doc names the files relative to the repository root
    doc = (ROOT / "BENCHMARKS.md").read_text()
    assert render(str(path.relative_to(ROOT))).strip() in doc
