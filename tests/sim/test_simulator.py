"""The discrete-event simulator on a synthetic step model: timing, scheduling, KV, routing, disaggregation."""

from __future__ import annotations

import collections
import dataclasses

import itertools

import pytest

from kvserve.errors import ConfigError
from kvserve.sim.instance import InstanceSpec
from kvserve.sim.report import summary
from kvserve.sim.simulator import Deployment, Simulator
from kvserve.sim.step_model import TensorParallel
from kvserve.engine.step_shape import StepShape
from kvserve.sim.workload import Lengths, WorkloadSpec, build
from tests.sim.helpers import BLOCK_BYTES, POOL, deployment, request, synthetic_model


def _prefill(m: int, start: int = 0, samples: int = 1) -> StepShape:
    """One prompt chunk of m positions over `start` computed ones, alone in its step."""
    return StepShape(prefill_tokens=m, prefill_rows=1, sample_rows=samples, prefill_pairs=m * start + m * (m + 1) // 2,
                     prefill_kv_positions=start + m)  # fmt: skip


def _decode(context: int) -> StepShape:
    """One request decoding the position after `context - 1` computed ones."""
    return StepShape(decode_rows=1, sample_rows=1, decode_kv_positions=context)


def _workload(n: int = 8, rate: float = 4.0, prompt: str = "32", output: str = "4", **changes) -> list:
    return build(WorkloadSpec(n, rate, Lengths.parse("p", prompt), Lengths.parse("o", output), **changes))


# ---- one request, by hand ------------------------------------------------------------------

def test_lone_request_latencies_are_the_model_steps():
    model = synthetic_model(request_overhead=0.005)
    run = Simulator(deployment(), model, record_steps=True).run([request(0, 40, 5)])
    (trace,) = run.traces
    decodes = [_decode(41 + k) for k in range(4)]
    assert [shape for _, shape, _ in run.steps] == [_prefill(40), *decodes]
    assert trace.ttft_s == 0.005 + model.step_s(_prefill(40))
    assert trace.itl_s == pytest.approx([model.step_s(s) for s in decodes], rel=1e-12)
    assert trace.tpot_s == pytest.approx(sum(model.step_s(s) for s in decodes) / 4, rel=1e-12)
    assert trace.e2e_s == pytest.approx(trace.ttft_s + sum(trace.itl_s), rel=1e-12)
    assert trace.finished_s == trace.token_times[-1] == run.end_s
    assert (trace.output_tokens, trace.preemptions, trace.cached_tokens, trace.rejected) == (5, 0, 0, None)


def test_scheduler_clock_is_the_simulators():
    model = synthetic_model(request_overhead=0.003)
    run = Simulator(deployment(), model, record_steps=True).run([request(0, 24, 6, arrival_s=2.0)])
    (trace,) = run.traces
    (inst,) = run.instances
    ends, now = [], 2.0 + 0.003  # the request reaches the engine the overhead after it is sent
    for _, _, seconds in run.steps:
        now += seconds
        ends.append(now)
    assert trace.token_times == pytest.approx(ends, rel=1e-12)  # each token when its modelled step ends
    assert inst.scheduler.clock() == run.end_s == trace.finished_s  # the scheduler reads modelled time
    assert inst.busy_s == pytest.approx(sum(s for _, _, s in run.steps), rel=1e-12) and inst.steps == 6


def test_a_request_sent_while_the_instance_steps_pays_the_busy_overhead():
    model = synthetic_model(request_overhead=0.003, busy_request_overhead=0.010)
    first, second = request(0, 40, 20), request(1, 40, 2, arrival_s=0.02)
    run = Simulator(deployment(), model, record_steps=True).run([first, second])
    ends = list(itertools.accumulate((s for _, _, s in run.steps), initial=0.003))[1:]  # the first reaches it at 3 ms
    assert ends[0] < 0.02 < ends[-1]  # the second is sent while the first decodes
    # it reaches the scheduler 10 ms after its send and is in the first step that starts after that
    k = next(k for k, end in enumerate(ends) if end >= 0.02 + 0.010) + 1
    assert run.steps[k][1].prefill_rows == 1 and all(not shape.prefill_rows for _, shape, _ in run.steps[1:k])
    second_trace = next(t for t in run.traces if t.request_id == second.request_id)
    assert second_trace.ttft_s == pytest.approx(ends[k] - 0.02, rel=1e-9)
    idle = Simulator(deployment(), model).run([request(1, 40, 2, arrival_s=5.0)]).traces[0]
    assert idle.ttft_s == pytest.approx(0.003 + model.step_s(_prefill(40)), rel=1e-12)  # sent to an idle server


