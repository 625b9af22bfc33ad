"""Checks for chapter 10 (prefix caching), each next to :mod:`paged_lib.engine.prefix_cache`.

* 10.1 ``block_hashes``, 10.2 ``longest_cache_hit``: named prompts and caches, a wrong
  answer matched to the slip that gives it; the same per-case check on the generated cases
  of :mod:`~.generated.small_prefix`; then random workloads (:mod:`~.generated`).
* 10.3 ``popleft`` and ``remove`` of a :class:`FreeBlockQueue` subclass: scripted
  operations, after each the answer (or error), ``next``, ``prev`` and ``len`` compared
  with the library's queue; the time per call at 1,000 and 100,000 blocks (O(1) stays
  flat); random workloads on small caching pools.
* 10.4 ``allocate_slots``: :mod:`~.ch10_alloc`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from paged_lib.course import grading
from paged_lib.course.grading import generated
from paged_lib.course.grading.ch10_alloc import check_allocate_slots
from paged_lib.course.grading.generated import numeric, small_prefix
from paged_lib.engine.prefix_cache import (
    BlockHash,
    FreeBlockQueue,
    block_hashes,
    hash_block_tokens,
    longest_cache_hit,
)

__all__ = ["check_allocate_slots", "check_block_hashes", "check_free_queue",
           "check_longest_cache_hit"]


# ------------------------------------------------------------------ 10.1 block_hashes

def _tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


#: name, token ids, block size, extra keys
_HASH_SCENARIOS: list[tuple[str, list[int], int, tuple]] = [
    ("11 tokens, block size 4 (a part-filled last block)", _tokens(11), 4, ()),
    ("12 tokens, block size 4 (every block full)", _tokens(12), 4, ()),
    ("the same 3 tokens, four times over (block size 3)", [7, 8, 9] * 4, 3, ()),
    ("a prompt shorter than one block", [5, 6, 7], 4, ()),
    ("no tokens at all", [], 4, ()),
    ("block size 1", [3, 1, 4, 1, 5], 1, ()),
    ("20 tokens, block size 8, no extra keys", _tokens(20, 50), 8, ()),
    ("the same 20 tokens, extra keys ('lora-2',)", _tokens(20, 50), 8, ("lora-2",)),
    ("the same 20 tokens again, extra keys ('lora-3',)", _tokens(20, 50), 8, ("lora-3",)),
    ("17 tokens, block size 16", _tokens(17, 9), 16, ()),
]


def check_block_hashes(fn: Callable[..., Any]) -> None:
    """``block_hashes(token_ids, block_size, extra_keys=()) -> list[BlockHash]``."""
    with grading.exercise("10.1"):
        for name, tokens, block_size, extra in _HASH_SCENARIOS:
            _check_hashes(fn, name, tokens, block_size, extra)
        generated.check("block_hashes", fn, "one hash per full block, each chained on the "
                        "one before, with the extra keys")
        numeric.check("10.1", small_prefix.prompt_cases(), lambda p: _check_hashes(
            fn, "generated", p.tokens(), p.block_size, p.extras), small_prefix.PROMPT_CONTRASTS)


def _check_hashes(fn, name: str, tokens: list[int], block_size: int, extra: tuple) -> None:
    where = f"prompt '{name}'"
    given = list(tokens)
    got = fn(given, block_size, extra) if extra else fn(given, block_size)
    want = block_hashes(tokens, block_size, extra)
    grading.expect_true(given == tokens, f"{where}: your function changed token_ids",
                        "read the token ids, do not change them")
    if isinstance(got, int | float) and not isinstance(got, bool):
        grading.fail(f"{where}: expected a list of {len(want)} BlockHash, got {got!r}",
                     "return the hashes themselves, one per full block, not how many")
    grading.expect_true(isinstance(got, list),
                        f"{where}: expected a list, got a {type(got).__name__}",
                        "return a list with one BlockHash per full block")
    if any(not isinstance(h, BlockHash) for h in got):
        bad = next(h for h in got if not isinstance(h, BlockHash))
        grading.fail(f"{where}: expected BlockHash items, got {bad!r}",
                     "each item is what hash_block_tokens returns (a BlockHash), not its "
                     ".value or a tuple of tokens")
    n_full = len(tokens) // block_size
    if len(got) != len(want):
        _wrong_count(where, got, want, len(tokens), block_size, n_full)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            _remembered(fn, where, i, g, got, want, tokens, block_size, extra)
            _wrong_hash(where, i, g, got, want, tokens, block_size, extra)


_unseen = itertools.count(1)


def _right_on_new_tokens(fn, tokens: list[int], block_size: int, extra: tuple) -> bool:
    """Does ``fn`` hash ``tokens`` right once they are renamed to token ids no call has
    asked about (equal ids stay equal)? A hash remembered from an earlier call cannot
    answer for them."""
    base = 10**9 + 10**6 * next(_unseen)
    names = {t: base + k for k, t in enumerate(dict.fromkeys(tokens))}
    fresh = [names[t] for t in tokens]
    try:
        got = fn(list(fresh), block_size, extra) if extra else fn(list(fresh), block_size)
    except Exception:  # noqa: BLE001 - the learner's function: the usual hint then
        return False
    return got == block_hashes(fresh, block_size, extra)


def _remembered(fn, where, i, g, got, want, tokens, block_size, extra) -> None:
    """Name a hash that is kept from before: from an earlier call (right on new tokens,
    wrong on tokens asked before), or from an earlier block with the same tokens (right
    on blocks that all differ, wrong on a block that repeats)."""
    what = f"{where}: block {i}'s hash differs (expected {_short(want[i])}, got {_short(g)})"
    if _right_on_new_tokens(fn, tokens, block_size, extra):
        grading.fail(what, "your hashes are right on this text once its token ids are new "
                     "to your function, and wrong here, after the texts it hashed before: "
                     "it remembers hashes between calls (a dict kept at module level?) "
                     "under a key that leaves out part of what names a block (the parent "
                     "hash, the extra keys, the block size). block_hashes must depend on "
                     "its arguments alone: compute each hash afresh, or key a cache by "
                     "everything hash_block_tokens is given")
    mine = tokens[i * block_size:(i + 1) * block_size]
    same = [j for j in range(i) if got[j] == g
            and tokens[j * block_size:(j + 1) * block_size] == mine]
    if same and _right_on_new_tokens(fn, list(range(len(tokens))), block_size, extra):
        grading.fail(what, f"block {i} got block {same[0]}'s hash: the same tokens, after "
                     "other tokens. Your chain is right where no block repeats, so the hash "
                     "is looked up by the block's own tokens (a dict keyed by them?), which "
                     "leaves out the parent: equal tokens after a different prefix are a "
                     "different block. Hash each block on its parent's hash, or key a "
                     "cache by (parent, tokens, extra keys)")


def _wrong_count(where, got, want, num_tokens, block_size, n_full) -> None:
    what = (f"{where} ({num_tokens} tokens, block size {block_size}): expected "
            f"{len(want)} hashes, got {len(got)}")
    partial = num_tokens % block_size != 0
    if len(got) == len(want) + 1 and partial:
        grading.fail(what, "you hashed a partial block: the part-filled last block gets "
                     "no hash (its K/V will still change, so no one may share it)")
    if len(got) == len(want) - 1 and not partial:
        grading.fail(what, "off by one on full blocks: a block that is exactly full is "
                     "a full block and gets its hash (here the prompt ends on a block "
                     "boundary)")
    if len(got) == len(want) - 1:
        grading.fail(what, "off by one on full blocks: there are len(token_ids) // "
                     "block_size of them, the last full one included")
    if len(got) == num_tokens and block_size > 1:
        grading.fail(what, "one hash per block of block_size tokens, not one per token")
    grading.fail(what, f"one hash per full block: {n_full} here "
                 "(len(token_ids) // block_size)")


def _wrong_hash(where, i, g, got, want, tokens, block_size, extra) -> None:
    chunk = tokens[i * block_size:(i + 1) * block_size]
    parent = want[i - 1] if i else None
    what = f"{where}: block {i}'s hash differs (expected {_short(want[i])}, got {_short(g)})"
    before = tokens[(i - 1) * block_size:i * block_size]
    guesses = [
        (i > 0, hash_block_tokens(None, chunk, extra),
         "not chained on the parent: block i must be hashed with block i-1's hash as its "
         "parent, or equal blocks at different positions (and after different prefixes) "
         "get equal hashes and collide"),
        (i > 0, hash_block_tokens(None, tokens[:(i + 1) * block_size], extra),
         f"you hashed the whole prefix, tokens 0 to {(i + 1) * block_size - 1}, with no "
         f"parent: block {i}'s BlockHash then records {(i + 1) * block_size} token ids, "
         "not its own block's (the pool compares them with the block's tokens), and "
         f"naming a long prompt hashes its start again for every block; block {i - 1}'s "
         f"hash already stands for everything before block {i}"),
        (i > 1, hash_block_tokens(hash_block_tokens(None, before, extra), chunk, extra),
         f"the parent you gave block {i} stands for block {i - 1}'s tokens alone, not for "
         f"the {i * block_size} tokens before block {i}: two prompts that differ only "
         f"before block {i - 1} would share block {i}"),
        (i > 1, hash_block_tokens(want[0], chunk, extra),
         "hashed from the wrong parent: block i's parent is block i-1's hash, not the "
         "first block's"),
        (i > 1, hash_block_tokens(want[max(i - 2, 0)], chunk, extra),
         "hashed from the wrong parent: block i's parent is block i-1's hash, not the "
         "one two back"),
        (i == 0, hash_block_tokens(want[0], chunk, extra),
         "the first block has no parent: hash it with parent None"),
        (i == 0, hash_block_tokens(hash_block_tokens(None, (), extra), chunk, extra),
         "block 0 has nothing before it: hash_block_tokens takes parent None for that "
         "(its docstring says so), not the hash of a block of no tokens"),
        (bool(extra) and i > 0 and got[0] == want[0], hash_block_tokens(parent, chunk, ()),
         f"extra keys on block 0 only: the chain carries them on, but block {i}'s "
         "BlockHash records the extra keys it was made from and the pool compares them on "
         "lookup, so every block's hash takes them"),
        (bool(extra), hash_block_tokens(parent, chunk, ()),
         "extra keys forgotten: they go into every block's hash (a different LoRA "
         "adapter, say, must not share a block)"),
        (True, hash_block_tokens(parent, tokens[:(i + 1) * block_size], extra),
         "each hash_block_tokens call takes only that block's own tokens: the prefix "
         "before it comes in through the parent hash"),
        (True, hash_block_tokens(parent, tokens[i * block_size:i * block_size + block_size
                                                - 1], extra),
         "off by one in the block's slice: block i holds tokens "
         "[i * block_size, (i + 1) * block_size)"),
    ]
    for applies, guess, hint in guesses:
        if applies and g == guess:
            grading.fail(what, hint)
    if any(h == g for j, h in enumerate(want) if j != i):
        grading.fail(what, "the hashes are in the wrong order: one per full block, first "
                     "block first")
    grading.fail(what, f"block {i}'s name stands for its own {block_size} tokens and the "
                 f"extra keys, after the {i * block_size} tokens before it: the library "
                 f"hashes them on top of block {i - 1}'s hash" if i else
                 "block 0's name stands for its own tokens and the extra keys, with nothing "
                 "before it")


def _short(h: Any) -> str:
    if isinstance(h, BlockHash):
        return f"BlockHash(value={h.value:#x}, token_ids={h.token_ids})"
    return repr(h)


# ------------------------------------------------------------------ 10.2 longest_cache_hit

class _Lookup:
    """A cache lookup that records what it was asked."""

    def __init__(self, cache: dict[BlockHash, int]):
        self.cache = cache
        self.asked: list[BlockHash] = []

    def __call__(self, h: BlockHash) -> int | None:
        self.asked.append(h)
        return self.cache.get(h)


def check_longest_cache_hit(fn: Callable[..., Any]) -> None:
    """``longest_cache_hit(hashes, lookup, num_tokens, block_size) -> list[int]``."""
    with grading.exercise("10.2"):
        numeric.check("10.2", small_prefix.hit_cases(), lambda p: _check_hit(
            fn, p.num_tokens, p.block_size, p.cached()), small_prefix.HIT_CONTRASTS)
        generated.check("longest_cache_hit", fn, "the leading hits only, stopping at the "
                        "first miss, and never the block that holds the text's last token")


def _check_hit(fn, num_tokens: int, block_size: int, cached: dict[int, int]) -> None:
    hashes = block_hashes(_tokens(num_tokens, 7), block_size)
    cache = {hashes[i]: b for i, b in cached.items()}
    lookup = _Lookup(cache)
    given = list(hashes)
    got = fn(given, lookup, num_tokens, block_size)
    want = longest_cache_hit(hashes, cache.get, num_tokens, block_size)
    grading.expect_true(given == hashes, "your function changed hashes",
                        "read the hashes, do not change them")
    if isinstance(got, int) and not isinstance(got, bool):
        grading.fail(f"expected a list of block ids, got {got!r}",
                     "return the cached blocks themselves (lookup's answers), not how "
                     "many: the engine puts them at the start of the request's table")
    grading.expect_true(isinstance(got, list) and all(type(b) is int for b in got),
                        f"expected a list of int block ids, got {got!r}",
                        "return a list of the physical blocks lookup gave you")
    odd = [h for h in lookup.asked if not isinstance(h, BlockHash)]
    if odd:
        grading.fail(f"lookup was asked {odd[0]!r}, not a BlockHash",
                     "pass lookup the BlockHash itself (value, token ids and extra keys): "
                     "the pool compares all three, so a collision cannot give a wrong hit")
    if got == want:
        return
    every_hit = [cache[h] for h in hashes if h in cache]
    leading = []
    for h in hashes:
        if h not in cache:
            break
        leading.append(cache[h])
    last = (num_tokens - 1) // block_size  # the block that holds the last prompt token
    where_last = (f"the prompt's last token (token {num_tokens - 1}, counting from 0) is "
                  f"in block {last}, "
                  + ("part-filled" if num_tokens % block_size else "a full block"))
    what = f"expected {want}, got {got}"
    if len(got) > len(want) and got[:len(want)] == want and len(leading) > len(want):
        grading.fail(what, f"every block of this prompt is cached, yet its last token must "
                     f"still be computed (its logits give the first new token): "
                     f"{where_last}, so that block is not a hit")
    if got == every_hit or (len(got) > len(leading) and got[:len(leading)] == leading):
        grading.fail(what, "you counted hits past the first miss: the engine computes every "
                     "token after the hit, so the hit is the leading run only")
    if len(got) < len(want) and got == want[:len(got)]:
        grading.fail(what, f"you stopped after {len(got)} hit(s), the library reads "
                     f"{len(want)}: block {len(got)} is cached and {where_last}; only that "
                     "block and what follows it must be computed, every cached block "
                     "before it is a hit")
    if sorted(got) == sorted(want):
        grading.fail(what, "the blocks in the order of the hashes (the prompt's order)")
    grading.fail(what, f"the library reads the blocks lookup finds for the leading hashes, "
                 f"up to the first miss, and stops before the block that holds the last "
                 f"prompt token: {where_last}")



# ------------------------------------------------------------------ 10.3 the free queue

_POPLEFT = "paged_lib.engine.prefix_cache.FreeBlockQueue.popleft"

#: name, the queue's blocks at the start, then ("popleft",) / ("remove", b) / ("append", b);
#: removes come first, so that a popleft built on a wrong remove is told about remove
_SCRIPTS: list[tuple[str, list[int], list[tuple]]] = [
    ("remove the head, then the tail, then the middle", [7, 3, 9, 1, 5],
     [("remove", 7), ("remove", 5), ("remove", 9), ("append", 7), ("popleft",),
      ("remove", 7)]),
    ("remove the only block, popleft on the empty queue, then use it again", [4],
     [("remove", 4), ("popleft",), ("append", 2), ("popleft",), ("append", 6), ("append", 4),
      ("remove", 6), ("popleft",)]),
    ("remove a block that is not in the queue (or was taken already)", [2, 0, 8],
     [("remove", 5), ("popleft",), ("remove", 2), ("remove", 8), ("remove", 8)]),
]

#: what a refused call must do, by method
_REFUSED = {"popleft": "popleft on an empty queue raises IndexError (as collections.deque "
            "does) and changes nothing: the block after HEAD is then the TAIL sentinel",
            "remove": "remove of a block that is not in the queue raises ValueError (saying "
            "so) and changes nothing: unlinking it anyway corrupts the links"}
#: what a wrong link after each method means, by (dict, method)
_LINKS = {("next", "remove"): "remove left a neighbour pointing at the removed block: next "
          "of the block before it must point at the block after it",
          ("prev", "remove"): "remove left a neighbour pointing at the removed block: prev "
          "of the block after it must point at the block before it",
          ("next", "popleft"): "after popleft, next[HEAD] must be the new head",
          ("prev", "popleft"): "popleft did not unlink the new head's prev: prev of the new "
          "head must be HEAD, or a walk back from TAIL still meets the block you took"}


def check_free_queue(cls: Any) -> None:
    """``cls``: a :class:`FreeBlockQueue` subclass with its own ``popleft`` and ``remove``."""
    with grading.exercise("10.3"):
        calls: list[str] = []
        try:
            with grading._refusing_twin(_POPLEFT, calls):  # 10.3's second twin
                _check_queue(cls)
        except grading.TwinCalled:
            pass
        if calls:
            grading.fail(calls[0], "write popleft yourself from the spec: the check compares "
                         "your queue with the library's, so delegating proves nothing")
        generated.check("FreeBlockQueue", _telling(cls), "popleft takes the least recently "
                        "freed block (the front); remove takes out any queued block, whatever "
                        "blocks are around it (block 0 too: a block is queued when it is in "
                        "next, whatever next[block] holds), and relinks its neighbours")


def _check_queue(cls: Any) -> None:
    grading.expect_true(isinstance(cls, type) and issubclass(cls, FreeBlockQueue),
                        f"expected a subclass of FreeBlockQueue, got {cls!r}",
                        "pass the class itself (class MyQueue(FreeBlockQueue): ...), "
                        "not an instance")
    for name in ("popleft", "remove"):
        grading.expect_true(getattr(cls, name) is not getattr(FreeBlockQueue, name),
                            f"your class has no {name} of its own: it inherits the "
                            f"library's FreeBlockQueue.{name}",
                            f"define {name} in your class body: that is the exercise")
    for name, start, ops in _SCRIPTS:
        q, lib = cls(start), FreeBlockQueue(start)
        for k, op in enumerate(ops):
            before = list(lib)
            where = (f"scenario '{name}', step {k + 1} {op[0]}({', '.join(map(str, op[1:]))})"
                     f" on {before}")
            refused = _same_call(q, lib, op, where, before)
            _same_links(q, lib, "refused" if refused else op[0], where)
    _check_scaling(cls)


def _call(q: Any, op: tuple) -> tuple[Any, Exception | None]:
    try:
        return getattr(q, op[0])(*op[1:]), None
    except Exception as err:  # noqa: BLE001 - compared with the library's
        return None, err


def _same_call(q: Any, lib: FreeBlockQueue, op: tuple, where: str, before: list[int]) -> bool:
    """The learner's answer to ``op`` is the library's; was the call refused?"""
    (want, refused), (got, err) = _call(lib, op), _call(q, op)
    if refused is not None and not isinstance(err, type(refused)):
        said = f"raised {type(err).__name__}: {err}" if err else (
            f"returned {got!r}" if op[0] == "popleft" else "raised nothing")
        grading.fail(f"{where}: the library raises {type(refused).__name__}, yours {said}",
                     _REFUSED[op[0]])
    if err is not None and refused is None:
        raise err
    if got != want:
        grading.fail(f"{where}: popleft returned block {got}, expected {want}",
                     "popleft takes the head (the block freed longest ago: LRU), not the tail"
                     if got == before[-1] else "popleft returns the block right after HEAD")
    return refused is not None


def _same_links(q: Any, lib: FreeBlockQueue, call: str, where: str) -> None:
    """``next``, ``prev`` and ``len`` as the library's after the same call."""
    for name in ("next", "prev"):
        mine, want = dict(getattr(q, name)), dict(getattr(lib, name))
        if mine == want:
            continue
        if set(mine) - set(want):
            grading.fail(f"{where}: block(s) {sorted(set(mine) - set(want), key=str)} are no "
                         "longer queued but still have next/prev entries",
                         "delete the taken block's own next and prev entries too: while they "
                         "exist it counts as queued ('in' says so, append refuses it)")
        k = min((k for k in set(mine) | set(want) if mine.get(k, ()) != want.get(k, ())),
                key=str)
        grading.fail(f"{where}: {name}[{k!r}] is {mine.get(k, 'missing')!r}, the library's "
                     f"{want.get(k, 'missing')!r}",
                     _LINKS.get((name, call), "check first, then change: a refused call "
                                "leaves the links as they were"))
    grading.expect_equal(len(q), len(lib), f"{where}: len(queue)",
                         "keep _len in step: popleft and remove each take one block out")


