"""Prefill/decode disaggregation in one unit, requests/s (seed §7).

Three stages run in parallel on different requests, so the steady rate is the minimum
of their rates (not the inverse of summed per-request times):
prefill G_p/t_prefill, decode B/(t_step·n_decode), handoff network bandwidth/bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def prefill_rate_req_per_s(prefill_s_per_request: float, prefill_groups: int = 1) -> float:
    """G_p/t_prefill: each group prepares one request every t_prefill."""
    return prefill_groups / prefill_s_per_request


def decode_rate_req_per_s(batch: int, step_s: float, decode_steps_per_request: float) -> float:
    """B/(t_step·n_decode): B request-steps per step, n_decode of them per request."""
    if decode_steps_per_request == 0:
        return math.inf  # nothing to decode: that stage never limits
    return batch / step_s / decode_steps_per_request


def handoff_bytes_per_request(prompt_positions: int, kv_bytes_per_position: float) -> float:
    """S_prompt·c_kv: the prompt's KV crosses the link once."""
    return prompt_positions * kv_bytes_per_position


def network_rate_req_per_s(handoff_bytes_per_s: float, handoff_bytes: float) -> float:
    return handoff_bytes_per_s / handoff_bytes


def prefill_groups_to_feed(decode_rate: float, prefill_s_per_request: float) -> int:
    """⌈decode rate · t_prefill⌉ groups keep one decode group fed."""
    return math.ceil(decode_rate * prefill_s_per_request - 1e-9)


def bandwidth_for_rate(rate_req_per_s: float, handoff_bytes: float) -> float:
    """rate · bytes: a necessary average, not a queueing or tail-latency guarantee."""
    return rate_req_per_s * handoff_bytes


@dataclass(frozen=True)
class StageRates:
    prefill_req_per_s: float
    decode_req_per_s: float
    network_req_per_s: float

    @property
    def as_dict(self) -> dict[str, float]:
        return {"prefill": self.prefill_req_per_s, "decode": self.decode_req_per_s, "network": self.network_req_per_s}

    @property
    def system_req_per_s(self) -> float:
        return min(self.as_dict.values())

    @property
    def bottleneck(self) -> str:
        rates = self.as_dict
        return min(rates, key=rates.get)
