"""The physical KV blocks: reference counts, the free queue, and the prefix-cache index.

One owner for block state, as in vLLM v1: the free queue doubles as the LRU of cached
blocks. A freed block keeps its hash and stays findable until it reaches the head of the
queue and is handed out again (evicted). Blocks shared by several requests are stored once
and counted by `ref_cnt`.
"""

from __future__ import annotations

from collections import OrderedDict


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "group")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.group = 0  # the KV group (engine/kv_groups.py) whose cached block it is

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """`reserved`: the first blocks are never handed out (a grouped pool's null block,
    engine/kv_groups.py). A cached block is found by its hash within its KV group (each group's
    blocks hold other layers' KV for the same tokens); KV events report group 0's only, the
    prefix as a router sees it."""

    def __init__(self, num_blocks: int, events=None, reserved: int = 0):
        self.num_blocks = num_blocks - reserved  # the blocks requests can hold
        self.events = events  # kv_events.KVEventLog, or None
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # head = least recently freed = next to evict
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[reserved:])
        self._cached: dict[tuple[int, bytes], KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks referenced by live requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: bytes, group: int = 0) -> KVBlock | None:
        return self._cached.get((group, block_hash))

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with {len(self._free)} free")  # caller checks first
        out = []
        evicted: list[bytes] = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[(block.group, block.block_hash)]
                if block.group == 0:
                    evicted.append(block.block_hash)
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.events is not None:
            self.events.removed(evicted)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-cache hits; a free one leaves the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: list[KVBlock]) -> None:
        for block in blocks_in_eviction_order:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: bytes, group: int = 0) -> bool:
        """Make the block findable by its hash (in its group); False if it already was, or
        another copy is."""
        if block.block_hash is not None:
            return False
        if (group, block_hash) in self._cached:
            return False  # another request computed the same block first; this copy stays private
        block.block_hash = block_hash
        block.group = group
        self._cached[(group, block_hash)] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (as vLLM's `reset_prefix_cache`); only possible when no
        block is in use. Benchmarks call it between rounds of the same prompts."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True