def test_each_request_draws_its_overhead_from_the_measured_ones_and_the_seed_fixes_them():
    model = synthetic_model(request_overhead=0.004, request_overhead_samples=(0.002, 0.004, 0.009))
    lone = [request(i, 40, 2, arrival_s=10.0 * i) for i in range(30)]  # each alone on an idle instance
    run = Simulator(deployment(), model, seed=7).run(lone)
    drawn = [round(t.ttft_s - model.step_s(_prefill(40)), 9) for t in run.traces]
    assert set(drawn) == {0.002, 0.004, 0.009}
    again = Simulator(deployment(), model, seed=7).run(lone)
    assert [t.ttft_s for t in again.traces] == [t.ttft_s for t in run.traces]
    other = Simulator(deployment(), model, seed=8).run(lone)
    assert [t.ttft_s for t in other.traces] != [t.ttft_s for t in run.traces]


def test_tensor_parallel_instance_runs_the_tp_step_and_holds_more_kv():
    model = synthetic_model()
    tp = TensorParallel(2, link_bytes_per_s=1e9, link_latency_s=1e-5)
    run = Simulator(deployment(tensor_parallel=tp), model).run([request(0, 40, 2)])
    assert run.traces[0].ttft_s == pytest.approx(tp.step_s(model, _prefill(40)), rel=1e-12)
    alone = Simulator(deployment(), model).run([request(0, 40, 2)])
    assert run.instances[0].kv.num_blocks == 2 * alone.instances[0].kv.num_blocks  # each rank holds half the heads


# ---- the engine's scheduling, through its own Scheduler -------------------------------------

def test_chunked_prefill_cuts_a_long_prompt_into_threshold_chunks():
    model = synthetic_model()
    d = deployment(instance=dataclasses.replace(POOL, long_prefill_token_threshold=32))
    run = Simulator(d, model, record_steps=True).run([request(0, 100, 3)])
    shapes = [shape for _, shape, _ in run.steps]
    assert shapes[:4] == [_prefill(32, 0, 0), _prefill(32, 32, 0), _prefill(32, 64, 0), _prefill(4, 96, 1)]
    assert shapes[4:] == [_decode(101), _decode(102)]
    assert run.traces[0].ttft_s == pytest.approx(sum(s for _, _, s in run.steps[:4]), rel=1e-12)


def test_token_budget_splits_a_prompt_too():
    d = deployment(instance=dataclasses.replace(POOL, max_num_batched_tokens=64))
    run = Simulator(d, synthetic_model(), record_steps=True).run([request(0, 100, 2)])
    assert [shape.prefill_tokens for _, shape, _ in run.steps] == [64, 36, 0]


def test_shared_prefixes_hit_the_prefix_cache_only_when_it_is_on():
    requests = _workload(8, rate=2.0, prompt="16", shared_prefix_len=64)
    on = summary(Simulator(deployment(), synthetic_model()).run(requests))
    # the first request computes the prefix; each later one finds its 4 full blocks
    assert on["prefix_cache_hit_rate"] == pytest.approx(7 * 64 / (8 * 80))
    off_spec = deployment(instance=dataclasses.replace(POOL, enable_prefix_caching=False))
    off_run = Simulator(off_spec, synthetic_model()).run(requests)
    assert summary(off_run)["prefix_cache_hit_rate"] == 0.0
    assert all(t.cached_tokens == 0 for t in off_run.traces)


def test_a_tiny_kv_pool_preempts_yet_every_request_completes():
    d = deployment(instance=InstanceSpec(kv_cache_memory=8 * BLOCK_BYTES))  # 8 blocks, 128 positions
    requests = [request(i, 40, 30) for i in range(6)]
    run = Simulator(d, synthetic_model()).run(requests)
    assert run.instances[0].kv.num_blocks == 8
    assert sum(t.preemptions for t in run.traces) > 0
    for t in run.traces:
        assert (t.output_tokens, len(t.token_times), t.rejected) == (30, 30, None)
        assert t.finished_s is not None
    for inst in run.instances:
        assert inst.kv.num_free_blocks() == inst.kv.num_blocks
        assert not inst.scheduler.has_unfinished()


