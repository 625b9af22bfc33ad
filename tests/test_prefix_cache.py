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


def test_free_queue_ops_touch_a_fixed_number_of_links():
    """O(1), counted rather than timed: popleft, remove from the middle and append each
    read and write the same handful of links in a queue of 10 blocks as in one of 100,000
    (a list's remove would scan half of the long one)."""

    def links_touched(n: int) -> list[int]:
        q = FreeBlockQueue(range(n))
        touched = [0]

        class Counted(dict):
            def __getitem__(self, k):
                touched[0] += 1
                return super().__getitem__(k)

            def __setitem__(self, k, v):
                touched[0] += 1
                super().__setitem__(k, v)

            def __contains__(self, k):
                touched[0] += 1
                return super().__contains__(k)

            def pop(self, k, *default):
                touched[0] += 1
                return super().pop(k, *default)

            def __delitem__(self, k):
                touched[0] += 1
                super().__delitem__(k)

        q.next, q.prev = Counted(q.next), Counted(q.prev)
        counts = []
        for op in (lambda: q.remove(n // 2), lambda: q.append(n // 2), q.popleft):
            touched[0] = 0
            op()
            counts.append(touched[0])
        assert len(q) == n - 1 and next(iter(q)) == 1 and n // 2 in q
        return counts

    assert links_touched(100_000) == links_touched(10)
    assert max(links_touched(10)) <= 8


def test_free_queue_keeps_its_order_over_many_moves():
    q = FreeBlockQueue(range(100_000))
    for b in range(40_000, 60_000):
        q.remove(b)
    for b in range(40_000, 60_000):
        q.append(b)
    for _ in range(20_000):
        q.popleft()
    assert len(q) == 80_000 and next(iter(q)) == 20_000
    assert list(q)[-20_001:-19_999] == [99_999, 40_000]


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
    alloc.cache_block(a, ha)
    alloc.cache_block(b, hb)
    assert alloc.lookup(ha) == a and alloc.lookup(hb) == b
    assert alloc.lookup(BlockHash(42, (1, 2, 3, 4), ("other",))) is None
    assert alloc.lookup(BlockHash(42, (9, 9, 9, 9))) is None
    alloc.free(a)
    assert alloc.allocate() == 2 and alloc.allocate() == a  # a evicted, b still cached
    assert alloc.lookup(ha) is None and alloc.lookup(hb) == b


def test_a_hash_computed_twice_keeps_both_copies():
    """vLLM's design doc, "duplicated blocks" (its test_prefix_caching's
    test_cache_blocks / the duplicate-hash cases): a block recomputed under a hash
    already cached is cached too; lookups return the older; evicting one leaves the
    other, so the prefix is not lost."""
    alloc = PrefixCachingAllocator(3)
    t1 = _cache_table(alloc, list(range(4)))
    t2 = _cache_table(alloc, list(range(4)))  # computed twice in one step
    h = block_hashes(list(range(4)), 4)[0]
    b1, b2 = t1.blocks[0], t2.blocks[0]
    assert alloc.cached_blocks[h.value] == [b1, b2] and alloc.num_cached == 2
    assert alloc.lookup(h) == b1
    alloc.cache_block(b1, h)  # again: a no-op
    assert alloc.cached_blocks[h.value] == [b1, b2]
    with pytest.raises(ValueError, match="another hash"):
        alloc.cache_block(b1, block_hashes([9] * 4, 4)[0])
    t1.free()
    t2.free()
    assert alloc.num_free == 3 and alloc.lookup(h) == b1
    with pytest.raises(ValueError, match="free"):
        alloc.cache_block(b1, h)
    first = alloc.allocate()  # the block never cached goes first, then b1 (freed first)
    assert first not in (b1, b2)
    assert alloc.allocate() == b1 and alloc.lookup(h) == b2  # b1 evicted: b2 still serves


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


# ------------------------------------------------------------------ the engine

import math  # noqa: E402
import random  # noqa: E402

import torch  # noqa: E402

import paged_lib  # noqa: E402, F401  # isort: split
from paged_lib.engine import LLMEngine, SamplingParams  # noqa: E402
from paged_lib.engine.block_manager import BlockManager  # noqa: E402
from paged_lib.engine.hooks import EngineHooks  # noqa: E402
from paged_lib.engine.model_runner import build_metadata  # noqa: E402
from paged_lib.engine.scheduler import Scheduler  # noqa: E402

BS = 8
NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0)


@pytest.fixture(scope="module")
def hf(tiny_hf_llama):
    return tiny_hf_llama


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def shared_prompts():
    """Six prompts: a 40-token shared prefix (5 blocks of 8), then 5 tokens of their own."""
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 97, (40,), generator=g).tolist()
    return [prefix + torch.randint(0, 97, (5,), generator=g).tolist() for _ in range(6)]


