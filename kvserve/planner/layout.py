"""Where weights and KV sit on N chips (seed §5): the `heads` and `requests` layouts.

`heads`: chips split whole Query heads; a chip keeps locally every KV head its Query
heads need, for every request. With N ≤ N_kv a chip holds N_kv/N KV heads (1/N of the
KV); with N > N_kv the g Query heads of one group land on several chips that each
keep the same KV head, so a chip holds 1/N_kv of the KV, not 1/N — KV is replicated
N/N_kv times and adding chips no longer shrinks it.

`requests`: each chip keeps all KV heads of its share of the requests (B/N of them);
nothing is replicated, but new Q and attention outputs are exchanged every step.

Weights are split evenly in both (an approximation the seed flags: duplicated K/V
projections would add to it). Where the model's full shape is known, `weight_shares.py`
sums the busiest chip's exact share as the engine splits it (replicated norms, K/V
projections duplicated past N_kv chips, ⌈V/N⌉ vocabulary rows); the placement carries it
as `weight_bytes_held_per_chip`, which capacity uses, while the roofline keeps W/N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.errors import ConfigError

KV_LAYOUTS = ("heads", "requests")


def check_heads_layout(num_chips: int, num_query_heads: int, num_kv_heads: int) -> None:
    """Whole Query heads per chip, and KV groups that either split or replicate evenly."""
    if num_query_heads % num_chips:
        raise ConfigError(
            "num_chips", f"the heads layout gives each chip whole Query heads: {num_chips} chips "
            f"must divide {num_query_heads} Query heads (or use --kv-layout requests)",
        )
    if num_kv_heads % num_chips and num_chips % num_kv_heads:
        raise ConfigError(
            "num_chips", f"the heads layout needs chips to divide or be a multiple of the "
            f"{num_kv_heads} KV heads, got {num_chips}",
        )


def kv_heads_per_chip(num_chips: int, num_kv_heads: int) -> int:
    """max(N_kv/N, 1) under the heads layout."""
    return max(num_kv_heads // num_chips, 1)


@dataclass(frozen=True)
class Placement:
    """Per-chip share of one model replica on `num_chips` chips at history length S."""

    layout: str
    num_chips: int
    params_per_chip: float  # P/N: projection FLOPs per chip are 2·(P/N)·B
    weight_bytes_per_chip: float  # W/N = P·p_w/N
    kv_bytes_per_request: float  # S·c_kv, one request's logical KV (read per step)
    kv_bytes_per_request_allocated: float  # ⌈S/b⌉·b·c_kv (what capacity must hold)
    kv_fraction_per_chip: float  # heads: N_kv,chip/N_kv; requests: 1 (whole requests)
    kv_replication_factor: float  # copies of each KV byte across the chips
    # S_shared·c_kv of a prefix every request shares, when a step reads it once for all the
    # requests on a chip (shared-prefix attention); 0: each request reads its whole S·c_kv
    shared_kv_bytes_read_once: float = 0.0
    # the busiest chip's exact weight bytes as the engine splits them (weight_shares.py); None: unknown
    weight_bytes_held_per_chip: float | None = None

    @property
    def weight_bytes_in_memory(self) -> float:
        """What the weights take on the busiest chip: the exact share where known, else W/N."""
        return self.weight_bytes_per_chip if self.weight_bytes_held_per_chip is None else self.weight_bytes_held_per_chip

    def requests_on_busiest_chip(self, batch: int) -> int:
        """heads: every chip serves every request; requests: ⌈B/N⌉ on the fullest chip."""
        return batch if self.layout == "heads" else math.ceil(batch / self.num_chips)

    def kv_read_bytes_on_busiest_chip(self, batch: int) -> float:
        """r·S·c_kv·f for r requests on the chip; read once, (S_shared + r·S_private)·c_kv·f."""
        requests = self.requests_on_busiest_chip(batch)
        shared = self.shared_kv_bytes_read_once if requests else 0.0
        return (shared + requests * (self.kv_bytes_per_request - shared)) * self.kv_fraction_per_chip

    def kv_allocated_bytes_on_busiest_chip(self, batch: int) -> float:
        return self.requests_on_busiest_chip(batch) * self.kv_bytes_per_request_allocated * self.kv_fraction_per_chip

    @property
    def kv_bytes_per_request_per_chip(self) -> float:
        """Local KV one request costs a chip: S·c_kv·N_kv,chip/N_kv (heads), S·c_kv/N on average (requests)."""
        share = self.kv_fraction_per_chip if self.layout == "heads" else 1 / self.num_chips
        return self.kv_bytes_per_request * share


def place(
    layout: str, num_chips: int, num_params: float, bytes_per_weight: float, num_kv_heads: int,
    kv_bytes_per_request: float, kv_bytes_per_request_allocated: float | None = None,
    shared_kv_bytes_read_once: float = 0.0, weight_bytes_held_per_chip: float | None = None,
) -> Placement:
    if layout == "heads":
        per_chip = kv_heads_per_chip(num_chips, num_kv_heads)
        fraction = per_chip / num_kv_heads
        replication = num_chips * per_chip / num_kv_heads
    else:
        fraction, replication = 1.0, 1.0
    return Placement(
        layout=layout,
        num_chips=num_chips,
        params_per_chip=num_params / num_chips,
        weight_bytes_per_chip=num_params * bytes_per_weight / num_chips,
        kv_bytes_per_request=kv_bytes_per_request,
        kv_bytes_per_request_allocated=kv_bytes_per_request if kv_bytes_per_request_allocated is None else kv_bytes_per_request_allocated,
        kv_fraction_per_chip=fraction,
        kv_replication_factor=replication,
        shared_kv_bytes_read_once=shared_kv_bytes_read_once,
        weight_bytes_held_per_chip=weight_bytes_held_per_chip,
    )
