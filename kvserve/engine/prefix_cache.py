"""Automatic prefix caching: a full KV block computed once is found again by the tokens before it.

A block's hash chains over its parent's hash, its token ids and any extra keys (the cache
salt) (`hash_block`, per request in `Request.block_hashes`): the same hash at table index i
means the same tokens up to block i. `PrefixCache` finds a request's longest run of cached
blocks (`lookup`) and makes its full blocks findable once computed (`cache_full_blocks`);
the hash → block index lives in engine/block_pool.py, whose free queue is also the LRU.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import TYPE_CHECKING

from kvserve.engine.block_pool import BlockPool, KVBlock

if TYPE_CHECKING:
    from kvserve.engine.request import Request


def hash_block(parent: bytes | None, token_ids, extra_keys: bytes = b"") -> bytes:
    """A block's identity: its parent's hash, its token ids and any extra keys (cache salt)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    h.update(extra_keys)
    return h.digest()


class PrefixCache:
    """One KV group's cache (engine/kv_groups.py; the only one without groups): its blocks are
    found by hash within the group. A sliding group's table has None where its blocks left the
    window: nothing to cache there."""

    def __init__(self, pool: BlockPool, block_size: int, events=None, group: int = 0):
        self.pool = pool
        self.block_size = block_size
        self.group = group
        self.events = events if group == 0 else None  # kv_events.KVEventLog (--enable-kv-cache-events), or None
        self._num_hashed_blocks: dict[str, int] = {}  # per request: its leading blocks already findable

    def lookup(self, request: Request) -> list[KVBlock]:
        """Longest run of cached full blocks matching the request's token prefix. The last
        token is never taken from the cache: its logits are needed to sample."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash, self.group)
            if block is None:
                break
            hits.append(block)
        return hits

    def admit(self, request: Request, num_hit_blocks: int) -> None:
        """A request's first allocation: its first `num_hit_blocks` blocks are cached hits."""
        self._num_hashed_blocks.setdefault(request.request_id, num_hit_blocks)

    def cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # Blocks whose every token is computed by the end of this step become findable. A
        # request scheduled later in the same step may hit them: each layer writes all new
        # K/V of the step before any query reads, so their contents exist when read.
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self._num_hashed_blocks[request.request_id]
        stored = [i for i in range(start, num_full)
                  if blocks[i] is not None and self.pool.cache_block(blocks[i], request.block_hashes[i], self.group)]  # fmt: skip
        self._num_hashed_blocks[request.request_id] = max(start, num_full)
        if stored and self.events is not None:
            self._record_stored(request, stored)

    def forget(self, request: Request) -> None:
        self._num_hashed_blocks.pop(request.request_id, None)

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
