"""KVCacheManager: block tables of requests over the BlockPool, with automatic prefix caching
(engine/prefix_cache.py).

Interface as in vLLM v1: `get_computed_blocks` finds a request's longest cached block
prefix, `allocate_slots` grows its block table for the tokens it will compute this step
(or says no, and the scheduler preempts), `free` returns its blocks.
"""

from __future__ import annotations

from kvserve.engine.block_pool import BlockPool, KVBlock
from kvserve.engine.prefix_cache import PrefixCache
from kvserve.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, events=None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, events)  # events: kv_events.KVEventLog (--enable-kv-cache-events), or None
        self.prefix_cache = PrefixCache(self.pool, block_size, events)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks matching the request's token prefix, and its tokens."""
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return [], 0
        hits = self.prefix_cache.lookup(request)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission (a lookup that could not be admitted is retried)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_queried_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] = (), cache: bool = True) -> bool:
        """Make room for `num_new_tokens` beyond what is computed (after `computed_blocks`).
        `cache=False`: the full blocks are not findable yet (their KV arrives later, from
        another instance); `cache_loaded` makes them so once it is there."""
        blocks = self._req_blocks.setdefault(request.request_id, [])
        num_total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_needed = -(-num_total // self.block_size) - len(blocks) - len(computed_blocks)
        # hits sitting in the free queue stop being free once touched
        num_free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            if not blocks:
                del self._req_blocks[request.request_id]
            return False
        self.pool.touch(list(computed_blocks))
        blocks.extend(computed_blocks)
        if num_needed > 0:
            blocks.extend(self.pool.get_new_blocks(num_needed))
        self.prefix_cache.admit(request, len(computed_blocks))
        if self.enable_prefix_caching and cache:
            self.prefix_cache.cache_full_blocks(request, blocks, num_total)
        return True

    def cache_loaded(self, request: Request, num_tokens: int) -> None:
        """The KV of the request's first `num_tokens` positions has been loaded into its blocks:
        their full blocks become findable (those allocated with `cache=False`)."""
        if self.enable_prefix_caching:
            self.prefix_cache.cache_full_blocks(request, self._req_blocks[request.request_id], num_tokens)

    def free(self, request: Request) -> None:
        blocks = self._req_blocks.pop(request.request_id, [])
        self.prefix_cache.forget(request)
        # tail blocks first, so a request's own prefix is the last of it to be evicted
        self.pool.free_blocks(list(reversed(blocks)))

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