def test_a_request_whose_prompt_and_output_exceed_the_context_is_rejected_as_the_server_does():
    # the server's fit_max_tokens refuses prompt + max_tokens > max_model_len, even when the prompt fits
    d = deployment(instance=InstanceSpec(kv_cache_memory=8 * BLOCK_BYTES))
    run = Simulator(d, synthetic_model()).run([request(0, 100, 60), request(1, 100, 28)])
    over, fits = run.traces
    assert over.rejected == "100 prompt + 60 output tokens; the engine holds 128 positions"
    assert over.output_tokens == 0 and over.finished_s is None
    assert fits.rejected is None and fits.output_tokens == 28


def test_a_prompt_longer_than_the_pool_is_rejected_with_a_reason():
    d = deployment(instance=InstanceSpec(kv_cache_memory=8 * BLOCK_BYTES))
    run = Simulator(d, synthetic_model()).run([request(0, 200, 4), request(1, 20, 4)])
    long, short = run.traces
    assert long.rejected == "200 prompt + 4 output tokens; the engine holds 128 positions"
    assert long.finished_s is None and long.first_token_s is None and long.output_tokens == 0
    assert short.rejected is None and short.output_tokens == 4
    out = summary(run)
    assert (out["completed"], out["rejected"]) == (1, 1) and out["rejected_why"] == [long.rejected]


def test_max_model_len_caps_the_context():
    d = deployment(instance=dataclasses.replace(POOL, max_model_len=64))
    run = Simulator(d, synthetic_model()).run([request(0, 64, 4)])
    assert "the engine holds 64 positions" in run.traces[0].rejected


# ---- disaggregation ---------------------------------------------------------------------------

def test_disaggregated_lone_request_waits_for_its_handoff():
    model = synthetic_model()
    nbytes = 64 * model.kv_bytes_per_position
    d = deployment(prefill=1, decode=1, handoff_bytes_per_s=nbytes / 0.5, handoff_latency_s=0.01)
    run = Simulator(d, model, record_steps=True).run([request(0, 64, 5)])
    (trace,) = run.traces
    t_prefill = model.step_s(_prefill(64))
    assert trace.ttft_s == t_prefill  # the prefill instance's token, streamed to the user
    assert trace.instance == "prefill-0 → decode-0"
    arrived = 0.5 + 0.01  # the prefill step started at 0 and its handoff took bytes/bandwidth + latency
    assert trace.token_times[1] >= arrived
    decodes = [_decode(65 + k) for k in range(4)]
    assert trace.token_times[1] == pytest.approx(arrived + model.step_s(decodes[0]), rel=1e-12)
    assert trace.itl_s[1:] == pytest.approx([model.step_s(s) for s in decodes[1:]], rel=1e-12)
    assert (trace.output_tokens, len(trace.token_times)) == (5, 5)
    assert run.handoff_bytes == nbytes
    assert [(name, shape) for name, shape, _ in run.steps] == [("prefill-0", _prefill(64)), *(("decode-0", s) for s in decodes)]


def test_disaggregated_handoff_is_never_faster_than_the_prefill_step():
    model = synthetic_model()
    d = deployment(prefill=1, decode=1, handoff_bytes_per_s=1e15)
    (trace,) = Simulator(d, model).run([request(0, 64, 3)]).traces
    t_prefill = model.step_s(_prefill(64))
    assert trace.token_times[1] == pytest.approx(t_prefill + model.step_s(_decode(65)), rel=1e-12)


def test_disaggregated_workload_completes_and_counts_its_handoff_bytes():
    model = synthetic_model()
    bandwidth = 2e6
    requests = _workload(12, rate=20.0, prompt="uniform:16:64", output="uniform:3:8")
    d = deployment(prefill=2, decode=2, handoff_bytes_per_s=bandwidth)
    run = Simulator(d, model).run(requests)
    assert run.handoff_bytes == sum(len(r.prompt) for r in requests) * model.kv_bytes_per_position
    for r, t in zip(requests, run.traces):
        assert (t.output_tokens, len(t.token_times), t.rejected) == (r.output_len, r.output_len, None)
        assert t.token_times[1] >= r.arrival_s + len(r.prompt) * model.kv_bytes_per_position / bandwidth
        assert t.instance.startswith("prefill-") and " → decode-" in t.instance
    assert {i.name for i in run.instances} == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    assert all(i.kv.num_free_blocks() == i.kv.num_blocks for i in run.instances)


