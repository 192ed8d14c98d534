"""How one model is split over N tensor-parallel ranks (seed §5), and each rank's share of it.

Megatron's split, by head and by FFN column, so each rank computes whole heads and whole
SiLU columns and only two AllReduces per layer join them:
- QKV column-parallel by head: rank r takes query heads [r·N_q/N, (r+1)·N_q/N) and the KV heads
  those need; gate/up column-parallel, F/N columns each;
- O and down row-parallel (the matching input columns), their partial sums AllReduced;
- a mixture of experts' every expert (routed and shared) split as a dense FFN, by its own
  width; the router (and a shared expert's gate) whole on every rank, so all ranks route alike
  and each runs its share of the same experts;
- embedding and LM head vocab-parallel: ceil(V/N) rows each (the last rank fewer); the
  embedding's partial rows AllReduced, the LM head's logits gathered before sampling.

KV heads per rank: N_kv / N where N divides N_kv. Where N > N_kv, a rank keeps the one KV head
its query heads read, so each KV head is held by N / N_kv ranks: the replication factor the
seed's 16-chip / 8-KV-head example describes (each chip keeps 1/8 of the logical KV, not 1/16).
Anything that would cut a head in two is refused with the reason.
"""

from __future__ import annotations

import dataclasses

from kvserve.errors import ConfigError
from kvserve.arch import ModelArchitecture


@dataclasses.dataclass(frozen=True)
class TensorParallelShard:
    """Rank `rank` of `world`'s share of a model."""

    rank: int
    world: int
    q_heads: tuple[int, int]  # [first, end) of the model's query heads
    kv_heads: tuple[int, int]  # [first, end) of its KV heads
    ffn: tuple[int, int]  # [first, end) of the intermediate (gate/up rows, down columns)
    vocab: tuple[int, int]  # [first, end) of the vocabulary (embedding and LM head rows)
    kv_replication: int  # ranks holding each KV head (1 where N divides N_kv)
    expert_ffn: tuple[int, int] = (0, 0)  # [first, end) of each routed expert's width
    shared_ffn: tuple[int, int] = (0, 0)  # and of the shared expert's

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def local_arch(self, arch: ModelArchitecture) -> ModelArchitecture:
        """The architecture this rank's layers have (its heads and FFN columns; the vocabulary
        stays whole: the LM head's gathered logits cover all of it)."""
        return dataclasses.replace(
            arch, num_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads, intermediate_size=self.ffn[1] - self.ffn[0],
            moe_intermediate_size=self.expert_ffn[1] - self.expert_ffn[0],
            shared_expert_intermediate_size=self.shared_ffn[1] - self.shared_ffn[0],
        )


def plan_shard(arch: ModelArchitecture, rank: int, world: int) -> TensorParallelShard:
    """Rank `rank`'s share, or ConfigError("tensor_parallel_size") naming what does not split."""
    if world < 1:
        raise ConfigError("tensor_parallel_size", f"must be >= 1, got {world}")
    nq, nkv, ffn = arch.num_heads, arch.num_kv_heads, arch.intermediate_size
    if nq % world:
        raise ConfigError(
            "tensor_parallel_size", f"{world} ranks cannot split {nq} query heads (each rank computes whole heads)"
        )
    if nkv % world and world % nkv:
        raise ConfigError(
            "tensor_parallel_size",
            f"{world} ranks over {nkv} KV heads: neither divides the other, so some rank's query heads would need "
            "parts of two KV heads",
        )
    for what, width in (("FFN", ffn), ("expert", arch.moe_intermediate_size), ("shared expert", arch.shared_expert_intermediate_size)):
        if width % world:
            raise ConfigError("tensor_parallel_size", f"{world} ranks cannot split the {what} width {width} into equal columns")
    per_rank_q = nq // world
    q0 = rank * per_rank_q
    g = nq // nkv
    if world <= nkv:
        per_rank_kv = nkv // world
        kv = (rank * per_rank_kv, (rank + 1) * per_rank_kv)
        replication = 1
    else:  # each rank's query heads lie within one KV head's group: that head, replicated
        kv = (q0 // g, q0 // g + 1)
        replication = world // nkv
    vocab_per_rank = -(-arch.vocab_size // world)
    v0 = min(rank * vocab_per_rank, arch.vocab_size)
    per_rank_ffn = ffn // world
    per_expert, per_shared = arch.moe_intermediate_size // world, arch.shared_expert_intermediate_size // world
    return TensorParallelShard(
        rank=rank, world=world, q_heads=(q0, q0 + per_rank_q), kv_heads=kv,
        ffn=(rank * per_rank_ffn, (rank + 1) * per_rank_ffn),
        expert_ffn=(rank * per_expert, (rank + 1) * per_expert), shared_ffn=(rank * per_shared, (rank + 1) * per_shared),
        vocab=(v0, min(v0 + vocab_per_rank, arch.vocab_size)), kv_replication=replication,
    )  # fmt: skip

