"""KVCacheManager: block tables of requests over the BlockPool, with automatic prefix caching.

Interface as in vLLM v1: `get_computed_blocks` finds a request's longest cached block
prefix, `allocate_slots` grows its block table for the tokens it will compute this step
(or says no, and the scheduler preempts), `free` returns its blocks.
"""

from __future__ import annotations

from kvserve.engine.block_pool import BlockPool, KVBlock
from kvserve.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, events=None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events  # kv_events.KVEventLog (--enable-kv-cache-events), or None
        self.pool = BlockPool(num_blocks, events)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._num_hashed_blocks: dict[str, int] = {}
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
        """Longest run of cached full blocks matching the request's token prefix.

        The last token is never taken from the cache: its logits are needed to sample.
        """
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
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
        self._num_hashed_blocks.setdefault(request.request_id, len(computed_blocks))
        if self.enable_prefix_caching and cache:
            self._cache_full_blocks(request, blocks, num_total)
        return True

    def cache_loaded(self, request: Request, num_tokens: int) -> None:
        """The KV of the request's first `num_tokens` positions has been loaded into its blocks:
        their full blocks become findable (those allocated with `cache=False`)."""
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, self._req_blocks[request.request_id], num_tokens)

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # Blocks whose every token is computed by the end of this step become findable. A
        # request scheduled later in the same step may hit them: each layer writes all new
        # K/V of the step before any query reads, so their contents exist when read.
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self._num_hashed_blocks[request.request_id]
        stored = [i for i in range(start, num_full) if self.pool.cache_block(blocks[i], request.block_hashes[i])]
        self._num_hashed_blocks[request.request_id] = max(start, num_full)
        if stored and self.events is not None:
            self._record_stored(request, stored)

    def _record_stored(self, request: Request, indices: list[int]) -> None:
        """One BlockStored per run of consecutive blocks, as vLLM batches them."""
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            parent = hashes[run[0] - 1] if run[0] else None
            self.events.stored([hashes[i] for i in run], parent, list(tokens[run[0] * bs : (run[-1] + 1) * bs]), bs)

    def free(self, request: Request) -> None:
        blocks = self._req_blocks.pop(request.request_id, [])
        self._num_hashed_blocks.pop(request.request_id, None)
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
