"""Prefix caching (chapter 10): block hashes, the LRU free queue, the caching allocator."""

import pytest

from paged_lib.blocks import BlockTable, OutOfBlocks
from paged_lib.engine.prefix_cache import (
    BlockHash,
    FreeBlockQueue,
    PrefixCachingAllocator,
    block_hashes,
    hash_block_tokens,
    longest_cache_hit,
)

# ------------------------------------------------------------------ hashes


def test_equal_prefixes_give_equal_hashes_and_the_chain_carries_differences():
    a = block_hashes(list(range(12)), 4)
    b = block_hashes(list(range(12)) + [99, 98], 4)
    assert a == b[:3] and len(b) == 3
    changed = block_hashes([7] + list(range(1, 12)), 4)  # only block 0 differs
    assert all(x.value != y.value for x, y in zip(a, changed, strict=True))
    assert a[1].token_ids == changed[1].token_ids  # same tokens, other parent
    assert a[2] == hash_block_tokens(a[1], [8, 9, 10, 11])


def test_hash_values_are_stable_64_bit_ints():
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h.value, int) and 0 <= h.value < 2**64
    # sha256 of repr((None, (1, 2, 3, 4), ())): the same in every process
    import hashlib
    want = int.from_bytes(hashlib.sha256(b"(None, (1, 2, 3, 4), ())").digest()[:8], "little")
    assert h.value == want
    assert hash_block_tokens(None, [1, 2, 3, 4], ("lora",)).value != h.value


def test_partial_blocks_are_never_hashed():
    assert block_hashes([1, 2, 3], 4) == []
    assert len(block_hashes(list(range(11)), 4)) == 2
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1], 0)


def test_longest_cache_hit_stops_at_first_miss_and_leaves_the_last_token():
    hashes = block_hashes(list(range(16)), 4)
    table = {hashes[0]: 5, hashes[1]: 7, hashes[3]: 9}
    assert longest_cache_hit(hashes, table.get, 16, 4) == [5, 7]
    every = {h: i for i, h in enumerate(hashes)}
    assert longest_cache_hit(hashes, every.get, 16, 4) == [0, 1, 2]  # (16-1)//4
    assert longest_cache_hit(hashes, every.get, 17, 4) == [0, 1, 2, 3]
    assert longest_cache_hit(hashes[:1], every.get, 4, 4) == []


# ------------------------------------------------------------------ free queue


