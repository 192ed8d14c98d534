"""Prefill time and what a user waits for (seed §4): TTFT, total time, which half to optimise.

Projections of a prompt of S positions cost ≈ 2·P·S FLOPs (a forward pass: no dX, dW,
so not 6PS). At a given utilisation η on N chips of peak C the prefill takes
2·P·S/(N·C·η). If prefill yields the first token and N_out tokens are returned, the
remaining N_out − 1 come from decode steps: total = t_prefill + (N_out − 1)·t_step.
"""

from __future__ import annotations

from dataclasses import dataclass


def prefill_projection_flops(num_params: float, prompt_positions: int) -> float:
    """2·P·S: projections only; attention pairs are counted apart (attention.py)."""
    return 2 * num_params * prompt_positions


def prefill_time_s(num_params: float, prompt_positions: int, num_chips: int, peak_flops_per_s: float, utilisation: float) -> float:
    """2·P·S/(N·C·η)."""
    return prefill_projection_flops(num_params, prompt_positions) / (num_chips * peak_flops_per_s * utilisation)


def total_time_s(ttft_s: float, step_s: float, output_tokens: int) -> float:
    """TTFT + (N_out − 1)·t_step: the first token comes from prefill."""
    return ttft_s + (output_tokens - 1) * step_s


@dataclass(frozen=True)
class OptimisationEffect:
    """TTFT and total time before and after halving prefill or decode (the §4 comparison)."""

    ttft_s: float
    total_s: float
    halved_prefill_ttft_s: float
    halved_prefill_total_s: float
    halved_decode_ttft_s: float
    halved_decode_total_s: float


def optimisation_effect(prefill_s: float, step_s: float, output_tokens: int) -> OptimisationEffect:
    return OptimisationEffect(
        ttft_s=prefill_s,
        total_s=total_time_s(prefill_s, step_s, output_tokens),
        halved_prefill_ttft_s=prefill_s / 2,
        halved_prefill_total_s=total_time_s(prefill_s / 2, step_s, output_tokens),
        halved_decode_ttft_s=prefill_s,
        halved_decode_total_s=total_time_s(prefill_s, step_s / 2, output_tokens),
    )


def handoff_gap_s(handoff_s: float, step_s: float) -> float:
    """First-to-second token gap after disaggregated prefill: KV transfer then one decode step."""
    return handoff_s + step_s
