"""Exercise 10.4: a new request's table in the caching pool (``allocate_slots``), next to
:func:`paged_lib.engine.prefix_cache.allocate_slots`, call by call: first on edge states no
serving run reaches (:func:`edge_states`), then on random workloads served side by side,
the first that differs shrunk and served again with every call asked of both. The first
call that differs is told as a story (the pool before, the call, both answers and pools
after) with a hint naming the rule (:func:`diagnose`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paged_lib.course import grading
from paged_lib.course.grading import generated
from paged_lib.engine.hooks import EngineHooks
from paged_lib.engine.prefix_cache import (
    BlockHash,
    FreeBlockQueue,
    PrefixCachingAllocator,
    allocate_slots,
    block_hashes,
)

__all__ = ["check_allocate_slots"]


@dataclass(frozen=True)
class State:
    """A caching pool, comparable: the free queue (head first), every block's reference
    count, each cached block's hash, and the blocks under each hash value."""

    free: tuple[int, ...]
    refs: tuple[int, ...]
    hashes: tuple[tuple[int, BlockHash], ...]
    by_value: tuple[tuple[int, tuple[int, ...]], ...]


def snapshot(pool: PrefixCachingAllocator) -> State:
    return State(tuple(pool.free_block_queue), tuple(pool.ref_counts),
                 tuple(sorted(pool.block_hash.items())),
                 tuple(sorted((v, tuple(bs)) for v, bs in pool.cached_blocks.items())))


def build(state: State) -> PrefixCachingAllocator:
    """A fresh pool holding ``state`` (the library's own class and free queue)."""
    pool = PrefixCachingAllocator(len(state.refs))
    pool.free_block_queue = pool.free_block_ids = FreeBlockQueue(state.free)
    pool.ref_counts = list(state.refs)
    pool.block_hash = dict(state.hashes)
    pool.cached_blocks = {v: list(bs) for v, bs in state.by_value}
    return pool


@dataclass(frozen=True)
class Ask:
    """One call: the pool before, and the arguments after the pool."""

    where: str
    before: State
    token_ids: tuple[int, ...]
    hashes: tuple[BlockHash, ...]
    block_size: int
    max_new_tokens: int

    def answer(self, fn: Callable) -> tuple[Any, State]:
        pool = build(self.before)
        got = fn(pool, list(self.token_ids), list(self.hashes), self.block_size,
                 self.max_new_tokens)
        if isinstance(got, tuple | list) and len(got) == 2 and isinstance(got[0], list | tuple):
            got = (list(got[0]), got[1])
        return got, snapshot(pool)


def _parts(s: State) -> dict[str, str]:
    """The pool's state in words: its free queue, the blocks held, the blocks cached."""
    def cached(h: BlockHash) -> str:
        return f"tokens {h.token_ids[0]}..{h.token_ids[-1]}" + (
            f" {h.extra_keys}" if h.extra_keys else "")
    empty = sum(not bs for _, bs in s.by_value)
    return {"free queue (head first)": str(list(s.free)),
            "held (block: ref count)": str({b: r for b, r in enumerate(s.refs) if r}
                                           or "none"),
            "cached": "{" + ", ".join(f"{b}: {cached(h)}" for b, h in s.hashes) + "}",
            "cached_blocks (blocks per hash value)": str(
                [list(bs) for _, bs in s.by_value if len(bs) > 1] or "one each")
            + (f", {empty} hash value(s) kept with an empty list" if empty else "")}


