"""`kvserve plan check-sim`'s engine: the planner's closed forms against the simulator at saturation."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvserve.errors import ConfigError
from kvserve.planner import hardware, models
from kvserve.planner.inputs import PlanInputs
from kvserve.sim.check_plan import check

INPUTS = PlanInputs(models.PRESETS["seed-8b"], hardware.PRESETS["h100"], prompt_positions=512, output_tokens=32, batch=8,
                    prefill_groups=2)  # fmt: skip


@pytest.fixture(scope="module")
def rows():
    return {row.quantity: row for row in check(INPUTS)}


@pytest.mark.parametrize("quantity", ["decode step at B=8", "prefill time per request", "decode stage rate",
                                      "prefill stage rate, one group", "network stage rate"])  # fmt: skip
def test_simulator_agrees_with_the_planner(rows, quantity):
    row = rows[quantity]
    assert row.planner > 0 and math.isfinite(row.simulator)
    assert abs(row.difference) <= 0.02, (row.planner, row.simulator, row.note)


def test_rows_say_how_they_were_run(rows):
    assert list(rows) == ["decode step at B=8", "prefill time per request", "decode stage rate",
                          "prefill stage rate, one group", "network stage rate", "system rate"]  # fmt: skip
    assert rows["decode step at B=8"].unit == "s" and rows["decode stage rate"].unit == "req/s"
    assert "2 prefill group(s)" in rows["system rate"].note and rows["system rate"].simulator > 0


@pytest.mark.parametrize(("changes", "field"), [({"kv_layout": "requests"}, "kv_layout"),
                                                ({"shared_prefix_positions": 64}, "shared_prefix_positions"),
                                                ({"output_tokens": 1}, "output_tokens")])  # fmt: skip
def test_inputs_the_check_cannot_simulate(changes, field):
    with pytest.raises(ConfigError) as info:
        check(dataclasses.replace(INPUTS, **changes))
    assert info.value.field == field
