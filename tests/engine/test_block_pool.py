"""The block pool's rules, checked directly: LRU reuse and eviction, tail-first freeing,
reference counts of shared prefix blocks, the hash chain, and reset_prefix_cache.

Each test checks one behaviour of kvserve/engine/block_pool.py, prefix_cache.py or
kv_cache.py and fails if that behaviour breaks. No model: requests are token-id lists.
"""

from __future__ import annotations

from kvserve.engine.block_pool import BlockPool
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.prefix_cache import hash_block
from tests.support.requests import make_request

BS = 4


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def _prefilled(kv: KVCacheManager, request_id: str, tokens: list[int], **kw):
    """A request whose whole prompt was allocated (and so, if full, cached) in one step."""
    req = make_request(request_id, tokens, BS, **kw)
    hits, num_cached = kv.get_computed_blocks(req)
    req.num_computed_tokens = 0
    assert kv.allocate_slots(req, req.num_tokens - num_cached, hits)
    req.num_computed_tokens = req.num_tokens
    return req


# ---- BlockPool: LRU -----------------------------------------------------------------------


def test_freed_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(4)
    b = pool.get_new_blocks(4)
    for i in (2, 0, 3, 1):
        pool.free_blocks([b[i]])
    assert _ids(pool.get_new_blocks(3)) == [2, 0, 3]
    assert _ids(pool.get_new_blocks(1)) == [1]


def test_a_cached_free_block_is_evicted_only_at_the_head_and_loses_its_hash_then():
    pool = BlockPool(3)
    b0, b1, b2 = pool.get_new_blocks(3)
    h0, h1 = b"h0" * 8, b"h1" * 8
    pool.cache_block(b0, h0)
    pool.cache_block(b1, h1)
    pool.free_blocks([b0, b1, b2])  # queue: b0, b1, b2
    # free but still findable: freeing does not evict
    assert pool.get_cached_block(h0) is b0 and pool.get_cached_block(h1) is b1
    assert pool.num_evictions == 0 and pool.num_cached_blocks == 2
    (got,) = pool.get_new_blocks(1)
    assert got is b0 and got.ref_cnt == 1
    assert got.block_hash is None and pool.get_cached_block(h0) is None  # evicted now, not before
    assert pool.get_cached_block(h1) is b1  # not yet at the head
    assert pool.num_evictions == 1 and pool.num_cached_blocks == 1


def test_handing_out_an_uncached_block_is_not_an_eviction():
    pool = BlockPool(2)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b1, b"x" * 16)
    pool.free_blocks([b0, b1])
    assert pool.get_new_blocks(1) == [b0]
    assert pool.num_evictions == 0 and pool.get_cached_block(b"x" * 16) is b1


def test_touching_a_free_cached_block_takes_it_off_the_free_queue():
    pool = BlockPool(3)
    b0, b1, b2 = pool.get_new_blocks(3)
    pool.cache_block(b0, b"p" * 16)
    pool.free_blocks([b0, b1, b2])
    pool.touch([b0])
    assert b0.ref_cnt == 1 and pool.num_free_blocks == 2
    assert _ids(pool.get_new_blocks(2)) == [1, 2]  # b0, at the head, was skipped: it is in use
    assert pool.get_cached_block(b"p" * 16) is b0


def test_a_second_copy_of_a_cached_block_stays_private():
    """Two requests computed the same block: the first copy is the cached one; the second
    is not indexed and loses nothing when reused."""
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, b"same" * 4)
    pool.cache_block(second, b"same" * 4)
    assert pool.get_cached_block(b"same" * 4) is first and second.block_hash is None


# ---- KVCacheManager: freeing order and reference counts -----------------------------------


def test_a_request_is_freed_tail_first_so_its_prefix_is_evicted_last():
    kv = KVCacheManager(3, BS, enable_prefix_caching=True)
    req = _prefilled(kv, "a", list(range(12)))  # three full blocks, all cached
    blocks = kv.block_ids("a")
    kv.free(req)
    other = make_request("o", list(range(100, 104)), BS)
    assert kv.allocate_slots(other, 4)
    assert kv.block_ids("o") == [blocks[2]]  # the tail block goes first
    # a's first two blocks are still cached: a's prompt again hits both
    hits, num_cached = kv.get_computed_blocks(make_request("a2", list(range(12)), BS))
    assert _ids(hits) == blocks[:2] and num_cached == 8
    other2 = make_request("o2", list(range(200, 204)), BS)
    assert kv.allocate_slots(other2, 4)
    assert kv.block_ids("o2") == [blocks[1]]  # then the middle; the first block is last


