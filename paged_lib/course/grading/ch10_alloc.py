"""Exercise 10.4: a new request's table in the caching pool (``allocate_slots``), next to
:func:`paged_lib.engine.prefix_cache.allocate_slots`, call by call: first on the edge states
no serving run reaches (:func:`edge_states`), then on random workloads served side by side
(:mod:`~.generated`), the first that differs shrunk and served again with every call asked
of both. The first call that differs is told as a story (the pool before, the call, both
answers and pools after) with a hint naming the rule (:func:`diagnose`).
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


@dataclass(frozen=True)
class State:
    """What a caching pool holds, comparable: the free queue head first, every block's
    reference count, each cached block's hash, and the blocks under each hash value."""

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


def library_answer(ask: Ask) -> tuple[Any, State]:
    pool = build(ask.before)
    got = allocate_slots(pool, list(ask.token_ids), list(ask.hashes), ask.block_size,
                         ask.max_new_tokens)
    return (list(got[0]), got[1]), snapshot(pool)


def learner_answer(fn: Callable, ask: Ask) -> tuple[Any, State]:
    pool = build(ask.before)
    got = fn(pool, list(ask.token_ids), list(ask.hashes), ask.block_size, ask.max_new_tokens)
    if isinstance(got, tuple | list) and len(got) == 2 and isinstance(got[0], list | tuple):
        got = (list(got[0]), got[1])
    return got, snapshot(pool)


# ------------------------------------------------------------------ the story


def _parts(s: State) -> dict[str, str]:
    """The pool's state in words: its free queue, the blocks held, the blocks cached."""
    def cached(h: BlockHash) -> str:
        extra = f" {h.extra_keys}" if h.extra_keys else ""
        return f"tokens {h.token_ids[0]}..{h.token_ids[-1]}{extra}"
    held = {b: r for b, r in enumerate(s.refs) if r}
    by_value = str([list(bs) for _, bs in s.by_value if len(bs) > 1] or "one each")
    empty = sum(not bs for _, bs in s.by_value)
    if empty:
        by_value += f", {empty} hash value(s) kept with an empty list"
    return {"free queue (head first)": str(list(s.free)),
            "held (block: ref count)": str(held or "none"),
            "cached": "{" + ", ".join(f"{b}: {cached(h)}" for b, h in s.hashes) + "}",
            "cached_blocks (blocks per hash value)": by_value}


def _pool_text(s: State) -> str:
    return ", ".join(f"{k} {v}" for k, v in _parts(s).items())


def _asked_text(ask: Ask) -> str:
    found = [b for h in ask.hashes for b, c in ask.before.hashes if c == h]
    return (f"allocate_slots(pool, {len(ask.token_ids)} token ids, {len(ask.hashes)} hashes "
            f"(cached: {found or 'none'}), block_size={ask.block_size}, "
            f"max_new_tokens={ask.max_new_tokens})")


