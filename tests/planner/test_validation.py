"""Bad inputs raise ConfigError naming the field and its range, at the edge."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvserve.errors import ConfigError
from kvserve.arch import ModelArchitecture
from kvserve.planner import CHIP_PRESETS, MODEL_PRESETS, PlanInputs, PlannedModel, get_chip, load_model


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("num_chips", 0, "integer >= 1"),
        ("num_chips", True, "integer"),
        ("utilisation", 1.5, "(0, 1]"),
        ("utilisation", float("nan"), "(0, 1]"),
        ("bytes_per_weight", 0, "(0, 8]"),
        ("step_target_s", -0.01, "> 0"),
        ("kv_layout", "rows", "heads, requests"),
        ("reserved_bytes_per_chip", 16e9, "below the chip's HBM"),
        ("shared_prefix_positions", 9000, "<= 8192"),
        ("batch", 0, "integer >= 1"),
        ("replica_chips", 3, "divide num_chips"),
        ("handoff_bytes_per_s", 0.0, "> 0"),
    ],
)
def test_invalid_input_names_field_and_range(seed_inputs, field, value, words):
    with pytest.raises(ConfigError) as info:
        replace(seed_inputs, **{field: value})
    assert info.value.field == field
    assert words in str(info.value)


def test_heads_layout_needs_whole_query_heads_per_chip():
    with pytest.raises(ConfigError, match="must divide 9 Query heads"):
        PlanInputs(MODEL_PRESETS["smollm2-135m"], CHIP_PRESETS["h100"], num_chips=2)
    PlanInputs(MODEL_PRESETS["smollm2-135m"], CHIP_PRESETS["h100"], num_chips=2, kv_layout="requests")


def test_model_shape_rejects_kv_heads_not_dividing_query_heads():
    with pytest.raises(ConfigError, match="num_kv_heads"):
        PlannedModel("x", ModelArchitecture("llama", 100, 64, 128, 2, 6, 4, 16), 1e6)


def test_chip_rejects_non_positive_bandwidth():
    with pytest.raises(ConfigError, match="hbm_bytes_per_s"):
        replace(CHIP_PRESETS["h100"], hbm_bytes_per_s=0)


def test_unknown_presets_list_the_choices(cache_dir):
    with pytest.raises(ConfigError, match="seed-70b"):
        load_model("gpt-9")
    with pytest.raises(ConfigError, match="h100"):
        get_chip("tpu-v9")
    with pytest.raises(ConfigError, match="kvserve plan calibrate"):
        get_chip("local")
