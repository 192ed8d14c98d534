"""What the simulator serves: length specs, JSONL traces and built workloads."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from kvserve.errors import ConfigError
from kvserve.sim.workload import Lengths, WorkloadSpec, build, from_lists, read_trace


@pytest.mark.parametrize(("text", "kind", "low", "high"), [
    ("128", "fixed", 128, 128), ("fixed:64", "fixed", 64, 64), ("uniform:8:16", "uniform", 8, 16),
    ("uniform:5:5", "uniform", 5, 5),
])  # fmt: skip
def test_lengths_parse_accepted_forms(text, kind, low, high):
    lengths = Lengths.parse("--input-len", text)
    assert (lengths.kind, lengths.low, lengths.high) == (kind, low, high)
    assert lengths.mean == (low + high) / 2


@pytest.mark.parametrize("text", ["abc", "", "0", "-3", "fixed:0", "fixed", "fixed:1:2", "uniform:5", "uniform:9:3",
                                  "uniform:0:4", "uniform:a:b", "gamma:1:2", "1.5"])  # fmt: skip
def test_lengths_parse_errors_name_the_field(text):
    with pytest.raises(ConfigError) as info:
        Lengths.parse("--output-len", text)
    assert info.value.field == "--output-len"
    assert str(info.value).startswith("--output-len: ")


def test_lengths_draw():
    rng = np.random.default_rng(0)
    assert Lengths.parse("x", "7").draw(3, rng) == [7, 7, 7]
    drawn = Lengths.parse("x", "uniform:3:5").draw(500, rng)
    assert set(drawn) == {3, 4, 5}
    trace = Lengths("trace", values=(4, 9))
    assert trace.draw(5, rng) == [4, 9, 4, 9, 4] and trace.mean == 6.5


def _write(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_read_trace_takes_every_key_name_and_skips_blank_lines(tmp_path):
    rows = [{"prompt_len": 10, "output_len": 1}, {"input_len": 11, "completion_tokens": 2},
            {"prompt_tokens": 12, "output_tokens": 3}, {"num_prompt_tokens": 13, "num_output_tokens": 4},
            {"input_length": 14, "output_length": 5, "other": "ignored"}]  # fmt: skip
    lines = [json.dumps(r) for r in rows]
    path = _write(tmp_path / "t.jsonl", [lines[0], "", "   ", *lines[1:], ""])
    prompts, outputs = read_trace(path)
    assert prompts.kind == outputs.kind == "trace"
    assert prompts.values == (10, 11, 12, 13, 14) and outputs.values == (1, 2, 3, 4, 5)


@pytest.mark.parametrize("bad", ["not json", '{"prompt_len": 5}', '{"output_len": 5}',
                                 '{"prompt_len": "x", "output_len": 3}', "[1, 2]", "7",
                                 '{"prompt_len": 0, "output_len": 3}', '{"prompt_len": 4, "output_len": -1}'])  # fmt: skip
def test_read_trace_bad_line_names_file_and_line(tmp_path, bad):
    path = _write(tmp_path / "t.jsonl", ['{"prompt_len": 3, "output_len": 4}', "", bad])
    with pytest.raises(ConfigError, match=f"{path}:3"):
        read_trace(path)


def test_read_trace_missing_or_empty_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        read_trace(tmp_path / "absent.jsonl")
    with pytest.raises(ConfigError, match="holds no request"):
        read_trace(_write(tmp_path / "empty.jsonl", ["", ""]))


def _spec(**changes) -> WorkloadSpec:
    base = WorkloadSpec(num_requests=20, rate_req_per_s=4.0, prompt_lens=Lengths.parse("p", "uniform:5:40"),
                        output_lens=Lengths.parse("o", "uniform:1:9"), seed=3)  # fmt: skip
    return dataclasses.replace(base, **changes)


def test_build_makes_the_requests_asked_for():
    spec = _spec(vocab_size=50)
    requests = build(spec)
    assert len(requests) == 20 and len({r.request_id for r in requests}) == 20
    assert all(5 <= len(r.prompt) <= 40 and 1 <= r.output_len <= 9 for r in requests)
    assert all(1 <= t < 50 for r in requests for t in r.prompt)


def test_build_arrivals_rise_at_the_rate():
    arrivals = [r.arrival_s for r in build(_spec(num_requests=400, rate_req_per_s=10.0))]
    assert all(b >= a for a, b in zip(arrivals, arrivals[1:])) and arrivals[0] > 0
    assert 400 / arrivals[-1] == pytest.approx(10.0, rel=0.15)


def test_build_at_an_infinite_rate_sends_everything_at_once():
    assert [r.arrival_s for r in build(_spec(rate_req_per_s=math.inf))] == [0.0] * 20


def test_build_shared_prefixes():
    requests = build(_spec(shared_prefix_len=24, num_prefixes=3, prompt_lens=Lengths.parse("p", "8")))
    prefixes = [r.prompt[:24] for r in requests]
    assert all(len(r.prompt) == 32 for r in requests)
    for i in range(20):
        assert prefixes[i] == prefixes[i % 3]  # round robin over the prefixes
    assert len({tuple(p) for p in prefixes}) == 3
    assert len({tuple(r.prompt[24:]) for r in requests}) == 20  # each request's own tokens are its own


def test_build_is_a_function_of_the_seed():
    spec = _spec(shared_prefix_len=16, num_prefixes=2)
    assert build(spec) == build(spec)
    other = build(dataclasses.replace(spec, seed=4))
    assert [r.prompt for r in other] != [r.prompt for r in build(spec)]
    assert [r.arrival_s for r in other] != [r.arrival_s for r in build(spec)]


@pytest.mark.parametrize(("changes", "field"), [({"num_requests": 0}, "num_requests"), ({"rate_req_per_s": 0.0}, "rate"),
                                                ({"burstiness": 0.0}, "burstiness"), ({"num_prefixes": 0}, "shared_prefix_len"),
                                                ({"shared_prefix_len": -1}, "shared_prefix_len")])  # fmt: skip
def test_workload_spec_checks_its_fields(changes, field):
    with pytest.raises(ConfigError) as info:
        _spec(**changes)
    assert info.value.field == field


def test_from_lists_keeps_the_given_requests():
    requests = from_lists([[1, 2, 3], [4]], [5, 6], [0.0, 0.25])
    assert [(r.request_id, r.prompt, r.output_len, r.arrival_s) for r in requests] == [("sim-0", [1, 2, 3], 5, 0.0),
                                                                                       ("sim-1", [4], 6, 0.25)]  # fmt: skip