def test_free_queue_order_and_middle_removal():
    q = FreeBlockQueue(range(5))
    assert list(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(2)
    assert list(q) == [0, 1, 3, 4] and 2 not in q and 3 in q
    assert q.popleft() == 0
    q.append(2)
    q.append(0)
    assert list(q) == [1, 3, 4, 2, 0] and len(q) == 5
    q.remove(0)  # the tail
    q.remove(1)  # the head
    assert list(q) == [3, 4, 2]
    assert [q.popleft() for _ in range(3)] == [3, 4, 2] and len(q) == 0 and list(q) == []


def test_free_queue_errors():
    q = FreeBlockQueue([1])
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(7)
    with pytest.raises(ValueError, match="already"):
        q.append(1)
    q.popleft()
    with pytest.raises(IndexError, match="empty"):
        q.popleft()
    with pytest.raises(ValueError):
        q.remove(q.HEAD)


def test_free_queue_ops_are_constant_time():
    """O(1): removing from the middle of a long queue touches only the neighbours."""
    q = FreeBlockQueue(range(100_000))
    import time
    t = time.perf_counter()
    for b in range(40_000, 60_000):
        q.remove(b)
    for b in range(40_000, 60_000):
        q.append(b)
    for _ in range(20_000):
        q.popleft()
    assert time.perf_counter() - t < 1.0  # a list.remove would take minutes
    assert len(q) == 80_000 and next(iter(q)) == 20_000


# ------------------------------------------------------------------ allocator


def _cache_table(alloc, tokens, block_size=4):
    """A table for ``tokens``, its full blocks cached (as after a prefill)."""
    table = BlockTable(alloc, block_size)
    for _ in tokens:
        table.append_token()
    for block, h in zip(table.blocks, block_hashes(tokens, block_size), strict=False):
        alloc.cache_block(block, h)
    return table


def test_freed_blocks_keep_their_hash_and_count_as_free():
    alloc = PrefixCachingAllocator(4)
    table = _cache_table(alloc, list(range(9)))  # blocks 0, 1 full, 2 partial
    assert alloc.num_free == 1 and alloc.num_cached == 2
    table.free()
    assert alloc.num_free == 4 and alloc.num_cached == 2
    assert list(alloc.free_block_queue) == [3, 2, 1, 0]  # tail first: block 0 last
    h = block_hashes(list(range(9)), 4)
    assert alloc.lookup(h[0]) == 0 and alloc.lookup(h[1]) == 1
    alloc.touch(0)  # a hit on a free block takes it out of the queue
    assert alloc.refcount(0) == 1 and 0 not in alloc.free_block_queue and alloc.num_free == 3
    alloc.touch(0)  # a second reader
    assert alloc.refcount(0) == 2


def test_eviction_drops_the_hash_no_stale_entry():
    alloc = PrefixCachingAllocator(2)
    tokens = list(range(8))
    _cache_table(alloc, tokens).free()  # queue: 1, 0 (both cached)
    h = block_hashes(tokens, 4)
    assert alloc.allocate() == 1  # evicts block 1
    assert alloc.lookup(h[1]) is None and alloc.lookup(h[0]) == 0
    assert 1 not in alloc.block_hash and h[1].value not in alloc.cached_blocks
    assert alloc.allocate() == 0
    assert alloc.lookup(h[0]) is None and alloc.num_cached == 0 and alloc.cached_blocks == {}
    with pytest.raises(OutOfBlocks):
        alloc.allocate()


def test_colliding_values_never_serve_the_wrong_block():
    alloc = PrefixCachingAllocator(3)
    a, b = alloc.allocate(), alloc.allocate()
    ha = BlockHash(42, (1, 2, 3, 4))
    hb = BlockHash(42, (5, 6, 7, 8))  # same value, other tokens
    assert alloc.cache_block(a, ha) and alloc.cache_block(b, hb)
    assert alloc.lookup(ha) == a and alloc.lookup(hb) == b
    assert alloc.lookup(BlockHash(42, (1, 2, 3, 4), ("other",))) is None
    assert alloc.lookup(BlockHash(42, (9, 9, 9, 9))) is None
    alloc.free(a)
    assert alloc.allocate() == 2 and alloc.allocate() == a  # a evicted, b still cached
    assert alloc.lookup(ha) is None and alloc.lookup(hb) == b


def test_the_same_hash_is_cached_once():
    alloc = PrefixCachingAllocator(3)
    t1 = _cache_table(alloc, list(range(4)))
    t2 = _cache_table(alloc, list(range(4)))  # computed twice in one step
    h = block_hashes(list(range(4)), 4)[0]
    assert alloc.cached_blocks[h.value] == t1.blocks and alloc.num_cached == 1
    assert alloc.cache_block(t2.blocks[0], h) is False
    assert alloc.cache_block(t1.blocks[0], h) is True  # again: a no-op
    b1, b2 = t1.blocks[0], t2.blocks[0]
    with pytest.raises(ValueError, match="another hash"):
        alloc.cache_block(b1, block_hashes([9] * 4, 4)[0])
    t1.free()
    assert alloc.lookup(h) == b1 and alloc.num_free == 2
    with pytest.raises(ValueError, match="free"):
        alloc.cache_block(b1, h)
    t2.free()  # the copy never cached goes back plain
    assert alloc.lookup(h) == b1 and b2 not in alloc.block_hash


def test_touch_needs_a_cached_block():
    alloc = PrefixCachingAllocator(2)
    b = alloc.allocate()
    with pytest.raises(ValueError, match="not cached"):
        alloc.touch(b)
    with pytest.raises(ValueError, match="unknown block"):
        alloc.touch(5)


def test_free_table_frees_tail_first():
    alloc = PrefixCachingAllocator(6)
    t = _cache_table(alloc, list(range(16)))
    alloc.free_table(t)
    assert list(alloc.free_block_queue) == [4, 5, 3, 2, 1, 0]


def test_vllm_design_doc_example():
    """The worked example of vLLM's "Automatic Prefix Caching" design page: block size
    4, 10 blocks, three requests (step by step, the same blocks)."""
    bs = 4
    alloc = PrefixCachingAllocator(10)

    def admit(tokens):
        hits = longest_cache_hit(block_hashes(tokens, bs), alloc.lookup, len(tokens), bs)
        for b in hits:
            alloc.touch(b)
        table = BlockTable(alloc, bs, hits, len(hits) * bs)
        for _ in range(len(tokens) - len(hits) * bs):
            table.append_token()
        return hits, table

    def cache_full(table, tokens):
        for block, h in zip(table.blocks, block_hashes(tokens, bs), strict=False):
            alloc.cache_block(block, h)

    # Request 0: 15 prompt tokens -> 4 blocks, 3 full and cached, the 4th 3/4 full
    r0 = list(range(100, 115))
    hits, t0 = admit(r0)
    cache_full(t0, r0)
    assert hits == [] and t0.blocks == [0, 1, 2, 3] and alloc.num_cached == 3
    # it decodes: block 3 fills (cached), block 4 is taken for the next token
    r0 += [115]
    t0.append_token()
    cache_full(t0, r0)
    r0 += [116]
    t0.append_token()
    assert t0.blocks == [0, 1, 2, 3, 4] and alloc.num_cached == 4
    # Request 1: 14 prompt tokens, the first 10 equal to request 0's: 2 blocks hit
    r1 = r0[:10] + [900, 901, 902, 903]
    hits, t1 = admit(r1)
    cache_full(t1, r1)
    assert hits == [0, 1] and t1.blocks == [0, 1, 5, 6]
    assert alloc.refcount(0) == 2 and alloc.refcount(1) == 2
    # Request 0 finishes: blocks 4, 3, 2 join the free queue in reverse (2, 3 cached)
    t0.free()
    assert list(alloc.free_block_queue) == [7, 8, 9, 4, 3, 2]
    assert alloc.lookup(block_hashes(r0, bs)[2]) == 2
    # Request 1 finishes
    t1.free()
    assert list(alloc.free_block_queue) == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    # Request 2: 29 prompt tokens, the first 12 equal to request 0's: 3 blocks hit,
    # touched out of the queue first, then 5 blocks from the head; block 3 is evicted
    r2 = r0[:12] + list(range(500, 517))
    hits, t2 = admit(r2)
    assert hits == [0, 1, 2]
    assert t2.blocks == [0, 1, 2, 7, 8, 9, 4, 3]
    assert alloc.lookup(block_hashes(r0, bs)[3]) is None  # block 3's hash is gone
    assert list(alloc.free_block_queue) == [6, 5]