@pytest.fixture(scope="module")
def reference(hf, shared_prompts, greedy_reference):
    """transformers' greedy continuations."""
    return greedy_reference(hf, shared_prompts, NEW)


def record_prefills(engine):
    """(request_id, query_len, cached tokens before) of every prefill the engine runs."""
    seen, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        seen.extend((s.group.request_id, s.num_new_tokens, s.seq.num_cached)
                    for s in out.scheduled if s.is_prefill)
        return out

    engine.scheduler.schedule = recording
    return seen


def assert_same_outputs(want, got):
    """The same tokens, and log-probabilities equal up to float rounding."""
    for w, g in zip(want, got, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [c.cumulative_logprob for c in g.outputs] == pytest.approx(
            [c.cumulative_logprob for c in w.outputs], abs=1e-4)


def one_after_another(n):
    return [i * (NEW + 1) for i in range(n)]


def assert_no_leak(engine):
    gpu = engine.block_manager.gpu
    assert gpu.num_free == gpu.num_blocks, "blocks leaked"
    assert all(gpu.refcount(b) == 0 for b in range(gpu.num_blocks))
    assert sorted(gpu.free_block_queue) == list(range(gpu.num_blocks))
    assert_hash_map_consistent(gpu)


def assert_hash_map_consistent(gpu):
    """Every hash-map entry names a block that holds that hash, once (no stale entry);
    a hash may name several blocks (vLLM's duplicated blocks), each listed once."""
    entries = [(v, b) for v, blocks in gpu.cached_blocks.items() for b in blocks]
    assert len(entries) == len(set(entries)), "a block listed twice under one hash"
    assert sorted(entries) == sorted((h.value, b) for b, h in gpu.block_hash.items())


def test_later_requests_read_the_shared_prefix_from_the_cache(model, shared_prompts,
                                                              reference):
    engine = LLMEngine(model, 64, BS, enable_prefix_caching=True)
    seen = record_prefills(engine)
    outs = engine.generate(shared_prompts, GREEDY, arrival_steps=[0] + [NEW + 1] * 5)
    assert [o.outputs[0].token_ids for o in outs] == reference
    plain = LLMEngine(model, 64, BS).generate(shared_prompts, GREEDY)
    assert_same_outputs(plain, outs)
    # request 0 computes its 45 tokens; each later one only the 5 past the 5 cached blocks
    assert seen == [(0, 45, 0)] + [(i, 5, 40) for i in range(1, 6)]
    assert engine.stats.prefix_cache_hit_tokens == 5 * 40
    assert_no_leak(engine)
    off = LLMEngine(model, 64, BS)
    off.generate(shared_prompts, GREEDY, arrival_steps=[0] + [NEW + 1] * 5)
    assert off.stats.prefix_cache_hit_tokens == 0


def test_a_12_block_pool_serves_six_prompts_one_after_another(model, shared_prompts,
                                                              reference):
    engine = LLMEngine(model, 12, BS, enable_prefix_caching=True, watermark=0)
    seen = record_prefills(engine)
    outs = engine.generate(shared_prompts, GREEDY, arrival_steps=one_after_another(6))
    assert all(o.error is None for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert [q for _, q, _ in seen] == [45] + [5] * 5  # >= 32 tokens from the cache each
    assert engine.stats.prefix_cache_hit_tokens == 5 * 40
    assert_no_leak(engine)


def test_a_hit_is_really_read_nan_in_the_cached_blocks_shows(model, shared_prompts,
                                                             reference):
    """Poison the cached blocks: a prefill that reads its hits turns NaN."""
    engine = LLMEngine(model, 64, BS, enable_prefix_caching=True)
    engine.generate(shared_prompts[:1], GREEDY)
    cached = list(engine.block_manager.gpu.block_hash)
    assert len(cached) == 6  # 45 + 5 tokens written: 6 full blocks, the first 5 shared
    for k, v in engine.runner.kv_caches:
        k[cached] = float("nan")
        v[cached] = float("nan")
    out = engine.generate(shared_prompts[1:2], GREEDY)[0].outputs[0]
    assert math.isnan(out.cumulative_logprob) or out.token_ids != reference[1]
    assert engine.stats.prefix_cache_hit_tokens == 40


def test_an_evicted_block_is_never_served(model, shared_prompts, reference):
    """A pool so small that the shared prefix is evicted by other text in between: the
    prompt that comes back must not hit a stale entry (NaN caches would not show it: the
    evicting text writes real numbers, so the tokens are compared)."""
    g = torch.Generator().manual_seed(9)
    other = torch.randint(0, 97, (50,), generator=g).tolist()
    engine = LLMEngine(model, 8, BS, enable_prefix_caching=True, watermark=0)
    seen = record_prefills(engine)
    outs = engine.generate([shared_prompts[0], other, shared_prompts[1]], GREEDY,
                           arrival_steps=one_after_another(3))
    assert outs[0].outputs[0].token_ids == reference[0]
    assert outs[2].outputs[0].token_ids == reference[1]
    # the 50-token text takes 7 of the 8 blocks: blocks of the prefix were evicted
    assert seen[2][2] < 40
    assert_no_leak(engine)


def test_the_same_prompt_twice_in_one_step_hits_the_first(model, shared_prompts, reference):
    """vLLM v1 registers a full block's hash when the block is allocated for tokens
    computed this step (its test_prefix_caching: two requests with a common prefix
    scheduled together): the second request, admitted later in the same step, reads the
    first one's blocks, and the prefix is held once."""
    engine = LLMEngine(model, 64, BS, enable_prefix_caching=True)
    outs = engine.generate([shared_prompts[0]] * 2, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [reference[0]] * 2
    full = (len(shared_prompts[0]) - 1) // BS
    assert engine.stats.prefix_cache_hit_tokens == full * BS
    assert engine.stats.step_kinds[0] == "prefill" and engine.stats.batch_sizes[0] == 2
    gpu = engine.block_manager.gpu
    from paged_lib.engine.prefix_cache import block_hashes
    prefix = block_hashes(shared_prompts[0], BS)[:full]
    assert all(len(gpu.cached_blocks[h.value]) == 1 for h in prefix), "the prefix held once"
    assert_no_leak(engine)


def test_a_cached_block_stays_while_another_request_reads_it(model, shared_prompts, reference,
                                                            hf, greedy_reference):
    """Requests 1 and 2 both read request 0's cached prefix; 1 finishes first and frees
    its references, 2 must keep reading the same blocks (nobody else may take them)."""
    long_ref = greedy_reference(hf, [shared_prompts[2]], 20)[0]
    engine = LLMEngine(model, 14, BS, enable_prefix_caching=True, watermark=0)
    filler = [[5] * 20]  # arrives after request 1 ends: takes blocks while 2 still runs
    outs = engine.generate([shared_prompts[0], shared_prompts[1], shared_prompts[2]] + filler,
                           [GREEDY, GREEDY, SamplingParams(max_tokens=20, temperature=0.0), GREEDY],
                           arrival_steps=[0, NEW + 1, NEW + 1, 2 * NEW + 3])
    assert outs[1].outputs[0].token_ids == reference[1]
    assert outs[2].outputs[0].token_ids == long_ref
    assert_no_leak(engine)


def test_the_hooks_are_called(model, shared_prompts, reference):
    from paged_lib.engine.prefix_cache import FreeBlockQueue, block_hashes, longest_cache_hit
    calls = {"hashes": 0, "hit": 0, "popleft": 0, "remove": 0}

    def my_hashes(tokens, block_size, extra_keys=()):
        calls["hashes"] += 1
        return block_hashes(tokens, block_size, extra_keys)

    def my_hit(hashes, lookup, num_tokens, block_size):
        calls["hit"] += 1
        return longest_cache_hit(hashes, lookup, num_tokens, block_size)

    class MyQueue(FreeBlockQueue):
        def popleft(self):
            calls["popleft"] += 1
            return super().popleft()

        def remove(self, block_id):
            calls["remove"] += 1
            super().remove(block_id)

    engine = LLMEngine(model, 64, BS, enable_prefix_caching=True,
                       hooks=EngineHooks(block_hashes=my_hashes, longest_cache_hit=my_hit,
                                         FreeBlockQueue=MyQueue))
    outs = engine.generate(shared_prompts[:3], GREEDY, arrival_steps=[0, NEW + 1, NEW + 1])
    assert [o.outputs[0].token_ids for o in outs] == reference[:3]
    assert calls["hit"] >= 3 and calls["hashes"] >= 3 and calls["popleft"] >= 7
    assert calls["remove"] == 5  # request 1's five hits were free; request 2 shares them

    def greedy_hit(hashes, lookup, num_tokens, block_size):  # ignores the last-token rule
        return [b for b in map(lookup, hashes) if b is not None]

    bad = LLMEngine(model, 64, BS, enable_prefix_caching=True,
                    hooks=EngineHooks(longest_cache_hit=greedy_hit))
    bad.generate([shared_prompts[0][:40]], GREEDY)
    with pytest.raises(ValueError, match="longest_cache_hit returned"):
        bad.generate([shared_prompts[0][:40]], GREEDY)


@pytest.mark.parametrize("mode, scheduling", [("recompute", "mixed"), ("swap", "mixed"),
                                              ("recompute", "prefill_first")])
def test_sharing_and_preemption_with_caching_give_the_same_tokens(model, shared_prompts,
                                                                  mode, scheduling):
    """n > 1 samples, beams and greedy requests over a shared prefix, in a pool small
    enough to preempt: the same tokens as the engine without caching, ample memory."""
    params = [SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=1),
              SamplingParams(max_tokens=8, beam_width=3),
              SamplingParams(max_tokens=12, temperature=0.0),
              SamplingParams(max_tokens=10, temperature=0.8, n=2, seed=2),
              SamplingParams(max_tokens=9, temperature=0.0),
              SamplingParams(max_tokens=6, beam_width=2)]
    arrivals = [0, 0, 2, 3, 9, 9]
    want = LLMEngine(model, 256, BS).generate(shared_prompts, params, arrival_steps=arrivals)
    engine = LLMEngine(model, 14, BS, preemption=mode, enable_prefix_caching=True,
                       num_cpu_blocks=64 if mode == "swap" else 0, watermark=0,
                       scheduling=scheduling)
    got = engine.generate(shared_prompts, params, arrival_steps=arrivals)
    assert engine.stats.preemptions > 0 and engine.stats.prefix_cache_hit_tokens > 0
    assert_same_outputs(want, got)
    assert_no_leak(engine)


# ------------------------------------------------------------------ without a model


class CheckingRunner:
    """Token ids in place of K/V (as tests/test_scheduler.py's fake runner), and after
    each step every cached block must hold the tokens its hash was made from."""

    def __init__(self, bm: BlockManager, num_cpu_blocks: int):
        from test_scheduler import FakeRunner
        self.bm = bm
        self.fake = FakeRunner(bm.gpu.num_blocks, bm.block_size, num_cpu_blocks)

    def execute(self, out) -> None:
        for s in out.scheduled:  # a prefill computes only what the cache does not hold
            assert s.seq.num_cached + s.num_new_tokens <= s.seq.num_tokens
        self.fake.execute(out)

    def check_cache(self) -> None:
        gpu = self.bm.gpu
        for block, h in gpu.block_hash.items():
            assert tuple(self.fake.gpu[block].tolist()) == h.token_ids, f"block {block}"
        assert_hash_map_consistent(gpu)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_workloads_with_caching_and_chunks_never_cross_write_or_leak(mode):
    from test_scheduler import fake_samples, make_groups
    rng = random.Random(11 if mode == "swap" else 12)
    hits = 0
    for trial in range(15):
        num_blocks = rng.randint(10, 24)
        specs = []
        for _ in range(rng.randint(2, 8)):
            n = rng.choice([1, 1, 2, 3])
            p, m = rng.randint(1, 14), rng.randint(1, 8)
            if n * (-(-(p + m) // 4)) <= num_blocks - 1:
                specs.append((p, m, n, "beam") if rng.random() < 0.3 else (p, m, n))
        if not specs:
            continue
        cpu = 64 if mode == "swap" else 0
        bm = BlockManager(num_blocks, 4, cpu, enable_prefix_caching=True)
        chunked = rng.random() < 0.6
        budget = rng.randint(8, 16)
        sched = Scheduler(bm, preemption=mode, max_num_seqs=rng.randint(2, 8),
                          max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
        runner = CheckingRunner(bm, cpu)
        groups = make_groups(specs)
        for g in groups:
            sched.add(g)
        step_rng, steps = random.Random(0), 0
        while sched.has_unfinished():
            assert steps < 5000, "no progress"
            out = sched.schedule()
            assert not out.is_empty()
            if chunked:
                decodes = sum(not s.is_prefill for s in out.scheduled)
                assert out.num_batched_tokens <= max(budget, decodes)
            hits += out.prefix_cache_hit_tokens
            runner.execute(out)
            sched.update(out, [fake_samples(s, step_rng) for s in out.scheduled], None)
            runner.check_cache()
            steps += 1
        for g, (_p, m, n, *beam) in zip(groups, specs, strict=True):
            done = g.beam_done if beam else [(s.output_token_ids, 0) for s in g.seqs]
            assert len(done) == n and all(len(t) == m for t, _ in done)
        assert bm.gpu.num_free == num_blocks, f"trial {trial}: leaked blocks"
        if bm.cpu is not None:
            assert bm.cpu.num_free == 64
    assert hits > 0


def test_build_metadata_sees_only_the_uncached_tokens(model, shared_prompts):
    """The prefill's query_len skips the hit (the kernel reads the rest from the cache)."""
    lens = []

    def recording(tables, seq_lens, query_lens, block_size):
        lens.append((list(seq_lens), list(query_lens)))
        return build_metadata(tables, seq_lens, query_lens, block_size)

    engine = LLMEngine(model, 64, BS, enable_prefix_caching=True,
                       hooks=EngineHooks(build_metadata=recording))
    engine.generate(shared_prompts[:2], SamplingParams(max_tokens=1, temperature=0.0),
                    arrival_steps=[0, 1])
    assert lens == [([45], [45]), ([45], [5])]


def test_a_request_preempted_by_recompute_hits_its_own_blocks():
    from test_scheduler import FakeRunner, fake_samples, make_groups
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    sched = Scheduler(bm)
    runner = FakeRunner(8, 4, 0)
    groups = make_groups([(6, 9), (6, 9), (6, 9)])
    for g in groups:
        sched.add(g)
    rng, readmitted = random.Random(0), []
    while sched.has_unfinished():
        out = sched.schedule()
        readmitted += [(s.seq.num_cached, s.num_new_tokens) for s in out.scheduled
                       if s.is_prefill and s.seq.output_token_ids]
        runner.execute(out)
        sched.update(out, [fake_samples(s, rng) for s in out.scheduled], None)
    assert readmitted and all(cached >= 4 for cached, _ in readmitted)
    assert sum(n for _, n in readmitted) < sum(c + n for c, n in readmitted)
    assert bm.gpu.num_free == 8


def test_a_wrong_block_hashes_hook_is_a_clear_error(model, shared_prompts):
    def one_short(tokens, block_size, extra_keys=()):
        return block_hashes(tokens, block_size)[:-1]

    engine = LLMEngine(model, 64, BS, enable_prefix_caching=True,
                       hooks=EngineHooks(block_hashes=one_short))
    with pytest.raises(ValueError, match="block_hashes gave"):
        engine.generate(shared_prompts[:1], GREEDY)


def test_admission_counts_a_hit_on_a_free_block_as_taking_it():
    """Pool of 5: R holds 2 blocks, A's 2 cached blocks are free, 1 more is free. B (16
    tokens) hits A's 2 blocks and needs 2 new: 4 free blocks, not 2, so it waits for R."""
    from test_scheduler import FakeRunner, fake_samples, make_groups
    bm = BlockManager(5, 4, enable_prefix_caching=True)
    sched = Scheduler(bm)
    runner = FakeRunner(5, 4, 0)
    r, a, b = make_groups([(5, 4), (8, 1), (16, 1)])
    r.seqs[0].prompt_token_ids = [50 + t for t in range(5)]  # shares no block with A, B
    sched.add(r)
    sched.add(a)
    rng, hit_at = random.Random(0), {}
    while sched.has_unfinished() or sched.step == 1:
        if sched.step == 1:
            assert a.is_finished() and bm.gpu.num_cached == 3 and bm.num_free_blocks == 3
            sched.add(b)
        out = sched.schedule()
        hit_at.update({s.group.request_id: (sched.step, s.seq.num_cached)
                       for s in out.scheduled if s.is_prefill})
        runner.execute(out)
        sched.update(out, [fake_samples(s, rng) for s in out.scheduled], None)
    assert r.timeline.finished_step == 3
    assert hit_at[2] == (4, 8)  # admitted once R's blocks are back, reading A's 8 tokens
    assert bm.gpu.num_free == 5
