"""`kvserve plan check-sim`: the planner's closed forms against the simulator, in the steady state.

The planner says what a deployment does at saturation in closed form: the decode step at
batch B, and the rates of the three disaggregated stages (prefill G_p/t_prefill, decode
B/(t_step·(N_out − 1)), network bandwidth/handoff bytes) whose minimum is the system's.
The simulator runs the engine's own scheduler through queues. Both use the same inputs and
the same roofline (step_model.from_datasheet), so at saturation they must agree; a
difference beyond rounding means one of them is wrong, and this command shows where.

The simulated runs send every request at once (saturation) and measure completions per second
between the 20% and 80% marks, past the fill and before the drain:
- `decode stage`: prefill and link made ample, so decoding binds;
- `prefill stage`: one prefill group, decoding and link ample;
- `network stage`: the link as given, the rest ample;
- `system`: the deployment as given (G_p prefill groups, one decode group, the link).
The decode step is the mean of the decode-bound run's steps that ran B rows, beside the
planner's step at their mean history (the planner takes one history S for every request,
while in a running batch the histories spread over prompt..prompt + N_out).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from kvserve.planner.inputs import PlanInputs
from kvserve.planner.plan import make_plan
from kvserve.sim.instance import InstanceSpec
from kvserve.sim.simulator import Deployment, Simulator
from kvserve.sim.step_model import TensorParallel, from_datasheet
from kvserve.sim.workload import SimRequest

AMPLE = 1e30  # B/s: a link that never binds


@dataclasses.dataclass(frozen=True)
class Row:
    quantity: str
    planner: float
    simulator: float
    unit: str
    note: str = ""

    @property
    def difference(self) -> float:
        return self.simulator / self.planner - 1 if self.planner else math.nan


def _requests(n: int, prompt: int, output: int) -> list[SimRequest]:
    # distinct prompts (no prefix-cache hit), all sent at once
    return [SimRequest(f"r{i}", 0.0, [1 + (i * 7919 + j) % 30000 for j in range(prompt)], output) for i in range(n)]


def _steady_rate(run, batch: int) -> float:
    """Completions per second between the 20% and 80% marks. A saturated decode group admits a
    whole batch as the last one ends, so requests finish in waves of B; the marks are moved to
    the ends of waves (the B·k-th completions), or the clumps would bias the rate."""
    ends = np.sort([t.finished_s for t in run.traces if t.finished_s is not None])
    n = len(ends)
    lo, hi = max(1, round(0.2 * n / batch)) * batch - 1, round(0.8 * n / batch) * batch - 1
    if hi <= lo or hi >= n:
        lo, hi = int(0.2 * n), int(0.8 * n)
    return (hi - lo) / (ends[hi] - ends[lo]) if ends[hi] > ends[lo] else math.inf


def check(inputs: PlanInputs, num_requests: int | None = None) -> list[Row]:
    from kvserve.errors import ConfigError

    i = inputs
    if i.kv_layout != "heads":
        raise ConfigError("kv_layout", "the check simulates kvserve's heads layout; the requests layout's busiest chip "
                          "(⌈B/N⌉ requests) is the planner's alone")  # fmt: skip
    if i.shared_prefix_positions:
        raise ConfigError("shared_prefix_positions", "the check's workload has no shared prefix; leave it at 0")
    batch = make_plan(i).derived.decode_batch
    prompt, n_out = i.prompt_positions, i.output_tokens
    if n_out < 2:
        raise ConfigError("output_tokens", "the check needs at least 2 output tokens (a decode stage)")
    steady = dataclasses.replace(i, batch=batch, history_positions=prompt + n_out // 2)
    plan = make_plan(steady)
    d = plan.derived
    c_kv = d.kv_bytes_per_position
    model = from_datasheet(i.model, i.chip, i.bytes_per_weight, c_kv, i.utilisation, model_len=prompt + n_out + 1)
    n = num_requests or max(8 * batch, 128)
    per_request = (prompt + n_out + 1) * c_kv
    # N chips per group as one instance; no AllReduce time, as the planner's step leaves it out
    tp = TensorParallel(i.num_chips, include_comm=False)
    split = tp.attention_split(model)  # a rank holds 1/split of each position's KV
    # a decode instance has room for every request: the planner's batch is capped by max_num_seqs here,
    # not by memory (it allocates for requests whose KV is on its way, beyond those running); a
    # prefill instance, for a few prompts. The budget: a whole prompt in one step (the planner's
    # t_prefill is one prompt's pass).
    common = dict(max_num_batched_tokens=max(prompt, batch), max_num_seqs=batch, enable_prefix_caching=False,
                  shared_prefix_attention="off")  # fmt: skip
    decode_spec = InstanceSpec(kv_cache_memory=int(per_request * (n + 2) * 1.1 / split) + 1, **common)
    prefill_spec = InstanceSpec(kv_cache_memory=int(per_request * 4 / split) + 1, **common)
    t_prefill = d.prefill_s
    rates = {k: plan[k] for k in ("prefill_rate_per_group_req_per_s", "prefill_rate_req_per_s", "decode_rate_req_per_s",
                                  "network_rate_req_per_s", "system_rate_req_per_s")}  # fmt: skip
    # "ample": four times what the planner says keeps the other stages fed
    fastest = max(rates["prefill_rate_per_group_req_per_s"], rates["network_rate_req_per_s"])
    ample_prefill = max(1, math.ceil(max(rates["decode_rate_req_per_s"], rates["network_rate_req_per_s"]) * t_prefill * 4))
    ample_decode = max(1, math.ceil(fastest / rates["decode_rate_req_per_s"] * 4))


    def run(prefill: int, decode: int, link: float, record: bool = False):
        deployment = Deployment(prefill=prefill, decode=decode, handoff_bytes_per_s=link, instance=decode_spec,
                                prefill_instance=prefill_spec, tensor_parallel=tp)  # fmt: skip
        return Simulator(deployment, model, record_steps=record).run(_requests(n, prompt, n_out))

    decode_run = run(ample_prefill, 1, AMPLE, record=True)
    full = [(shape, sec) for name, shape, sec in decode_run.steps
            if name.startswith("decode") and shape.decode_rows == batch and not shape.prefill_rows]  # fmt: skip
    rows = []
    if full:
        mean_history = float(np.mean([s.decode_kv_positions / batch for s, _ in full]))
        at_history = make_plan(dataclasses.replace(steady, history_positions=max(1, round(mean_history)))).derived.decode_step
        rows.append(Row(f"decode step at B={batch}", at_history.total_s, float(np.mean([sec for _, sec in full])), "s",
                        f"mean history {mean_history:.0f} positions"))  # fmt: skip
    rows += [
        Row("prefill time per request", t_prefill, _prefill_time(run(1, ample_decode, AMPLE, record=True), prompt), "s",
            "one prompt's pass: 2·P·S/(C·η)"),
        Row("decode stage rate", rates["decode_rate_req_per_s"], _steady_rate(decode_run, batch), "req/s",
            f"prefill ample ({ample_prefill} groups), link ample"),
        Row("prefill stage rate, one group", rates["prefill_rate_per_group_req_per_s"], _steady_rate(run(1, ample_decode, AMPLE), batch), "req/s",
            f"one prefill group, decode ample ({ample_decode} groups)"),
        Row("network stage rate", rates["network_rate_req_per_s"], _steady_rate(run(ample_prefill, ample_decode, i.handoff_bytes_per_s), batch),
            "req/s", "the link as given, the rest ample"),
        Row("system rate", rates["system_rate_req_per_s"], _steady_rate(run(i.prefill_groups, 1, i.handoff_bytes_per_s), batch),
            "req/s", f"{i.prefill_groups} prefill group(s), one decode group; planner's bottleneck: {plan['bottleneck']}"),
    ]  # fmt: skip
    return rows


def _prefill_time(run, prompt: int) -> float:
    """Mean seconds of the prefill instance's steps that ran exactly one whole prompt."""
    times = [sec for name, shape, sec in run.steps
             if name.startswith("prefill") and shape.prefill_tokens == prompt and shape.prefill_rows == 1]  # fmt: skip
    return float(np.mean(times)) if times else math.nan
