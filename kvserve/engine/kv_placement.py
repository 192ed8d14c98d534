"""Requests placed on ranks for the requests KV layout (`--kv-layout requests`, seed §5).

Each tensor-parallel rank has its own KV pool holding every KV head of the requests placed on
it, and its own prefix cache over that pool. `RequestShardedKVCache` is the scheduler's one
KVCacheManager interface over the ranks' managers: a request is placed when it is admitted
and stays on its rank until it finishes or is preempted (recompute: it may be placed anew).

Placement balances KV bytes within a bound and otherwise follows the prefix cache
(`_place`): a request goes to the rank that has most of its prompt cached unless that rank
would hold more than an eighth of a pool beyond the least loaded one; with no hits, to the
least loaded. A shared system prompt is stored once per rank that serves it, not once per
request, and the ranks' blocks in use stay within the bound of each other.
"""

from __future__ import annotations

from kvserve.engine.block_pool import KVBlock
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.request import Request


# how far past the least loaded rank a rank with the request's prefix cached may go, as a
# fraction of one rank's pool
BALANCE_SLACK = 1 / 8


class RequestShardedKVCache:
    def __init__(self, num_ranks: int, num_blocks_per_rank: int, block_size: int, enable_prefix_caching: bool = True,
                 events=None):  # fmt: skip
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events  # one log for all ranks' pools (kv_events.py)
        self.ranks = [KVCacheManager(num_blocks_per_rank, block_size, enable_prefix_caching, events) for _ in range(num_ranks)]
        self._rank_of: dict[str, int] = {}  # requests holding blocks (or being admitted) -> their rank
        self.prefix_queries = 0  # tokens looked up, over all ranks
        self.prefix_hits = 0  # tokens found

    # ---- the scheduler's interface (KVCacheManager's) ----------------------------------

    @property
    def num_blocks(self) -> int:
        return sum(m.num_blocks for m in self.ranks)

    def num_free_blocks(self) -> int:
        return sum(m.num_free_blocks() for m in self.ranks)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks() / self.num_blocks

    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def ranks_of(self, request_ids: list[str]) -> dict[str, int]:
        return {rid: self._rank_of[rid] for rid in request_ids}

    def block_ids(self, request_id: str) -> list[int]:
        rank = self._rank_of.get(request_id)
        return [] if rank is None else self.ranks[rank].block_ids(request_id)

    def tables(self, request_ids: list[str]) -> tuple[dict[str, list[int]], None]:
        """Each request's table in its rank's pool (no KV groups under this layout)."""
        return {rid: self.block_ids(rid) for rid in request_ids}, None

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Places the request (unless it is placed already), then its prefix hits on that rank."""
        rank = self._rank_of.get(request.request_id)
        if rank is None:
            rank = self._rank_of[request.request_id] = self._place(request)
        return self.ranks[rank].get_computed_blocks(request)

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_queries += num_queried_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] = ()) -> bool:
        rank = self._rank_of.get(request.request_id)
        if rank is None:  # a running request is always placed; a new one through get_computed_blocks
            rank = self._rank_of[request.request_id] = self._place(request)
        ok = self.ranks[rank].allocate_slots(request, num_new_tokens, computed_blocks)
        if not ok and not self.ranks[rank].block_ids(request.request_id):
            del self._rank_of[request.request_id]  # not admitted: placed afresh on the next try
        return ok

    def free(self, request: Request) -> None:
        rank = self._rank_of.pop(request.request_id, None)
        if rank is not None:
            self.ranks[rank].free(request)

    def shares_pool(self, a: Request, b: Request) -> bool:
        """Whether freeing b's blocks can make room for a (the scheduler's preemption victims)."""
        return self._rank_of.get(a.request_id) == self._rank_of.get(b.request_id)

    def reset_prefix_cache(self) -> bool:
        if any(m.num_free_blocks() != m.num_blocks for m in self.ranks):
            return False
        return all(m.reset_prefix_cache() for m in self.ranks)

    # ---- placement ---------------------------------------------------------------------

    def _place(self, request: Request) -> int:
        """The rank with the longest cached prefix of the request, among the ranks within the
        load bound; ties (and no hits anywhere): the fewest blocks in use, then the lower rank.

        Load is blocks in use once the rank holds the request's tokens, its live prefix hits
        there shared rather than new. The bound is the least loaded rank's load plus
        BALANCE_SLACK of a pool (or the request's own blocks, if more): prefix hits save
        compute while the pools have room, and the bound keeps one rank from filling while
        the others idle (the prefix is then computed once more on another rank, which hits
        it from then on)."""
        need = -(-request.num_tokens // self.block_size)
        candidates = []
        for rank, m in enumerate(self.ranks):
            hits, _ = m.get_computed_blocks(request)
            live_hits = sum(1 for b in hits if b.ref_cnt > 0)
            load = m.num_blocks - m.num_free_blocks() + need - live_hits
            candidates.append((rank, len(hits), load))
        lowest = min(load for _, _, load in candidates)
        bound = lowest + max(need, int(self.ranks[0].num_blocks * BALANCE_SLACK))
        within = [c for c in candidates if c[2] <= bound]
        return min(within, key=lambda c: (-c[1], c[2], c[0]))[0]
