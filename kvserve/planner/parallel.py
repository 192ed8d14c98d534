"""Tensor parallelism against independent replicas, and collective time (seed §5).

With batch 1 per replica, n replicas of step t1 give n/t1 tokens/s; one replica spread
over n chips with step t_n gives 1/t_n. TP raises system throughput only if
t_n < t1/n. Each TP layer ends in a reduction of `[B, D]` partial sums whose size does
not shrink with more chips: α + κ·B·D·p_a/bandwidth, κ set by the collective (ring:
AllReduce 2(n−1)/n, ReduceScatter (n−1)/n).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import ConfigError

COLLECTIVES = ("allreduce", "reducescatter")

# reductions per transformer layer in Megatron-style TP: attention output and MLP down
REDUCTIONS_PER_LAYER = 2


def collective_factor(collective: str, num_chips: int) -> float:
    """κ for a ring collective among n chips (0 for one chip: nothing to exchange)."""
    if collective == "allreduce":
        return 2 * (num_chips - 1) / num_chips
    if collective == "reducescatter":
        return (num_chips - 1) / num_chips
    raise ConfigError("collective", f"must be one of {', '.join(COLLECTIVES)}, got {collective!r}")


def partial_sum_bytes(batch: int, d_model: int, bytes_per_activation: float) -> float:
    """B·D·p_a: the [B, D] partial output each chip holds after its local matmul."""
    return batch * d_model * bytes_per_activation


def collective_time_s(
    collective: str, num_chips: int, batch: int, d_model: int, bytes_per_activation: float,
    link_bytes_per_s: float, link_latency_s: float,
) -> float:
    """α + κ·B·D·p_a/bandwidth; 0 on one chip."""
    if num_chips == 1:
        return 0.0
    return link_latency_s + collective_factor(collective, num_chips) * partial_sum_bytes(batch, d_model, bytes_per_activation) / link_bytes_per_s


def tp_comm_s_per_step(num_layers: int, num_chips: int, batch: int, d_model: int, bytes_per_activation: float, link_bytes_per_s: float, link_latency_s: float) -> float:
    """2 AllReduces a layer, unoverlapped: what the staged step model leaves out."""
    one = collective_time_s("allreduce", num_chips, batch, d_model, bytes_per_activation, link_bytes_per_s, link_latency_s)
    return REDUCTIONS_PER_LAYER * num_layers * one


@dataclass(frozen=True)
class TPComparison:
    num_chips: int  # chips in the comparison, all used either way
    replica_chips: int  # chips per independent replica (1 in the seed's example)
    replica_step_s: float  # t1
    tp_step_s: float  # t_n
    replicas_tokens_per_s: float  # (n/m)/t1
    tp_tokens_per_s: float  # 1/t_n

    @property
    def tp_step_needed_s(self) -> float:
        """TP wins on throughput only below t1·m/n (t1/2 for two chips)."""
        return self.replica_step_s * self.replica_chips / self.num_chips

    @property
    def winner(self) -> str:
        return "tp" if self.tp_tokens_per_s > self.replicas_tokens_per_s else "replicas"


def tp_vs_replicas(replica_step_s: float, tp_step_s: float, num_chips: int = 2, replica_chips: int = 1) -> TPComparison:
    """n/m replicas each of batch 1 (step t1) against one batch-1 replica on n chips (step t_n)."""
    return TPComparison(
        num_chips=num_chips,
        replica_chips=replica_chips,
        replica_step_s=replica_step_s,
        tp_step_s=tp_step_s,
        replicas_tokens_per_s=(num_chips / replica_chips) / replica_step_s,
        tp_tokens_per_s=1 / tp_step_s,
    )