def diagnose(ask: Ask, want: Any, want_state: State, got: Any, got_state: State) -> str:
    """The rule the learner's answer breaks, named from what differs."""
    bs, before = ask.block_size, ask.before
    if not (isinstance(got, tuple) and len(got) == 2):
        return "return a pair: (the table's blocks, the number of tokens the cache supplied)"
    blocks, computed = got
    wb, wc = want
    cached_at = dict(before.hashes)
    leading = 0
    for h in ask.hashes:
        if not any(c == h for c in cached_at.values()):
            break
        leading += 1
    if computed != wc or blocks[:wc // bs] != wb[:wc // bs]:
        if isinstance(computed, int) and computed > wc and computed == leading * bs:
            return ("a full hit: every block is cached, yet the last token must be computed "
                    "(its logits give the next token), so at most (len(token_ids) - 1) // "
                    "block_size blocks are adopted")
        adopted = blocks[:computed // bs] if isinstance(computed, int) else []
        if any(cached_at.get(b) is not None and cached_at[b] != h
               and cached_at[b].value == h.value
               for b, h in zip(adopted, ask.hashes, strict=False)):
            return ("a block whose hash has the same value is not a hit: compare the whole "
                    "BlockHash (value, token ids and extra keys), as pool.lookup does")
        if isinstance(computed, int) and computed != len(blocks[:computed // bs]) * bs:
            return "num_computed_tokens is the hit blocks times block_size"
        if isinstance(computed, int) and computed < wc and adopted == wb[:computed // bs]:
            last = (len(ask.token_ids) - 1) // bs
            return (f"your hit stops after {computed // bs} block(s), the library's after "
                    f"{wc // bs}: every leading cached block can be read as long as the "
                    f"text's last token is still computed, and here it is in block {last}")
        if adopted != wb[:len(adopted)] and all(b in cached_at and cached_at[b] == cached_at.get(
                w) for b, w in zip(adopted, wb, strict=False)):
            return ("where two blocks are cached under one hash, the hit is the oldest "
                    "(pool.lookup's: the first in cached_blocks[value]), as the engine's "
                    "admission counted")
        if any(cached_at.get(b) in ask.hashes[leading + 1:] for b in adopted):
            return ("a hit must be a leading run: after a miss, later hashes cannot be used "
                    "(the table's first blocks would hold the K/V of later tokens)")
        return ("the hit is the cached blocks of the longest run of leading hashes, in "
                "order, stopping at the first miss; num_computed_tokens their tokens")
    if len(blocks) != len(wb):
        now = min(len(ask.token_ids) - wc, ask.max_new_tokens)
        return (f"after its hit of {wc} tokens this request computes {now} now (its budget "
                "counts only the tokens it computes, and nothing past its text is "
                f"computed): the table covers tokens 0..{wc + now - 1}, {len(wb)} blocks, "
                "and the rest of a chunked prompt takes its blocks in later steps")
    fresh, wfresh = blocks[wc // bs:], wb[wc // bs:]
    if fresh != wfresh:
        hits = set(wb[:wc // bs])
        if hits & set(fresh):
            return ("a hit on a block with ref count 0 must leave the free queue before "
                    "any fresh block is taken, or the head you pop may be the very block "
                    "you hit")
        tail = list(before.free)[::-1]
        if fresh == [b for b in tail if b not in hits][:len(fresh)]:
            return ("fresh blocks come from the head of the free queue (freed longest "
                    "ago), not the tail (freed last, the most likely to be hit again)")
        k = next(i for i, (g, w) in enumerate(zip(fresh, wfresh, strict=False)) if g != w)
        return (f"fresh block {k + 1} is {fresh[k]} in yours, {wfresh[k]} in the library's, "
                f"which comes first in the free queue (freed longer ago): fresh blocks are "
                "reused in the queue's order, cached or not")
    if got_state.refs != want_state.refs:
        b = next(i for i, (g, w) in enumerate(zip(got_state.refs, want_state.refs,
                                                  strict=True)) if g != w)
        return (f"block {b}'s reference count is {got_state.refs[b]}, the library's "
                f"{want_state.refs[b]}: a hit takes one more reference (whoever else holds "
                "it), a fresh block starts at 1")
    if got_state.free != want_state.free:
        left = set(got_state.free) & set(wb)
        if left:
            return (f"block {sorted(left)[0]} is in your table and still in the free queue: "
                    "a hit on a block with ref count 0 takes it out of the queue")
        return "only the blocks of the table leave the free queue; the others keep their order"
    got_h, want_h = dict(got_state.hashes), dict(want_state.hashes)
    stale = [b for b in wfresh if b in got_h and got_h[b] == cached_at.get(b)
             and b not in want_h]
    if stale or any(b in cached_at and got_h.get(b) == cached_at[b] != want_h.get(b)
                    for b in wfresh):
        b = (stale or [b for b in wfresh if b in cached_at])[0]
        return (f"block {b} was cached and is reused: it loses its old hash (eviction), in "
                "block_hash and in cached_blocks, or a later lookup finds stale K/V")
    end = wc + min(len(ask.token_ids) - wc, ask.max_new_tokens)
    full = end // bs
    dup = [b for b in wb[:full] if b not in got_h and want_h[b] in cached_at.values()]
    if dup:
        other = next(c for c, h in before.hashes if h == want_h[dup[0]])
        return (f"block {dup[0]} is full after this step and is cached now, when it is "
                "scheduled (a request admitted later in the same step may read it), even "
                f"though it holds the same K/V as block {other}, cached before: both stay "
                "cached (vLLM's duplicated blocks), so evicting one does not lose the prefix")
    if any(b not in got_h for b in wb[:full]):
        return ("register the full blocks this step fills when it is scheduled (block_hash "
                "and cached_blocks), so a request admitted later in the same step hits them")
    if any(b in got_h and b not in want_h for b in wb[full:]):
        return ("the chunk ends mid-block: a part-filled block gets no hash (its K/V will "
                "still change); only the end // block_size full blocks are registered")
    if any(not bs for _, bs in got_state.by_value):
        return ("a hash with no block left must be deleted from cached_blocks (del "
                "pool.cached_blocks[value]), not kept as an empty list")
    got_v, want_v = dict(got_state.by_value), dict(want_state.by_value)
    evicted = [b for b in wfresh if b in cached_at]
    if any(b in got_v.get(cached_at[b].value, ()) for b in evicted):
        b = next(b for b in evicted if b in got_v.get(cached_at[b].value, ()))
        value = cached_at[b].value
        gone = sorted(set(want_v.get(value, ())) - set(got_v[value]))
        return (f"block {b} was evicted but cached_blocks still lists it under its old "
                f"value, and block(s) {gone} left the list instead: several blocks may be "
                "cached under one value; take out the very block evicted, not the list's "
                "first")
    unlisted = [b for b, h in got_state.hashes if b not in got_v.get(h.value, ())
                and b in want_v.get(h.value, ())]
    if unlisted:
        return (f"block {unlisted[0]} is still cached (block_hash), but cached_blocks no "
                "longer lists it under its value, which lists every block cached under it, "
                "oldest first: an eviction takes out only the block reused, and a block "
                "newly cached goes after the others")
    if got_state.by_value != want_state.by_value:
        return ("cached_blocks[value] lists every block cached under that value, oldest "
                "first: a block recomputed with the same hash as another (a full hit's last "
                "block) is added after it, and a hit, already there, is not added again")
    return "the pool after the call differs from the library's"


def compare(fn: Callable, ask: Ask) -> None:
    """Ask ``fn`` and the library; fail with the story at the first difference."""
    want, want_state = library_answer(ask)
    got, got_state = learner_answer(fn, ask)
    if got == want and got_state == want_state:
        return
    mine, lib = _parts(got_state), _parts(want_state)
    after = "; ".join(f"{k}: the library's {lib[k]}, yours {mine[k]}" for k in lib
                      if mine[k] != lib[k])
    answers = (f"the library answers {want!r}, yours {got!r}" if got != want
               else f"both answer {want!r}")
    grading.fail(f"{ask.where}: the pool holds {_pool_text(ask.before)}; asked "
                 f"{_asked_text(ask)}, {answers}" + (f"; after it, {after}" if after else ""),
                 diagnose(ask, want, want_state, got, got_state))


# ------------------------------------------------------------------ edge states


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
    a = _text(12, 100)
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
        ("the same 4 tokens asked with extra keys ('lora-2',) then ('lora-1',); another "
         "block's hash has lora-2's value", collision,
         [(a[:4] + [2], ("lora-2",), 4, 5), (a[:4] + [3], ("lora-1",), 4, 5)]),
        ("two blocks cached under one hash (a prompt asked again while it ran: blocks 2 "
         "and 3), then fresh blocks evict the newer copy, block 3, not the oldest", twins,
         [(_text(10, 700), (), 4, 10), (a, (), 4, 12)]),
        ("LRU eviction took a prefix's first block before its later ones (freed first "
         "block first, not tail first): A's block 0 evicted, blocks 1 and 2 still cached "
         "and free", orphans, [(a + [1], (), 4, 5)]),
    ]


def check_allocate_slots(fn: Callable[..., Any]) -> None:
    """``allocate_slots(pool, token_ids, hashes, block_size, max_new_tokens)``."""
    with grading.exercise("10.4"):
        _check_edges(fn)

        def tell(label: str, small: Any) -> None:  # the shrunk workload, call by call
            def spy(pool, token_ids, hashes, block_size, max_new_tokens):
                compare(fn, Ask(f"{label}, at engine step {engine[0].scheduler.step}",
                                snapshot(pool), tuple(token_ids), tuple(hashes),
                                block_size, max_new_tokens))
                return allocate_slots(pool, token_ids, hashes, block_size, max_new_tokens)
            engine: list = []
            generated.serve(small, EngineHooks(allocate_slots=spy), ready=engine.append)
        generated.check("allocate_slots", fn, "the hit's blocks (pool.lookup's: where two "
                        "blocks are cached under one hash, the oldest, as the engine's "
                        "admission counted) taken out of the free queue (touched) before "
                        "any allocation, then the chunk's fresh blocks, each full block "
                        "registered under its hash", tell=tell)


def _check_edges(fn: Callable) -> None:
    for what, pool, calls in edge_states():
        for k, (tokens, extra, bs, budget) in enumerate(calls):
            before = snapshot(pool)
            ask = Ask(f"edge state '{what}'" + (f", call {k + 1}" if len(calls) > 1 else ""),
                      before, tuple(tokens), tuple(block_hashes(tokens, bs, extra)), bs,
                      budget)
            compare(fn, ask)
            pool = build(library_answer(ask)[1])


__all__ = ["State", "check_allocate_slots", "edge_states"]
