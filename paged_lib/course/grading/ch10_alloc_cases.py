"""The states behind exercise 10.4's check (:mod:`paged_lib.course.grading.ch10_alloc`):
pools built by hand for the edges a serving run rarely reaches, and the prefix-caching
workloads whose engine calls are replayed."""

from __future__ import annotations

from paged_lib.engine.prefix_cache import (
    BlockHash,
    PrefixCachingAllocator,
    allocate_slots,
    block_hashes,
)


def _text(n: int, start: int) -> list[int]:
    return [start + i for i in range(n)]


def _prefilled(num_blocks: int, texts: list[tuple[list[int], tuple]], bs: int,
               free_after: list[int]) -> PrefixCachingAllocator:
    """A pool where each text was prefilled (library allocation) in turn; the requests
    ``free_after`` names (indices) are then freed, tail first, in that order."""
    pool = PrefixCachingAllocator(num_blocks)
    tables = []
    for tokens, extra in texts:
        hashes = block_hashes(tokens, bs, extra)
        tables.append(allocate_slots(pool, tokens, hashes, bs, len(tokens))[0])
    for i in free_after:
        for b in reversed(tables[i]):
            pool.free(b)
    return pool


def edge_states() -> list[tuple[str, PrefixCachingAllocator, list[tuple[list[int], tuple, int,
                                                                       int]]]]:
    """(what, the pool, the calls made one after another on it: tokens, extra keys,
    block size, max_new_tokens)."""
    a, b = _text(12, 100), _text(9, 300)
    # lora-1's and lora-2's block over the same tokens, then a block cached under a forged
    # hash with lora-2's value but lora-1's keys, listed first under that value
    collision = _prefilled(8, [(a[:4] + [1], ("lora-1",)), (a[:4] + [1], ("lora-2",))], 4,
                           [0, 1])
    real = block_hashes(a[:4], 4, ("lora-2",))[0]
    forged = BlockHash(real.value, real.token_ids, ("lora-1",))
    collision.free_block_queue.remove(5)
    collision.ref_counts[5] = 1
    collision.block_hash[5] = forged
    collision.cached_blocks[real.value].insert(0, 5)
    # a request's leading blocks at the head of the free queue: its last block was
    # reused by someone else, then another request freed its blocks behind them
    head_hits = _prefilled(7, [(a, ()), (_text(16, 800), ())], 4, [0])
    head_hits.allocate()
    for block in (6, 5, 4, 3):
        head_hits.free(block)
    # LRU evicts the block freed longest ago, so a prefix whose blocks were freed first
    # block first loses its first block before its later ones: A's blocks 0, 1, 2 freed in
    # that order, another request takes block 0 (evicting A's first hash), a third one
    # holding 3..6 finishes; blocks 1 and 2 stay cached and free, behind no hit
    orphans = _prefilled(7, [(a, ()), (_text(16, 800), ())], 4, [])
    for block in (0, 1, 2):
        orphans.free(block)
    orphans.allocate()
    for block in (6, 5, 4, 3):
        orphans.free(block)
    # the same prompt asked while its first copy runs: its last full block is computed
    # again (the last token is), so block 3 is cached beside block 2 under one hash; both
    # tables freed, tail first, the newer copy ends nearer the head of the free queue
    twins = PrefixCachingAllocator(6)
    hashes = block_hashes(a, 4, ())
    first = allocate_slots(twins, a, hashes, 4, 12)[0]
    again = allocate_slots(twins, a, hashes, 4, 12)[0]
    for table in (again, first):
        for block in reversed(table):
            twins.free(block)
    return [
        ("a hit on the two blocks at the head of the free queue", head_hits,
         [(a[:8] + [1, 2, 3], (), 4, 11)]),
        ("a full hit: all 3 blocks of a 12-token prompt cached and free", _prefilled(
            8, [(a, ())], 4, [0]), [(a, (), 4, 12)]),
        ("a hit on blocks still held by a running request", _prefilled(
            8, [(a, ())], 4, []), [(a[:8] + [7, 7, 7], (), 4, 11)]),
        ("a hit on a free cached block in the middle of the free queue", _prefilled(
            9, [(b, ()), (a, ()), (_text(5, 500), ())], 4, [0, 1, 2]),
         [(a[:8] + [1, 2, 3], (), 4, 11)]),
        ("cached blocks at the head of the free queue: taking fresh ones evicts them",
         _prefilled(7, [(a, ()), (b, ())], 4, [0, 1]), [(_text(10, 700), (), 4, 10)]),
        ("two requests in one step: the second hits the first's blocks", PrefixCachingAllocator(
            10), [(a + [1, 2], (), 4, 14), (a + [5], (), 4, 13)]),
        ("a chunk that ends mid-block (10 tokens of 17 this step, block size 4)",
         PrefixCachingAllocator(8), [(_text(17, 900), (), 4, 10)]),
        ("a chunk after a hit: 2 blocks cached, 3 tokens of budget", _prefilled(
            10, [(a, ())], 4, [0]), [(a[:8] + _text(9, 40), (), 4, 3)]),
        ("the same 4 tokens asked with extra keys ('lora-2',) then ('lora-1',); another "
         "block's hash has lora-2's value", collision,
         [(a[:4] + [2], ("lora-2",), 4, 5), (a[:4] + [3], ("lora-1",), 4, 5)]),
        ("the same text with other extra keys: no hit", _prefilled(8, [(a, ())], 4, [0]),
         [(a, ("lora-9",), 4, 12)]),
        ("block size 1, a 3-token prompt whose 3 tokens are cached", _prefilled(
            6, [(a[:3], ())], 1, [0]), [(a[:3], (), 1, 3)]),
        ("a hit then a budget of 1 token", _prefilled(8, [(b, ())], 4, [0]),
         [(b, (), 4, 1)]),
        ("two blocks cached under one hash (a prompt asked again while it ran: blocks 2 "
         "and 3), then fresh blocks evict the newer copy, block 3, not the oldest", twins,
         [(_text(10, 700), (), 4, 10), (a, (), 4, 12)]),
        ("LRU eviction took a prefix's first block before its later ones (freed first "
         "block first, not tail first): A's block 0 evicted, blocks 1 and 2 still cached "
         "and free", orphans, [(a + [1], (), 4, 5)]),
    ]