# ---- replicas and routing -------------------------------------------------------------------

def test_round_robin_splits_requests_evenly():
    run = Simulator(deployment(replicas=2), synthetic_model()).run(_workload(8, rate=10.0))
    assert collections.Counter(t.instance for t in run.traces) == {"replica-0": 4, "replica-1": 4}
    assert all(i.steps > 0 for i in run.instances)


def test_prefix_policy_keeps_a_prefix_on_one_replica():
    requests = _workload(24, rate=5.0, prompt="32", shared_prefix_len=256, num_prefixes=4)
    by_policy = {}
    for policy in ("prefix", "round-robin"):
        run = Simulator(deployment(replicas=3, policy=policy), synthetic_model()).run(requests)
        by_policy[policy] = (run, summary(run)["prefix_cache_hit_rate"])
    prefix_run = by_policy["prefix"][0]
    for p in range(4):
        assert len({t.instance for t in prefix_run.traces[p::4]}) == 1
    assert by_policy["prefix"][1] > by_policy["round-robin"][1] > 0


# ---- serving costs and determinism ------------------------------------------------------------

def test_an_arrival_lengthens_the_step_it_lands_in():
    cost = 0.01
    requests = [request(0, 16, 20), request(1, 16, 3, arrival_s=0.0305)]
    quiet = Simulator(deployment(), synthetic_model()).run(requests)
    busy = Simulator(deployment(), synthetic_model(per_arrival=cost)).run(requests)
    assert 0.0305 < quiet.traces[0].finished_s  # the second request came while the first one ran
    diffs = [b - a for a, b in zip(quiet.traces[0].itl_s, busy.traces[0].itl_s)]
    assert sum(1 for d in diffs if d == pytest.approx(cost)) == 1
    assert all(d == pytest.approx(0, abs=1e-12) for d in diffs if d != pytest.approx(cost))
    assert busy.traces[0].e2e_s - quiet.traces[0].e2e_s == pytest.approx(cost)
    assert busy.traces[1].ttft_s - quiet.traces[1].ttft_s == pytest.approx(cost)


def test_the_same_inputs_give_the_same_traces():
    pool = InstanceSpec(kv_cache_memory=24 * BLOCK_BYTES, long_prefill_token_threshold=48)
    d = deployment(replicas=2, policy="prefix", instance=pool)
    requests = _workload(30, rate=40.0, prompt="uniform:8:120", output="uniform:2:40", shared_prefix_len=32, num_prefixes=3)
    sim = Simulator(d, synthetic_model(per_arrival=1e-4))
    first, second = sim.run(requests), sim.run(requests)
    third = Simulator(d, synthetic_model(per_arrival=1e-4)).run(requests)
    assert first.traces == second.traces == third.traces
    assert sum(t.preemptions for t in first.traces) > 0  # the run exercised preemption too
    assert first.end_s == second.end_s


# ---- configuration errors ---------------------------------------------------------------------

@pytest.mark.parametrize(("changes", "field"), [({"policy": "random"}, "policy"), ({"prefill": 1}, "prefill"),
                                                ({"decode": 2}, "prefill"), ({"replicas": 0}, "replicas"),
                                                ({"handoff_bytes_per_s": 0.0}, "handoff_bytes_per_s"),
                                                ({"handoff_latency_s": -1.0}, "handoff_bytes_per_s")])  # fmt: skip
def test_deployment_checks_its_fields(changes, field):
    with pytest.raises(ConfigError) as info:
        Deployment(**changes)
    assert info.value.field == field


@pytest.mark.parametrize("changes", [{"kv_bytes_per_position": 0.0}, {"model_len": 1}])
def test_simulator_needs_kv_bytes_and_a_context(changes):
    with pytest.raises(ConfigError, match="KV bytes per position or context length"):
        Simulator(deployment(), synthetic_model(**changes))


def test_a_pool_without_a_block_is_a_config_error():
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        Simulator(deployment(instance=InstanceSpec(kv_cache_memory=BLOCK_BYTES - 1)), synthetic_model()).run([request(0, 4, 2)])


def test_deployment_counts_chips():
    assert Deployment(replicas=3, tensor_parallel=TensorParallel(2)).num_chips == 6
    assert Deployment(prefill=2, decode=1).num_chips == 3
    assert Deployment().num_instances == 1 and Deployment(prefill=2, decode=3).num_instances == 5
