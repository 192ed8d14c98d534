"""Device cost per token (seed §8).

At full load N chips at c per chip-second make B tokens every t: c·N·t/B per token.
At a lower arrival rate the chips are paid for all the same, so the cost per token is
c·N over the tokens actually produced. Decode devices only: prefill, handoff and idle
time belong in an end-to-end budget on top.
"""

from __future__ import annotations

TOKENS_PER_MILLION = 1e6


def cost_per_token_usd(cost_usd_per_chip_s: float, num_chips: int, step_s: float, batch: int) -> float:
    """c·N·t/B."""
    return cost_usd_per_chip_s * num_chips * step_s / batch


def cost_per_token_at_rate_usd(cost_usd_per_chip_s: float, num_chips: int, step_s: float, batch: int, tokens_per_s: float) -> float:
    """c·N/min(rate, B/t): an arrival rate at or above full load costs the full-load price."""
    return cost_usd_per_chip_s * num_chips / min(tokens_per_s, batch / step_s)
