"""Measuring the real engine for the step model: the step log, in-process and through-server calibration."""

from __future__ import annotations

import json
import statistics

import pytest

from kvserve.cli import main
from kvserve.config import EngineConfig
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.llm import LLM
from kvserve.engine.request import Request
from kvserve.engine.sampler import SamplerOutput
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.step_log import StepLog
from kvserve.errors import ConfigError
from kvserve.sampling_params import SamplingParams
from kvserve.sim.calibrate import calibrate_in_process
from kvserve.sim.measure import Grid
from kvserve.sim.step_log import read_step_log, read_timeline
from kvserve.sim.step_model import load_step_model
from kvserve.engine.step_shape import StepShape

# the tiny Llama: 2 layers, 2 KV heads of 16 dims, float32 K and V
TINY_KV_BYTES = 2 * 2 * 2 * 16 * 4


# ---- the step log -------------------------------------------------------------------------------

def test_generate_writes_a_header_and_a_line_per_step(tiny_llama, tmp_path):
    path = tmp_path / "logs" / "steps.jsonl"
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory="4MiB", step_log=str(path))
    try:
        prompts = [list(range(5, 15)), list(range(20, 25))]
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    finally:
        llm.engine.close()
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["kvserve_step_log"] == 1 and header["model"]
    assert (header["num_layers"], header["d_model"], header["num_kv_heads"]) == (2, 64, 2)
    assert header["kv_bytes_per_position"] == TINY_KV_BYTES and header["model_len"] == 512
    assert header["vocab_size"] >= 300 and header["block_size"] == 16 and header["dtype"] == "float32"
    # the prompts' step, then three decode steps (no empty step), and a line per finished request
    assert len(lines) == 1 + 4 + 2
    read_header, samples = read_step_log(path)
    assert read_header == header
    assert [s.kind for s in samples] == ["prefill", "decode", "decode", "decode"]
    assert samples[0].shape == StepShape(prefill_tokens=15, prefill_rows=2, sample_rows=2, prefill_pairs=55 + 15,
                                         prefill_kv_positions=15)  # fmt: skip
    assert [s.shape.decode_kv_positions for s in samples[1:]] == [17, 19, 21]
    assert all(s.shape.decode_rows == s.shape.sample_rows == 2 for s in samples[1:])
    assert all(s.seconds > 0 and not s.held_out for s in samples)
    spans, requests = read_timeline(path)
    assert len(spans) == 4 and all(a < b <= c for (a, b), (c, _) in zip(spans, spans[1:]))  # monotonic, in order
    assert sorted(r["prompt_tokens"] for r in requests) == [5, 10] and all(r["output_tokens"] == 4 for r in requests)
    for r in requests:  # each timestamp on the steps' clock: in by the first step, first token from it, out at the last
        assert r["arrival"] <= r["first_scheduled"] <= spans[0][0] + 0.05
        assert spans[0][0] <= r["first_token"] <= spans[0][1] and spans[-1][0] <= r["finished"] <= spans[-1][1]


def _log(path, steps: int = 2) -> None:
    log = StepLog(path, {"model": "first"})
    for i in range(steps):
        log.record(StepShape(decode_rows=1 + i, sample_rows=1 + i, decode_kv_positions=10 * (i + 1)), 0.01 * (i + 1))
    log.close()


def test_read_step_log_takes_the_last_header_and_skips_blank_lines(tmp_path):
    path = tmp_path / "steps.jsonl"
    _log(path)
    with open(path, "a") as f:
        f.write("\n")
    log = StepLog(path, {"model": "second", "kv_bytes_per_position": 8})  # a second engine appends
    log.record(StepShape(decode_rows=1, prefill_tokens=9, prefill_rows=1, sample_rows=2, arrivals=3), 0.5)
    log.close()
    header, samples = read_step_log(path)
    assert header["model"] == "second" and header["kv_bytes_per_position"] == 8
    assert [(s.kind, s.seconds) for s in samples] == [("decode", 0.01), ("decode", 0.02), ("mixed", 0.5)]
    assert samples[2].shape.arrivals == 3


