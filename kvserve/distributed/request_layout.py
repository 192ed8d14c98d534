"""The requests KV layout (`--kv-layout requests`, seed §5): whole requests' KV on one rank.

The projections stay split by head as in the heads layout (sharding.py), but each request's KV
lives whole, every KV head, on the one rank the scheduler placed it on (engine/kv_placement.py).
Nothing is replicated where ranks outnumber KV heads; instead, per layer:

1. every rank computes its heads' Q, K and V for all T rows of the step;
2. all-to-all: each row's columns go to the rank holding that row's request, which assembles
   all heads of its T_r rows (Q of every rank; K and V once per KV head, from the first rank
   holding it: the copies of a replicated head are the same numbers);
3. that rank applies RoPE, writes the new K/V into its pool and runs attention with all heads,
   exactly as one process would for those requests (the same kernels, the same metadata);
4. all-to-all back: each rank gets its query heads' attention outputs for all T rows, and the
   row-parallel O projection and its AllReduce follow as in the heads layout.

The step's flat batch is ordered by rank (each rank's decodes, then its prefill chunks), so
each rank's rows are one contiguous range and every message is a plain slice.
"""

from __future__ import annotations

import dataclasses

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.distributed.sharding import TensorParallelShard


@dataclasses.dataclass(frozen=True)
class RequestHeads:
    """Which columns of the QKV output each rank computes, and which it sends (fixed per engine)."""

    num_heads: int  # the model's N_q
    num_kv_heads: int  # the model's N_kv
    head_dim: int
    q_widths: tuple[int, ...]  # per rank: its query heads' columns
    kv_widths: tuple[int, ...]  # per rank: its KV heads' columns (of K, and of V)
    sends_kv: tuple[bool, ...]  # per rank: the first holder of its KV heads (the others' copies stay home)

    @classmethod
    def from_shards(cls, shards: list[TensorParallelShard], num_heads: int, num_kv_heads: int, head_dim: int) -> "RequestHeads":
        seen: set[tuple[int, int]] = set()
        sends = []
        for sh in shards:
            sends.append(sh.kv_heads not in seen)
            seen.add(sh.kv_heads)
        return cls(
            num_heads, num_kv_heads, head_dim,
            tuple(sh.num_q_heads * head_dim for sh in shards), tuple(sh.num_kv_heads * head_dim for sh in shards), tuple(sends),
        )  # fmt: skip

    def send_width(self, rank: int) -> int:
        return self.q_widths[rank] + (2 * self.kv_widths[rank] if self.sends_kv[rank] else 0)


@dataclasses.dataclass
class RequestShardedMetadata:
    """A step's attention metadata under the requests layout: one AttentionMetadata per rank,
    over that rank's rows (query offsets from 0, slots in its own pool), and how many rows of
    the flat batch each rank holds, in rank order. Rank 0 builds it; every rank receives it."""

    per_rank: list[AttentionMetadata]
    rows_per_rank: list[int]

    @property
    def kv_positions_read(self) -> int:
        return sum(m.kv_positions_read for m in self.per_rank)

    @property
    def shared_prefix(self):
        """For the engine's shared-prefix step counter: some rank's plan, if any rank has one."""
        return next((m.shared_prefix for m in self.per_rank if m.shared_prefix is not None), None)

    def kv_positions_read_with_sharing(self) -> int:
        return sum(m.kv_positions_read_with_sharing() for m in self.per_rank)


class RequestExchange:
    """One step's two all-to-alls for one rank: heads → requests before attention, and the
    attention outputs requests → heads after it."""

    def __init__(self, tp, heads: RequestHeads, rows_per_rank: list[int]):
        self.tp = tp
        self.heads = heads
        self.rows = rows_per_rank
        self.rank = tp.rank
        self.local_rows = rows_per_rank[tp.rank]

    def to_requests(self, qkv: torch.Tensor) -> torch.Tensor:
        """This rank's [T, q_w + 2·kv_w] share of every row → all heads of its own rows,
        [T_r, (N_q + 2·N_kv)·H] in the usual Q | K | V column order."""
        h, me = self.heads, self.rank
        send = qkv if h.sends_kv[me] else qkv[:, : h.q_widths[me]]
        width = h.send_width(me)
        in_splits = [n * width for n in self.rows]
        out_splits = [self.local_rows * h.send_width(r) for r in range(len(self.rows))]
        largest = max(sum(self.rows) * h.send_width(r) for r in range(len(self.rows)))
        got = self.tp.all_to_all(send.contiguous().view(-1), in_splits, out_splits, largest)
        parts = [p.view(self.local_rows, h.send_width(r)) for r, p in enumerate(got.split(out_splits))]
        qs = [p[:, : h.q_widths[r]] for r, p in enumerate(parts)]
        ks = [p[:, h.q_widths[r] : h.q_widths[r] + h.kv_widths[r]] for r, p in enumerate(parts) if h.sends_kv[r]]
        vs = [p[:, h.q_widths[r] + h.kv_widths[r] :] for r, p in enumerate(parts) if h.sends_kv[r]]
        return torch.cat(qs + ks + vs, dim=1)

    def to_heads(self, out: torch.Tensor) -> torch.Tensor:
        """Attention outputs of this rank's rows, [T_r, N_q·H] → this rank's query heads for
        every row of the step, [T, q_w] (the rows come back in the flat batch's order)."""
        h, me = self.heads, self.rank
        bounds = [0]
        for w in h.q_widths:
            bounds.append(bounds[-1] + w)
        send = torch.cat([out[:, bounds[r] : bounds[r + 1]].reshape(-1) for r in range(len(self.rows))])
        in_splits = [self.local_rows * w for w in h.q_widths]
        out_splits = [n * h.q_widths[me] for n in self.rows]
        got = self.tp.all_to_all(send, in_splits, out_splits, max(self.rows) * h.num_heads * h.head_dim)
        return got.view(sum(self.rows), h.q_widths[me])


@dataclasses.dataclass
class RequestStep:
    """What each attention layer of one rank needs in the requests layout: its own rows'
    metadata and RoPE inputs, and the exchange that brings their heads in and sends them back."""

    local: AttentionMetadata
    rope: object  # llama.RopeInputs over this rank's rows' positions
    exchange: RequestExchange
