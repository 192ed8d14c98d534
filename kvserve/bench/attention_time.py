"""Decode attention time per step, measured inside a bench run (`--profile-attention`).

The CPU kernels record a profiler range around each decode attention call, plain or in
shared-prefix parts (kernels.h kDecodeAttentionRange), also from inside the fused decode step,
where Python never sees the call. Under torch.profiler those ranges are summed and divided by
the number of decode steps (calls / layers): the issue-17 figure "decode attention time per
step", on and off, from the same command as the throughput. The plain-torch path records no
range, so there the figure is absent rather than zero.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

RANGE = "kvserve::decode_attention"


@contextlib.contextmanager
def decode_attention_profile(num_layers: int) -> Iterator[dict[str, Any]]:
    """Profile the block; afterwards the yielded dict holds `decode_attention_ms_per_step` and
    `decode_attention_steps` (nothing when no kernel range was recorded)."""
    from torch.profiler import ProfilerActivity, profile

    result: dict[str, Any] = {}
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        yield result
    events = [e for e in prof.events() if e.name == RANGE]
    if events and num_layers:
        steps = len(events) / num_layers
        total_us = sum(e.cpu_time_total for e in events)
        result["decode_attention_ms_per_step"] = total_us / 1e3 / steps
        result["decode_attention_steps"] = round(steps)
