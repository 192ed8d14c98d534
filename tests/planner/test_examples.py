"""Every worked example of the seed reproduces to the digits the seed states."""

from __future__ import annotations

import pytest

from kvserve.planner.examples import all_examples

EXAMPLES = all_examples()


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{e.section} {e.quantity}" for e in EXAMPLES])
def test_worked_example_matches_seed(example):
    assert example.match is not False, f"seed {example.seed!r}, computed {example.computed_text!r}"


def test_examples_cover_every_section_with_stated_values():
    sections = {e.section for e in EXAMPLES if e.match is not None}
    assert sections == {"§2", "§3", "§4", "§5", "§6", "§7"}
    assert sum(e.match is True for e in EXAMPLES) >= 45


def test_a_wrong_value_is_reported_as_mismatch():
    from dataclasses import replace

    row = next(e for e in EXAMPLES if e.quantity == "capacity-limited batch, S=8192")
    assert replace(row, computed=58).match is False
    assert replace(row, computed=57).match is True