@pytest.mark.parametrize("bad", ["not json", '{"seconds": 0.1}', '{"seconds": "x", "decode_rows": 1}', "[1]"])
def test_read_step_log_bad_line_names_file_and_line(tmp_path, bad):
    path = tmp_path / "steps.jsonl"
    _log(path)
    with open(path, "a") as f:
        f.write(bad + "\n")
    with pytest.raises(ConfigError, match=f"{path}:4 is not a step record"):
        read_step_log(path)


def test_read_step_log_of_a_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        read_step_log(tmp_path / "absent.jsonl")


def test_step_log_that_cannot_be_written_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot write"):
        StepLog(tmp_path, {})  # a directory


# ---- calibration --------------------------------------------------------------------------------

def test_calibrate_in_process_writes_a_model_that_loads(tiny_llama, tmp_path):
    config = EngineConfig(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory="4MiB")
    model, errs, path = calibrate_in_process(config, Grid.quick(), output=tmp_path / "model.json")
    loaded = load_step_model(path)
    assert loaded == model and loaded.meta["measured"] == "in process"
    assert loaded.source == "fit" and "in process" in loaded.label
    assert (loaded.kv_bytes_per_position, loaded.model_len, loaded.num_layers, loaded.num_kv_heads) == (TINY_KV_BYTES, 512, 2, 2)
    assert loaded.request_overhead == 0 and loaded.fixed > 0
    samples = loaded.meta["samples"]
    assert {s["kind"] for s in samples} == {"prefill", "decode", "mixed"}
    assert set(loaded.meta["errors"]) == {"prefill", "decode", "mixed", "held_out"} and loaded.meta["errors"] == errs
    assert errs["held_out"]["steps"] == sum(s["held_out"] for s in samples) > 0
    assert sum(e["steps"] for e in errs.values()) == len(samples)


def test_calibrate_through_the_server(tiny_llama, tmp_path, capsys):
    path = tmp_path / "served.json"
    assert main(["plan", "calibrate", "--engine", "--grid", "quick", "--model", tiny_llama, "--dtype", "float32",
                 "--threads", "1", "--kv-cache-memory", "16MiB", "--output", str(path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "fitted step model (seconds)" in out and f"wrote {path}" in out.replace("\n", "")
    model = load_step_model(path)
    assert model.meta["measured"] == "through its server" and "through its server" in model.label
    overheads = model.meta["request_overheads_s"]  # each lone prompt: TTFT at the client less the server's time for it
    assert overheads and all(-0.05 < o < 5 for o in overheads)
    assert model.request_overhead == max(0.0, statistics.median(overheads))
    # the serving phase's requests sent while a step ran: the same
    busy = model.meta["busy_request_overheads_s"]
    assert busy and all(-0.05 < o < 5 for o in busy)
    assert model.busy_request_overhead == max(0.0, statistics.median(busy))
    assert model.busy_request_overhead_samples == tuple(busy) and model.request_overhead_samples == tuple(overheads)
    assert model.meta["engine"]["kv_bytes_per_position"] == TINY_KV_BYTES == model.kv_bytes_per_position
    assert model.meta["engine_flags"][model.meta["engine_flags"].index("--threads") + 1] == "1"
    assert "held_out" in model.meta["errors"] and model.meta["samples"]


# ---- the scheduler's clock ----------------------------------------------------------------------

def test_scheduler_stamps_request_timing_from_its_clock():
    now = [100.0]
    scheduler = Scheduler(EngineConfig(device="cpu"), KVCacheManager(8, 16), clock=lambda: now[0])
    request = Request("a", list(range(1, 21)), SamplingParams(max_tokens=2, ignore_eos=True), arrival_time=99.5)
    scheduler.add_request(request)
    now[0] = 101.0
    plan = scheduler.schedule()
    assert request.timing.first_scheduled == 101.0
    now[0] = 101.25
    scheduler.update_from_output(plan, SamplerOutput([7], [None], [None]))
    assert request.timing.first_token == 101.25 and request.timing.ttft_s == 1.75
    now[0] = 102.0
    plan = scheduler.schedule()
    now[0] = 102.5
    update = scheduler.update_from_output(plan, SamplerOutput([8], [None], [None]))
    assert update.finished == [request]
    assert request.timing.token_times == [101.25, 102.5] and request.timing.finished == 102.5
    assert request.timing.e2e_s == 3.0