def workloads() -> list:
    """Replay's prefix-caching workloads and three more that evict, repeat and preempt."""
    from paged_lib.course.grading import replay
    from paged_lib.engine import SamplingParams as P

    own = [w for w in replay.workloads() if w.options.get("enable_prefix_caching")]
    shared = _text(10, 40)
    g = [P(max_tokens=5, ignore_eos=True, temperature=0.0)]
    return own + [
        replay.Workload("a prompt served again after evictions, 10 blocks of 4", dict(
            num_blocks=10, block_size=4, watermark=0, enable_prefix_caching=True),
            [shared + [1, 2], _text(19, 60), shared + [1, 2], shared + [9], _text(8, 90),
             shared + [1, 2, 3]], g * 6, [0, 0, 3, 3, 9, 14]),
        replay.Workload("a shared prefix admitted in one step, budget 9, 12 blocks of 4", dict(
            num_blocks=12, block_size=4, watermark=0, enable_prefix_caching=True,
            enable_chunked_prefill=True, max_num_batched_tokens=9, max_num_seqs=4),
            [shared + [k] * 3 for k in (1, 2, 3, 4)] + [shared], g * 5, [0, 0, 0, 2, 6]),
        replay.Workload("parallel samples preempted by recompute, 9 blocks of 4", dict(
            num_blocks=9, block_size=4, watermark=0, enable_prefix_caching=True),
            [shared + [5, 6], shared + [7]],
            [P(max_tokens=9, temperature=1.0, n=2, seed=4, ignore_eos=True),
             P(max_tokens=9, temperature=1.0, n=2, seed=5, ignore_eos=True)], [0, 1]),
    ]
