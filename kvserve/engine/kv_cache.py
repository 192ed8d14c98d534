"""KVCacheManager: block tables of requests over the BlockPool, with automatic prefix caching
(engine/prefix_cache.py).

Interface as in vLLM v1: `get_computed_blocks` finds a request's longest cached block
prefix, `allocate_slots` grows its block table for the tokens it will compute this step
(or says no, and the scheduler preempts), `free` returns its blocks.

With KV groups (engine/kv_groups.py: a model with sliding-window layers) a request has one
table per group, all drawing on the one pool. A sliding group's table drops the blocks no
query of the request can see any more (every position before the first one the next query
sees, p - W + 1) at each allocation, so a request past its window holds the window's blocks
only; a prefix hit needs a global group's blocks from the start and a sliding group's only
for the window before the hit's end.
"""

from __future__ import annotations

from kvserve.engine.block_pool import BlockPool, KVBlock
from kvserve.engine.kv_groups import NULL_BLOCK, KVGroups
from kvserve.engine.prefix_cache import PrefixCache
from kvserve.engine.request import Request

# a request's blocks: one list per KV group, None where a sliding group dropped one
GroupBlocks = list[list[KVBlock | None]]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, events=None,
                 groups: KVGroups | None = None):  # fmt: skip
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = groups if groups is not None else KVGroups.single(1)
        # events: kv_events.KVEventLog (--enable-kv-cache-events), or None
        self.pool = BlockPool(num_blocks, events, reserved=self.groups.reserved_blocks)
        self.prefix_caches = [PrefixCache(self.pool, block_size, events, g) for g in range(self.groups.num_groups)]
        self.prefix_cache = self.prefix_caches[0]
        self._req_blocks: dict[str, GroupBlocks] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        self.num_window_frees = 0  # blocks sliding groups gave back as their requests moved past them

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def block_ids(self, request_id: str) -> list[int]:
        """The request's table (its first group's, a global one, where the model has groups)."""
        return self.group_block_ids(request_id)[0] if request_id in self._req_blocks else []

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's table in each group; a sliding group's dropped blocks read NULL_BLOCK."""
        return [[NULL_BLOCK if b is None else b.block_id for b in blocks] for blocks in self._req_blocks.get(request_id, [[]])]

    def tables(self, request_ids: list[str]) -> tuple[dict[str, list[int]], dict[str, list[list[int]]] | None]:
        """What a SchedulerOutput carries for these requests: each one's table, and with
        several KV groups its table in each (None without)."""
        per_group = {rid: self.group_block_ids(rid) for rid in request_ids}
        return {rid: t[0] for rid, t in per_group.items()}, (per_group if self.groups.grouped else None)

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks the request holds now, every group's."""
        return sum(1 for blocks in self._req_blocks.get(request_id, ()) for b in blocks if b is not None)

    def get_computed_blocks(self, request: Request) -> tuple[list, int]:
        """Longest run of cached full blocks matching the request's token prefix, and its
        tokens. Without windows a list of blocks; with them, one list per group (None where a
        sliding group needs nothing)."""
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return [], 0
        if not self.groups.windowed:
            hits = self.prefix_cache.lookup(request)
            return hits, len(hits) * self.block_size
        hits = self._grouped_lookup(request)
        return hits, len(hits[0]) * self.block_size

    def _grouped_lookup(self, request: Request) -> GroupBlocks:
        """The longest h blocks that every global group has cached from the start and every
        sliding group for the positions the query after them sees (p - W + 1 on)."""
        windows, bs = self.groups.group_windows, self.block_size
        runs = {g: self.prefix_caches[g].lookup(request) for g, w in enumerate(windows) if w is None}
        h = min((len(r) for r in runs.values()), default=(request.num_tokens - 1) // bs)
        hashes = request.block_hashes
        # per sliding group: its cached blocks among the first h, and how many are missing
        # before each index, so each candidate h is checked in O(1)
        found: dict[int, list[KVBlock | None]] = {}
        missing: dict[int, list[int]] = {}
        for g, window in enumerate(windows):
            if window is not None:
                found[g] = [self.pool.get_cached_block(hashes[i], g) for i in range(h)]
                counts = [0]
                for b in found[g]:
                    counts.append(counts[-1] + (b is None))
                missing[g] = counts
        while h > 0:
            firsts = {g: max(0, h * bs - windows[g] + 1) // bs for g in found}
            if all(missing[g][h] == missing[g][first] for g, first in firsts.items()):
                return [runs[g][:h] if w is None else [None] * firsts[g] + found[g][firsts[g]:h] for g, w in enumerate(windows)]
            h -= 1
        return [[] for _ in windows]

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission (a lookup that could not be admitted is retried)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_queried_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks=(), cache: bool = True) -> bool:
        """Make room for `num_new_tokens` beyond what is computed (after `computed_blocks`, as
        get_computed_blocks returned them). `cache=False`: the full blocks are not findable yet
        (their KV arrives later, from another instance); `cache_loaded` makes them so once it is
        there. Sliding groups first give back what their windows left behind."""
        groups = self.groups.num_groups
        hits: GroupBlocks = [list(computed_blocks)] if not self.groups.windowed else (
            [list(h) for h in computed_blocks] if computed_blocks else [[] for _ in range(groups)])  # fmt: skip
        new_request = request.request_id not in self._req_blocks
        tables = self._req_blocks.setdefault(request.request_id, [[] for _ in range(groups)])
        num_hit = len(hits[0])
        start = request.num_computed_tokens + num_hit * self.block_size  # the step's first position
        num_total = start + num_new_tokens
        self._drop_out_of_window(tables, start)
        total_blocks = -(-num_total // self.block_size)
        needed = [max(0, total_blocks - len(t) - len(h)) for t, h in zip(tables, hits)]
        # hits sitting in the free queue stop being free once touched
        num_free_hits = sum(1 for h in hits for b in h if b is not None and b.ref_cnt == 0)
        if sum(needed) > self.pool.num_free_blocks - num_free_hits:
            if new_request:
                del self._req_blocks[request.request_id]
            return False
        # every group's hits leave the free queue before any group takes new blocks from it: a
        # hit of a later group must not be handed out (and overwritten) as an earlier one's new block
        for h in hits:
            self.pool.touch([b for b in h if b is not None])
        for table, h, n in zip(tables, hits, needed):
            table.extend(h)
            if n > 0:
                table.extend(self.pool.get_new_blocks(n))
        for g, cache_g in enumerate(self.prefix_caches):
            cache_g.admit(request, num_hit)
            if self.enable_prefix_caching and cache:
                cache_g.cache_full_blocks(request, tables[g], num_total)
        return True

    def _drop_out_of_window(self, tables: GroupBlocks, next_position: int) -> None:
        """A sliding group's blocks wholly before next_position - W + 1 go back to the pool."""
        for table, window in zip(tables, self.groups.group_windows):
            if window is None:
                continue
            first = max(0, next_position - window + 1) // self.block_size
            gone = [b for b in table[:first] if b is not None]
            if gone:
                for i in range(min(first, len(table))):
                    table[i] = None
                self.pool.free_blocks(gone)  # oldest first: the first evicted of what is cached
                self.num_window_frees += len(gone)

    def cache_loaded(self, request: Request, num_tokens: int) -> None:
        """The KV of the request's first `num_tokens` positions has been loaded into its blocks:
        their full blocks become findable (those allocated with `cache=False`)."""
        if self.enable_prefix_caching:
            tables = self._req_blocks[request.request_id]
            for g, cache_g in enumerate(self.prefix_caches):
                cache_g.cache_full_blocks(request, tables[g], num_tokens)

    def free(self, request: Request) -> None:
        tables = self._req_blocks.pop(request.request_id, [])
        for cache_g in self.prefix_caches:
            cache_g.forget(request)
        # tail blocks first (every group's at a position before the one before it), so a
        # request's own prefix is the last of it to be evicted
        longest = max((len(t) for t in tables), default=0)
        self.pool.free_blocks([t[i] for i in reversed(range(longest)) for t in tables if i < len(t) and t[i] is not None])

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def ranks_of(self, request_ids: list[str]) -> dict[str, int] | None:
        """Which rank's pool holds each request's KV: None, there is one pool (see kv_placement.py)."""
        return None

    def shares_pool(self, a: Request, b: Request) -> bool:
        """Whether freeing b's blocks can make room for a: always, with one pool."""
        return True

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