def test_a_shared_prefix_is_counted_not_copied():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    prefix = list(range(8))
    a = _prefilled(kv, "a", prefix + [50, 51])
    b = _prefilled(kv, "b", prefix + [60, 61, 62])
    shared = kv.block_ids("a")[:2]
    assert kv.block_ids("b")[:2] == shared
    pool = kv.pool
    assert [pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    assert kv.num_free_blocks() == 8 - 4  # 2 shared + one tail each
    kv.free(a)
    assert [pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    assert kv.num_free_blocks() == 8 - 3  # only a's private tail came back
    assert all(i not in pool._free for i in shared)
    kv.free(b)
    assert [pool.blocks[i].ref_cnt for i in shared] == [0, 0]
    assert kv.num_free_blocks() == 8 and all(i in pool._free for i in shared)
    assert pool.get_cached_block(pool.blocks[shared[0]].block_hash) is pool.blocks[shared[0]]


def test_free_cached_hits_are_not_counted_as_room_for_new_blocks():
    """Hits waiting in the free queue stop being free once taken, so they cannot also be
    handed out as the request's new blocks; a refusal changes nothing."""
    kv = KVCacheManager(3, BS, enable_prefix_caching=True)
    kv.free(_prefilled(kv, "a", list(range(8))))  # blocks 0, 1 cached and free; 3 free in all
    # 8 + 5 tokens: two hits + two new blocks, but only one block is free besides the hits
    b = make_request("b", list(range(8)) + [70, 71, 72, 73, 74], BS)
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8
    assert not kv.allocate_slots(b, b.num_tokens - num_cached, hits)
    assert kv.num_free_blocks() == 3 and kv.pool.num_cached_blocks == 2 and kv.block_ids("b") == []
    assert all(h.ref_cnt == 0 for h in hits)
    # 8 + 4 tokens fit: two hits + one new
    c = make_request("c", list(range(8)) + [80, 81, 82, 83], BS)
    hits, num_cached = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, c.num_tokens - num_cached, hits)
    assert kv.num_free_blocks() == 0 and kv.block_ids("c")[:2] == _ids(hits)


# ---- the hash chain -----------------------------------------------------------------------


def test_a_block_hash_depends_on_its_parent():
    tokens = [5, 6, 7, 8]
    root = hash_block(None, [1, 2, 3, 4])
    other = hash_block(None, [1, 2, 3, 9])
    assert hash_block(root, tokens) != hash_block(other, tokens)
    assert hash_block(root, tokens) == hash_block(hash_block(None, [1, 2, 3, 4]), tokens)


def test_identical_tokens_after_a_different_prefix_do_not_hit():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    _prefilled(kv, "a", [1, 2, 3, 4] + [5, 6, 7, 8] + [0])
    b = make_request("b", [1, 2, 3, 9] + [5, 6, 7, 8] + [0], BS)
    assert b.block_hashes[1] != kv.pool.blocks[kv.block_ids("a")[1]].block_hash
    assert kv.get_computed_blocks(b) == ([], 0)
    c = make_request("c", [1, 2, 3, 4] + [5, 6, 7, 8] + [0], BS)  # the same chain does hit
    assert kv.get_computed_blocks(c)[1] == 8


def test_cache_salt_changes_the_first_block_and_so_the_chain():
    plain = make_request("p", list(range(9)), BS)
    salted = make_request("s", list(range(9)), BS, cache_salt="tenant-1")
    other = make_request("t", list(range(9)), BS, cache_salt="tenant-2")
    assert plain.block_hashes[0] != salted.block_hashes[0] != other.block_hashes[0]
    assert plain.block_hashes[1] != salted.block_hashes[1]  # the salt reaches later blocks via the parent
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    _prefilled(kv, "p", list(range(9)))
    assert kv.get_computed_blocks(salted) == ([], 0)
    _prefilled(kv, "s", list(range(9)), cache_salt="tenant-1")
    assert kv.get_computed_blocks(make_request("s2", list(range(9)), BS, cache_salt="tenant-1"))[1] == 8
    assert kv.get_computed_blocks(other) == ([], 0)


# ---- reset_prefix_cache -------------------------------------------------------------------


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    kv = KVCacheManager(6, BS, enable_prefix_caching=True)
    a = _prefilled(kv, "a", list(range(9)))
    kv.free(_prefilled(kv, "b", list(range(100, 109))))
    assert kv.pool.reset_prefix_cache() is False
    assert kv.pool.num_cached_blocks == 4  # nothing forgotten
    assert kv.get_computed_blocks(make_request("b2", list(range(100, 109)), BS))[1] == 8
    kv.free(a)
    assert kv.pool.reset_prefix_cache() is True
    assert kv.pool.num_cached_blocks == 0
    assert all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.get_computed_blocks(make_request("a2", list(range(9)), BS)) == ([], 0)
    assert kv.num_free_blocks() == 6