def diagnose(ask: Ask, want: Any, want_state: State, got: Any, got_state: State) -> str:
    """The rule the learner's answer breaks, named from what differs."""
    if not (isinstance(got, tuple) and len(got) == 2):
        return "return a pair: (the table's blocks, the number of tokens the cache supplied)"
    (blocks, computed), (wb, wc), bs = got, want, ask.block_size
    cached_at = dict(ask.before.hashes)
    leading = next((k for k, h in enumerate(ask.hashes) if h not in cached_at.values()),
                   len(ask.hashes))
    counted = isinstance(computed, int)
    if computed != wc or blocks[:wc // bs] != wb[:wc // bs]:
        adopted = blocks[:computed // bs] if counted else []
        last = (len(ask.token_ids) - 1) // bs
        for wrong, hint in [
            (counted and computed > wc and computed == leading * bs, "a full hit: every "
             "block is cached, yet the last token must be computed (its logits give the next "
             "token): at most (len(token_ids) - 1) // block_size blocks are adopted"),
            (any(cached_at.get(b) not in (None, h) and cached_at[b].value == h.value
                 for b, h in zip(adopted, ask.hashes, strict=False)), "a block whose hash "
             "has the same value is not a hit: compare the whole BlockHash, as pool.lookup "
             "does"),
            (counted and computed != len(adopted) * bs,
             "num_computed_tokens is the hit blocks times block_size"),
            (counted and computed < wc and adopted == wb[:computed // bs], f"your hit stops "
             f"after {computed // bs if counted else 0} block(s), the library's after "
             f"{wc // bs}: every leading cached block is a hit as long as the text's last "
             f"token is still computed, and here it is in block {last}"),
            (adopted != wb[:len(adopted)] and all(b in cached_at and cached_at[b] ==
                                                  cached_at.get(w) for b, w in
                                                  zip(adopted, wb, strict=False)),
             "where two blocks are cached under one hash, the hit is the oldest "
             "(pool.lookup's: the first in cached_blocks[value])"),
            (any(cached_at.get(b) in ask.hashes[leading + 1:] for b in adopted),
             "a hit must be a leading run: after a miss, later hashes cannot be used")]:
            if wrong:
                return hint
        return ("the hit is the cached blocks of the longest run of leading hashes, in "
                "order, stopping at the first miss; num_computed_tokens their tokens")
    now = min(len(ask.token_ids) - wc, ask.max_new_tokens)
    if len(blocks) != len(wb):
        return (f"after its hit of {wc} tokens this request computes {now} now (its budget "
                f"counts only the tokens it computes): the table covers tokens 0.."
                f"{wc + now - 1}, {len(wb)} blocks; the rest of a chunked prompt takes its "
                "blocks in later steps")
    fresh, wfresh, hits = blocks[wc // bs:], wb[wc // bs:], set(wb[:wc // bs])
    if fresh != wfresh:
        if hits & set(fresh):
            return ("a hit on a block with ref count 0 must leave the free queue before any "
                    "fresh block is taken, or the head you pop may be the block you hit")
        if fresh == [b for b in ask.before.free[::-1] if b not in hits][:len(fresh)]:
            return "fresh blocks come from the head of the free queue (freed longest ago)"
        k = next(i for i, (g, w) in enumerate(zip(fresh, wfresh, strict=False)) if g != w)
        return (f"fresh block {k + 1} is {fresh[k]} in yours, {wfresh[k]} in the library's, "
                "which comes first in the free queue: fresh blocks are reused in the queue's "
                "order, cached or not")
    if got_state.refs != want_state.refs:
        b = next(i for i, (g, w) in enumerate(zip(got_state.refs, want_state.refs,
                                                  strict=True)) if g != w)
        return (f"block {b}'s reference count is {got_state.refs[b]}, the library's "
                f"{want_state.refs[b]}: a hit takes one more reference, a fresh block "
                "starts at 1")
    if got_state.free != want_state.free:
        left = sorted(set(got_state.free) & set(wb))
        return (f"block {left[0]} is in your table and still in the free queue: a hit on a "
                "block with ref count 0 takes it out of the queue" if left else
                "only the blocks of the table leave the free queue; the others keep their "
                "order")
    got_h, want_h = dict(got_state.hashes), dict(want_state.hashes)
    stale = [b for b in wfresh if b in cached_at and got_h.get(b) == cached_at[b]
             != want_h.get(b)]
    if stale:
        return (f"block {stale[0]} was cached and is reused: it loses its old hash "
                "(eviction), in block_hash and in cached_blocks")
    full = (wc + now) // bs
    dup = [b for b in wb[:full] if b not in got_h and want_h[b] in cached_at.values()]
    got_v, want_v = dict(got_state.by_value), dict(want_state.by_value)
    evicted = [b for b in wfresh if b in cached_at and b in got_v.get(cached_at[b].value, ())]
    value = cached_at[evicted[0]].value if evicted else None
    unlisted = [b for b, h in got_state.hashes if b not in got_v.get(h.value, ())
                and b in want_v.get(h.value, ())]
    for wrong, hint in [
        (dup, lambda: f"block {dup[0]} is full after this step and is cached now, even though "
         "it holds the same K/V as block "
         f"{next(c for c, h in ask.before.hashes if h == want_h[dup[0]])}, cached before: "
         "both stay cached (vLLM's duplicated blocks)"),
        (any(b not in got_h for b in wb[:full]), lambda: "register the full blocks this step "
         "fills when it is scheduled, so a request admitted later in the same step hits them"),
        (any(b in got_h and b not in want_h for b in wb[full:]), lambda: "the chunk ends "
         "mid-block: a part-filled block gets no hash (its K/V will still change)"),
        (any(not v for _, v in got_state.by_value), lambda: "a hash with no block left must "
         "be deleted from cached_blocks, not kept as an empty list"),
        (evicted, lambda: f"block {evicted[0]} was evicted but cached_blocks still lists it "
         "under its old value, and block(s) "
         f"{sorted(set(want_v.get(value, ())) - set(got_v[value]))} "
         "left the list instead: take out the very block evicted, not the list's first"),
        (unlisted, lambda: f"block {unlisted[0]} is still cached (block_hash), but "
         "cached_blocks no longer lists it under its value, which lists every block cached "
         "under it, oldest first: an eviction takes out only the block reused"),
        (got_state.by_value != want_state.by_value, lambda: "cached_blocks[value] lists every "
         "block cached under that value, oldest first: a block recomputed with the same hash "
         "is added after the others, a hit is not added again")]:
        if wrong:
            return hint()
    return "the pool after the call differs from the library's"


def compare(fn: Callable, ask: Ask) -> None:
    """Ask ``fn`` and the library; fail with the story at the first difference."""
    (want, want_state), (got, got_state) = ask.answer(allocate_slots), ask.answer(fn)
    if got == want and got_state == want_state:
        return
    mine, lib, before = _parts(got_state), _parts(want_state), _parts(ask.before)
    after = "; ".join(f"{k}: the library's {lib[k]}, yours {mine[k]}" for k in lib
                      if mine[k] != lib[k])
    found = [b for h in ask.hashes for b, c in ask.before.hashes if c == h]
    grading.fail(f"{ask.where}: the pool holds " + ", ".join(f"{k} {v}" for k, v in
                                                             before.items())
                 + f"; asked allocate_slots(pool, {len(ask.token_ids)} token ids, "
                 f"{len(ask.hashes)} hashes (cached: {found or 'none'}), block_size="
                 f"{ask.block_size}, max_new_tokens={ask.max_new_tokens}), "
                 + (f"the library answers {want!r}, yours {got!r}" if got != want
                    else f"both answer {want!r}") + (f"; after it, {after}" if after else ""),
                 diagnose(ask, want, want_state, got, got_state))


def _prefilled(num_blocks: int, texts: list[tuple[list[int], tuple]], bs: int = 4
               ) -> tuple[PrefixCachingAllocator, list[list[int]]]:
    """A pool where each text was prefilled (library allocation) in turn, and the tables."""
    pool = PrefixCachingAllocator(num_blocks)
    return pool, [allocate_slots(pool, t, block_hashes(t, bs, extra), bs, len(t))[0]
                  for t, extra in texts]


def edge_states() -> list[tuple[str, PrefixCachingAllocator, list[tuple]]]:
    """(what, the pool, the calls made one after another on it: tokens, extra keys,
    block size, max_new_tokens)."""
    a = list(range(100, 112))
    # lora-1's and lora-2's block over the same tokens, both freed, then a block cached
    # under a forged hash (lora-2's value, lora-1's keys), listed first under that value
    collision, tables = _prefilled(8, [(a[:4] + [1], ("lora-1",)), (a[:4] + [1], ("lora-2",))])
    for b in tables[0][::-1] + tables[1][::-1]:
        collision.free(b)
    real = block_hashes(a[:4], 4, ("lora-2",))[0]
    collision.free_block_queue.remove(5)
    collision.ref_counts[5] = 1
    collision.block_hash[5] = BlockHash(real.value, real.token_ids, ("lora-1",))
    collision.cached_blocks[real.value].insert(0, 5)
    # LRU evicts the block freed longest ago: A's blocks 0, 1, 2 freed in that order,
    # another request takes block 0 (evicting A's first hash), a third holding 3..6
    # finishes; blocks 1 and 2 stay cached and free, behind no hit
    orphans, _ = _prefilled(7, [(a, ()), (list(range(800, 816)), ())])
    for block in (0, 1, 2):
        orphans.free(block)
    orphans.allocate()
    for block in (6, 5, 4, 3):
        orphans.free(block)
    # the same prompt asked while its first copy runs: block 3 is cached beside block 2
    # under one hash; both tables freed, tail first, the newer copy first
    twins, (first, again) = _prefilled(6, [(a, ()), (a, ())])
    for block in again[::-1] + first[::-1]:
        twins.free(block)
    return [
        ("the same 4 tokens asked with extra keys ('lora-2',) then ('lora-1',); another "
         "block's hash has lora-2's value", collision,
         [(a[:4] + [2], ("lora-2",), 4, 5), (a[:4] + [3], ("lora-1",), 4, 5)]),
        ("two blocks cached under one hash (a prompt asked again while it ran: blocks 2 "
         "and 3), then fresh blocks evict the newer copy, block 3, not the oldest", twins,
         [(list(range(700, 710)), (), 4, 10), (a, (), 4, 12)]),
        ("LRU eviction took a prefix's first block before its later ones (freed first "
         "block first, not tail first): A's block 0 evicted, blocks 1 and 2 still cached "
         "and free", orphans, [(a + [1], (), 4, 5)]),
    ]


def check_allocate_slots(fn: Callable[..., Any]) -> None:
    """``allocate_slots(pool, token_ids, hashes, block_size, max_new_tokens)``."""
    with grading.exercise("10.4"):
        for what, pool, calls in edge_states():
            for k, (tokens, extra, bs, budget) in enumerate(calls):
                ask = Ask(f"edge state '{what}'" + (f", call {k + 1}" if len(calls) > 1
                                                    else ""), snapshot(pool), tuple(tokens),
                          tuple(block_hashes(tokens, bs, extra)), bs, budget)
                compare(fn, ask)
                pool = build(ask.answer(allocate_slots)[1])

        def tell(label: str, small: Any) -> None:  # the shrunk workload, call by call
            def spy(pool, token_ids, hashes, block_size, max_new_tokens):
                compare(fn, Ask(f"{label}, at engine step {engine[0].scheduler.step}",
                                snapshot(pool), tuple(token_ids), tuple(hashes),
                                block_size, max_new_tokens))
                return allocate_slots(pool, token_ids, hashes, block_size, max_new_tokens)
            engine: list = []
            generated.serve(small, EngineHooks(allocate_slots=spy), ready=engine.append)
        generated.check("allocate_slots", fn, "the hit's blocks (pool.lookup's: where two "
                        "blocks are cached under one hash, the oldest) taken out of the free "
                        "queue before any allocation, then the chunk's fresh blocks, each "
                        "full block registered under its hash", tell=tell)