def _check_scaling(cls: type) -> None:
    """Time per call in queues of 1,000 and 100,000 blocks (best of 5 turns of at most 100
    calls or 0.1 s, the sizes taking turns, so a busy spell slows both): O(1) stays flat; a
    walk, a rebuild or a list kept beside the links grows about 100x."""
    sizes = (1_000, 100_000)
    queues = {n: cls(range(n)) for n in sizes}
    for op in ("remove", "popleft"):
        best = dict.fromkeys(sizes, float("inf"))
        for r, n in itertools.product(range(5), sizes):
            q, done, start = queues[n], 0, time.perf_counter()
            while done < 100 and time.perf_counter() - start < 0.1:
                q.remove(n // 2 + 100 * r + done) if op == "remove" else q.popleft()
                done += 1
            best[n] = min(best[n], (time.perf_counter() - start) / done)
        ratio = best[sizes[1]] / max(best[sizes[0]], 1e-9)
        if ratio > 20 and best[sizes[1]] > 20e-6:
            grading.fail(f"one {op} takes {best[sizes[1]] * 1e6:,.0f} us in a queue of "
                         f"{sizes[1]:,} blocks and {best[sizes[0]] * 1e6:,.1f} us in one of "
                         f"{sizes[0]:,}: {ratio:,.0f}x",
                         f"{op} is O(n): it walks, rebuilds or scans the queue (list.remove, "
                         "or a search in a list kept beside the links?); take the block's "
                         "neighbours from prev and next and link them to each other, a "
                         "constant number of dict operations")


def _telling(cls: type) -> type:
    """``cls`` as the served workloads use it: an error in popleft or remove tells the
    queue it was asked on (head first, before the call)."""

    def told(q, op: str, run):
        queued = list(itertools.islice(_walk(q), len(q) + 2))
        try:
            return run()
        except Exception as err:
            err.args = (f"{op} on the free queue {queued} (head first) raised: {err}",)
            raise

    class Told(cls):
        def popleft(self):
            return told(self, "popleft()", lambda: cls.popleft(self))

        def remove(self, block_id):
            told(self, f"remove({block_id})", lambda: cls.remove(self, block_id))

    return Told


def _walk(q: Any):
    node = q.next.get(q.HEAD, q.TAIL)
    while node != q.TAIL:
        yield node
        node = q.next.get(node, q.TAIL)
