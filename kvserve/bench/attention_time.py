"""Decode attention time per step, measured inside a bench run (`--profile-attention`).

The CPU kernels record a profiler range around each decode attention call, plain or in
shared-prefix parts (kernels.h kDecodeAttentionRange), also from inside the fused decode step,
where Python never sees the call. Under torch.profiler those ranges are summed and divided by
the number of decode steps (calls / layers): the issue-17 figure "decode attention time per
step", from the same command as the throughput. The plain-torch path records no range, so
there the figure is absent rather than zero.

`alternate=True` (`--shared-prefix-attention-ab`) runs every other step with the shared-prefix
plan and the others without, each step inside its own range, so that one run gives the
attention time on and off side by side: on a shared machine whose speed moves by a third
between runs, steps interleaved within one run are the comparison that holds.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator
from typing import Any

RANGE = "kvserve::decode_attention"
STEP_RANGE = "kvserve::step_shared_prefix_"  # + "auto" or "off"


@contextlib.contextmanager
def decode_attention_profile(engine, alternate: bool = False) -> Iterator[dict[str, Any]]:
    """Profile the block; afterwards the yielded dict holds `decode_attention_ms_per_step` and
    `decode_attention_steps`, and with `alternate` the same per mode in
    `decode_attention_ab` ({"auto": {...}, "off": {...}}). Nothing when no kernel range was
    recorded."""
    from torch.profiler import ProfilerActivity, profile, record_function

    result: dict[str, Any] = {}
    runner = engine.runner
    configured = runner.shared_prefix_attention
    original_step = engine.step
    if alternate:
        count = [0]

        def step():
            mode = "auto" if count[0] % 2 == 0 else "off"
            count[0] += 1
            runner.shared_prefix_attention = mode
            with record_function(STEP_RANGE + mode):
                return original_step()

        engine.step = step
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
            yield result
    finally:
        if alternate:
            del engine.step  # the class's method again
            runner.shared_prefix_attention = configured
    events = prof.events()
    calls = [e for e in events if e.name == RANGE]
    layers = engine.arch.num_layers
    if not calls or not layers:
        return
    result.update(_per_step(calls, layers))
    if alternate:
        steps = sorted((e for e in events if e.name.startswith(STEP_RANGE)), key=lambda e: e.time_range.start)
        starts = [e.time_range.start for e in steps]
        by_mode: dict[str, list] = {"auto": [], "off": []}
        for call in calls:  # each attention call inside the step range that contains it
            i = bisect.bisect_right(starts, call.time_range.start) - 1
            if i >= 0 and call.time_range.end <= steps[i].time_range.end:
                by_mode[steps[i].name[len(STEP_RANGE):]].append(call)
        result["decode_attention_ab"] = {mode: _per_step(c, layers) for mode, c in by_mode.items() if c}


def _per_step(calls, layers: int) -> dict[str, Any]:
    steps = len(calls) / layers
    return {
        "decode_attention_ms_per_step": sum(e.cpu_time_total for e in calls) / 1e3 / steps,
        "decode_attention_steps": round(steps),
    }
