"""A shared prefix read once per step (the seed's §3: 1.25 GiB stored, 3.75 GiB read per
request scan), in the planner's step time, and matched against the engine's own count."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvserve.cli import main
from kvserve.errors import ConfigError
from kvserve.planner import CHIP_PRESETS, MODEL_PRESETS, PlanInputs, from_hf_config, kv, make_plan

GIB = 2**30


def test_seed_example_stored_read_and_read_once():
    c_kv = kv.kv_bytes_per_position(32, 8, 128, 2)
    assert c_kv == 128 * 2**10
    assert kv.shared_prefix_stored_bytes(6, 4096, 1024, c_kv) / GIB == 1.25
    assert kv.shared_prefix_read_bytes(6, 4096, 1024, c_kv) / GIB == 3.75
    assert kv.shared_prefix_read_once_bytes(6, 4096, 1024, c_kv) / GIB == 1.25


def _inputs(**changes):
    base = PlanInputs(MODEL_PRESETS["seed-8b"], CHIP_PRESETS["h100"], history_positions=5120, prompt_positions=5120,
                      shared_prefix_positions=4096, batch=6)
    return dataclasses.replace(base, **changes)


def test_step_time_reads_the_prefix_once_by_default():
    once = make_plan(_inputs())
    scan = make_plan(_inputs(shared_prefix_reads="per-request"))
    none = make_plan(_inputs(shared_prefix_positions=0))
    beta = CHIP_PRESETS["h100"].hbm_bytes_per_s
    assert once["kv_read_bytes_read_once"] == once["shared_prefix_read_once_bytes"] == 1.25 * GIB
    assert once["kv_read_bytes_per_request_scan"] == once["shared_prefix_read_bytes"] == 3.75 * GIB
    assert once["kv_read_s"] == pytest.approx(1.25 * GIB / beta)
    assert scan["kv_read_s"] == pytest.approx(3.75 * GIB / beta) == none["kv_read_s"]
    assert once["step_s"] == once["step_s_read_once"] < once["step_s_per_request_scan"] == scan["step_s"]
    assert "read once" in once.quantity("kv_read_s").note
    assert "kv_read_s_read_once" not in {q for s in none.sections for q in (x.key for x in s.quantities)}


def test_read_once_lets_a_larger_batch_meet_the_target():
    once = make_plan(_inputs(batch=None, step_target_s=0.01))
    scan = make_plan(_inputs(batch=None, step_target_s=0.01, shared_prefix_reads="per-request"))
    # H100, 8B, 5120 positions of which 4096 shared, 10 ms: 95 (capacity binds) against 25
    assert once["max_batch_meeting_target"] == once["capacity_batch"] == 95
    assert scan["max_batch_meeting_target"] == 25


def test_requests_layout_reads_the_prefix_once_per_chip():
    inputs = _inputs(num_chips=2, kv_layout="requests", batch=6)
    plan = make_plan(inputs)
    c_kv = plan["kv_bytes_per_position"]
    assert plan["kv_read_bytes_read_once"] == (4096 + 3 * 1024) * c_kv  # 3 requests on the busiest chip
    assert plan["kv_read_bytes_per_request_scan"] == 3 * 5120 * c_kv


def test_validation_and_cli(capsys):
    with pytest.raises(ConfigError, match="shared_prefix_reads"):
        _inputs(shared_prefix_reads="twice")
    assert main(["plan", "run", "--model", "seed-8b", "--chip", "h100", "--history-positions", "5120",
                 "--shared-prefix-positions", "4096", "--batch", "6"]) == 0
    out = capsys.readouterr().out
    assert "shared prefix read once" in out and "per-request scan" in out
    assert main(["plan", "run", "--model", "seed-8b", "--chip", "h100", "--history-positions", "5120",
                 "--shared-prefix-positions", "4096", "--batch", "6", "--shared-prefix-reads", "per-request",
                 "--json"]) == 0
    import json

    plan = json.loads(capsys.readouterr().out)
    q = plan["quantities"]
    assert plan["inputs"]["shared_prefix_reads"] == "per-request"
    assert q["kv_read_s"]["value"] == q["kv_read_s_per_request_scan"]["value"] > q["kv_read_s_read_once"]["value"]


@pytest.mark.parametrize("prefix_len", [40, 42])  # block-aligned, and not: the rest falls in the suffixes
def test_engine_counted_bytes_match_the_planner_within_page_rounding(tiny_llama, prefix_len):
    from kvserve import LLM, SamplingParams

    bs, batch, suffix = 4, 6, 6
    llm = LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_memory="4MiB", block_size=bs, cpu_kernels=False, shared_prefix_min_positions=bs, shared_prefix_min_group=2)
    engine = llm.engine
    rng = random.Random(prefix_len)
    vocab = engine.arch.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(suffix)] for _ in range(batch)]
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=1))  # the prefix blocks are cached
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in [*engine.scheduler.waiting, *engine.scheduler.running]):
        engine.step()
    counters = engine.counters
    read0, scan0 = counters.attention_kv_bytes_read, counters.attention_kv_bytes_read_without_sharing
    engine.step()  # one decode step of the whole batch
    read, scan = counters.attention_kv_bytes_read - read0, counters.attention_kv_bytes_read_without_sharing - scan0
    history = {r.num_computed_tokens for r in engine.scheduler.running}  # S0 + 1 after the step: what it read
    assert len(history) == 1 and len(engine.scheduler.running) == batch
    S = history.pop()

    shape = from_hf_config(tiny_llama)
    plan = make_plan(PlanInputs(shape, CHIP_PRESETS["h100"], bytes_per_kv_element=4, history_positions=S,
                                prompt_positions=S, shared_prefix_positions=prefix_len, batch=batch, kv_block_positions=bs))
    c_kv = plan["kv_bytes_per_position"]
    assert c_kv == engine.layout.kv_bytes_per_position
    assert scan == plan["kv_read_bytes_per_request_scan"] == plan["shared_prefix_read_bytes"]
    planned = plan["kv_read_bytes_read_once"]
    assert planned == plan["shared_prefix_read_once_bytes"]
    # the engine shares whole blocks only: a partial last prefix block is read by each request
    assert planned <= read <= planned + (batch - 1) * (bs - 1) * c_kv
    if prefix_len % bs == 0:
        assert read == planned
    while engine.has_unfinished_requests():
        engine.step()
