"""Checks for chapter 10 (prefix caching), each next to :mod:`paged_lib.engine.prefix_cache`.

10.1 ``block_hashes``, 10.2 ``longest_cache_hit``: named prompts and caches, a wrong answer
matched to the slip that gives it, the generated cases of :mod:`~.generated.small_prefix`,
then random workloads (:mod:`~.generated`). 10.3 ``popleft``/``remove`` of a
:class:`FreeBlockQueue` subclass: scripted operations compared with the library's queue,
the time per call at 1,000 and 100,000 blocks, random workloads. 10.4: :mod:`~.ch10_alloc`.
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


def _call(fn, tokens: list[int], block_size: int, extra: tuple) -> Any:
    return fn(tokens, block_size, extra) if extra else fn(tokens, block_size)


def _check_hashes(fn, name: str, tokens: list[int], block_size: int, extra: tuple) -> None:
    where, given = f"prompt '{name}'", list(tokens)
    got, want = _call(fn, given, block_size, extra), block_hashes(tokens, block_size, extra)
    grading.expect_true(given == tokens, f"{where}: your function changed token_ids",
                        "read the token ids, do not change them")
    if isinstance(got, int | float) and not isinstance(got, bool):
        grading.fail(f"{where}: expected a list of {len(want)} BlockHash, got {got!r}",
                     "return the hashes themselves, one per full block, not how many")
    grading.expect_true(isinstance(got, list), f"{where}: expected a list, got a "
                        f"{type(got).__name__}", "return a list with one BlockHash per full "
                        "block")
    bad = [h for h in got if not isinstance(h, BlockHash)]
    grading.expect_true(not bad, f"{where}: expected BlockHash items, got "
                        f"{(bad or [None])[0]!r}", "each item is what hash_block_tokens returns "
                        "(a BlockHash), not its .value or a tuple of tokens")
    n, partial = len(tokens), len(tokens) % block_size != 0
    for wrong, hint in [
        (len(got) == len(want) + 1 and partial, "you hashed a partial block: the part-filled "
         "last block gets no hash (its K/V will still change)"),
        (len(got) == len(want) - 1 and not partial, "off by one on full blocks: a block that "
         "is exactly full is a full block and gets its hash"),
        (len(got) == len(want) - 1, "off by one on full blocks: there are len(token_ids) // "
         "block_size of them, the last full one included"),
        (len(got) == n != len(want) and block_size > 1, "one hash per block of "
         "block_size tokens, not one per token"),
        (len(got) != len(want), f"one hash per full block: {len(want)} here "
         "(len(token_ids) // block_size)")]:
        grading.expect_true(not wrong, f"{where} ({n} tokens, block size {block_size}): "
                            f"expected {len(want)} hashes, got {len(got)}", hint)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            what = (f"{where}: block {i}'s hash differs (expected {_short(w)}, got "
                    f"{_short(g)})")
            grading.fail(what, _hash_hint(fn, i, g, got, want, tokens, block_size, extra))


_unseen = itertools.count(1)


def _right_on_new_tokens(fn, tokens: list[int], block_size: int, extra: tuple) -> bool:
    """Does ``fn`` hash ``tokens`` right once they are renamed to token ids no call has
    asked about (equal ids stay equal)? A hash remembered from an earlier call cannot
    answer for them."""
    base = 10**9 + 10**6 * next(_unseen)
    names = {t: base + k for k, t in enumerate(dict.fromkeys(tokens))}
    fresh = [names[t] for t in tokens]
    try:
        return _call(fn, list(fresh), block_size, extra) == block_hashes(fresh, block_size,
                                                                        extra)
    except Exception:  # noqa: BLE001 - the learner's function: the usual hint then
        return False


def _hash_hint(fn, i, g, got, want, tokens, block_size, extra) -> str:
    """Block ``i``'s hash is ``g``: a hash kept from an earlier call (right on new tokens)
    or from an earlier block with the same tokens (right where no block repeats), else the
    slip whose hash it is."""
    if _right_on_new_tokens(fn, tokens, block_size, extra):
        return ("your hashes are right on this text once its token ids are new to your "
                "function: it remembers hashes between calls under a key that leaves out "
                "part of what names a block (the parent, the extra keys, the block size); "
                "compute each hash afresh, or key a cache by all hash_block_tokens is given")
    s = block_size
    chunk, before = tokens[i * s:(i + 1) * s], tokens[(i - 1) * s:i * s]
    same = [j for j in range(i) if got[j] == g and tokens[j * s:(j + 1) * s] == chunk]
    if same and _right_on_new_tokens(fn, list(range(len(tokens))), s, extra):
        return (f"block {i} got block {same[0]}'s hash: the same tokens, after other tokens. "
                "Your chain is right where no block repeats, so the hash is looked up by the "
                "block's own tokens, which leaves out the parent: hash each block on its "
                "parent's hash, or key a cache by (parent, tokens, extra keys)")
    parent = want[i - 1] if i else None
    for applies, guess, hint in [
        (i > 0, hash_block_tokens(None, chunk, extra), "not chained on the parent: block i "
         "is hashed with block i-1's hash as its parent, or equal blocks collide"),
        (i > 0, hash_block_tokens(None, tokens[:(i + 1) * s], extra), f"you hashed the whole "
         f"prefix, tokens 0 to {(i + 1) * s - 1}, with no parent: block {i - 1}'s hash "
         f"already stands for everything before block {i}"),
        (i > 1, hash_block_tokens(hash_block_tokens(None, before, extra), chunk, extra),
         f"the parent you gave block {i} stands for block {i - 1}'s tokens alone, not for "
         f"the {i * s} tokens before block {i}"),
        (i > 1, hash_block_tokens(want[0], chunk, extra), "hashed from the wrong parent: "
         "block i's parent is block i-1's hash, not the first block's"),
        (i > 1, hash_block_tokens(want[max(i - 2, 0)], chunk, extra), "hashed from the wrong "
         "parent: block i's parent is block i-1's hash, not the one two back"),
        (i == 0, hash_block_tokens(want[0], chunk, extra),
         "the first block has no parent: hash it with parent None"),
        (i == 0, hash_block_tokens(hash_block_tokens(None, (), extra), chunk, extra),
         "block 0 has nothing before it: hash_block_tokens takes parent None for that, not "
         "the hash of a block of no tokens"),
        (bool(extra) and i > 0 and got[0] == want[0], hash_block_tokens(parent, chunk, ()),
         "extra keys on block 0 only: every block's BlockHash records its extra keys and "
         "the pool compares them on lookup, so every block's hash takes them"),
        (bool(extra), hash_block_tokens(parent, chunk, ()), "extra keys forgotten: they go "
         "into every block's hash"),
        (True, hash_block_tokens(parent, tokens[:(i + 1) * s], extra), "each "
         "hash_block_tokens call takes only that block's own tokens (the prefix comes in "
         "through the parent)"),
        (True, hash_block_tokens(parent, tokens[i * s:(i + 1) * s - 1], extra), "off by one "
         "in the block's slice: block i holds tokens [i * block_size, (i + 1) * block_size)")]:
        if applies and g == guess:
            return hint
    if any(h == g for j, h in enumerate(want) if j != i):
        return "the hashes are in the wrong order: one per full block, first block first"
    return (f"block {i}'s hash stands for its own {s} tokens and the extra keys, on top of "
            f"block {i - 1}'s hash" if i else
            "block 0's hash stands for its own tokens and the extra keys, with parent None")


def _short(h: Any) -> str:
    if isinstance(h, BlockHash):
        return f"BlockHash(value={h.value:#x}, token_ids={h.token_ids})"
    return repr(h)


# ------------------------------------------------------------------ 10.2 longest_cache_hit

def check_longest_cache_hit(fn: Callable[..., Any]) -> None:
    """``longest_cache_hit(hashes, lookup, num_tokens, block_size) -> list[int]``."""
    with grading.exercise("10.2"):
        numeric.check("10.2", small_prefix.hit_cases(), lambda p: _check_hit(
            fn, p.num_tokens, p.block_size, p.cached()), small_prefix.HIT_CONTRASTS)
        generated.check("longest_cache_hit", fn, "the leading hits only, stopping at the "
                        "first miss, and never the block that holds the text's last token")


def _check_hit(fn, num_tokens: int, block_size: int, cached: dict[int, int]) -> None:
    hashes = block_hashes(_tokens(num_tokens, 7), block_size)
    cache, asked, given = {hashes[i]: b for i, b in cached.items()}, [], list(hashes)
    got = fn(given, lambda h: asked.append(h) or cache.get(h), num_tokens, block_size)
    want = longest_cache_hit(hashes, cache.get, num_tokens, block_size)
    grading.expect_true(given == hashes, "your function changed hashes",
                        "read the hashes, do not change them")
    if isinstance(got, int) and not isinstance(got, bool):
        grading.fail(f"expected a list of block ids, got {got!r}", "return the cached blocks "
                     "themselves (lookup's answers), not how many")
    grading.expect_true(isinstance(got, list) and all(type(b) is int for b in got),
                        f"expected a list of int block ids, got {got!r}",
                        "return a list of the physical blocks lookup gave you")
    odd = [h for h in asked if not isinstance(h, BlockHash)]
    grading.expect_true(not odd, f"lookup was asked {(odd or [None])[0]!r}, not a BlockHash",
                        "pass lookup the BlockHash itself (value, token ids and extra keys): "
                        "the pool compares all three")
    if got == want:
        return
    n = next((k for k, h in enumerate(hashes) if h not in cache), len(hashes))
    leading, last = [cache[h] for h in hashes[:n]], (num_tokens - 1) // block_size
    where_last = (f"the prompt's last token (token {num_tokens - 1}, counting from 0) is in "
                  f"block {last}, " + ("part-filled" if num_tokens % block_size else
                                       "a full block"))
    for wrong, hint in [
        (len(got) > len(want) and got[:len(want)] == want and n > len(want), "every block of "
         "this prompt is cached, yet its last token must still be computed (its logits give "
         f"the first new token): {where_last}, so that block is not a hit"),
        (got == [cache[h] for h in hashes if h in cache] or (len(got) > n and got[:n] ==
                                                             leading),
         "you counted hits past the first miss: the hit is the leading run only"),
        (len(got) < len(want) and got == want[:len(got)], f"you stopped after {len(got)} "
         f"hit(s), the library reads {len(want)}: block {len(got)} is cached and "
         f"{where_last}; every cached block before that one is a hit"),
        (sorted(got) == sorted(want), "the blocks in the order of the hashes (the prompt's "
         "order)"),
        (True, "the library reads the blocks lookup finds for the leading hashes, up to the "
         f"first miss, and stops before the block that holds the last token: {where_last}")]:
        grading.expect_true(not wrong, f"expected {want}, got {got}", hint)


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
            "does) and changes nothing",
            "remove": "remove of a block that is not in the queue raises ValueError and "
            "changes nothing: unlinking it anyway corrupts the links"}
#: what a wrong link after each method means, by (dict, method)
_LINKS = {("next", "remove"): "remove left a neighbour pointing at the removed block: next "
          "of the block before it must point at the block after it",
          ("prev", "remove"): "remove left a neighbour pointing at the removed block: prev "
          "of the block after it must point at the block before it",
          ("next", "popleft"): "after popleft, next[HEAD] must be the new head",
          ("prev", "popleft"): "popleft did not unlink the new head's prev: prev of the new "
          "head must be HEAD"}


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
                        "pass the class itself (class MyQueue(FreeBlockQueue): ...)")
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
            (want, refused), (got, err) = _try(lib, op), _try(q, op)
            if refused is not None and not isinstance(err, type(refused)):
                said = f"raised {type(err).__name__}: {err}" if err else (
                    f"returned {got!r}" if op[0] == "popleft" else "raised nothing")
                grading.fail(f"{where}: the library raises {type(refused).__name__}, yours "
                             f"{said}", _REFUSED[op[0]])
            if err is not None and refused is None:
                raise err
            grading.expect_true(got == want, f"{where}: popleft returned block {got}, "
                                f"expected {want}", "popleft takes the head (the block freed "
                                "longest ago: LRU), not the tail" if [got] == before[-1:]
                                else "popleft returns the block right after HEAD")
            _same_links(q, lib, "refused" if refused else op[0], where)
    _check_scaling(cls)


def _try(q: Any, op: tuple) -> tuple[Any, Exception | None]:
    try:
        return getattr(q, op[0])(*op[1:]), None
    except Exception as err:  # noqa: BLE001 - compared with the library's
        return None, err


def _same_links(q: Any, lib: FreeBlockQueue, call: str, where: str) -> None:
    """``next``, ``prev`` and ``len`` as the library's after the same call."""
    for name in ("next", "prev"):
        mine, want = dict(getattr(q, name)), dict(getattr(lib, name))
        grading.expect_true(not set(mine) - set(want), f"{where}: block(s) "
                            f"{sorted(set(mine) - set(want), key=str)} are no longer queued "
                            "but still have next/prev entries", "delete the taken block's "
                            "own next and prev entries too, or it still counts as queued")
        k = min((k for k in set(mine) | set(want) if mine.get(k, ()) != want.get(k, ())),
                key=str, default=None)
        grading.expect_true(k is None, f"{where}: {name}[{k!r}] is "
                            f"{mine.get(k, 'missing')!r}, the library's "
                            f"{want.get(k, 'missing')!r}", _LINKS.get(
                                (name, call), "check first, then change: a refused call "
                                "leaves the links as they were"))
    grading.expect_equal(len(q), len(lib), f"{where}: len(queue)",
                         "keep _len in step: popleft and remove each take one block out")


def _check_scaling(cls: type) -> None:
    """Time per call in queues of 1,000 and 100,000 blocks (best of 5 turns of at most 100
    calls or 0.1 s, the sizes taking turns): O(1) stays flat, a walk grows about 100x."""
    small, big = sizes = (1_000, 100_000)
    queues = {n: cls(range(n)) for n in sizes}
    for op in ("remove", "popleft"):
        best = dict.fromkeys(sizes, float("inf"))
        for r, n in itertools.product(range(5), sizes):
            q, done, start = queues[n], 0, time.perf_counter()
            while done < 100 and time.perf_counter() - start < 0.1:
                q.remove(n // 2 + 100 * r + done) if op == "remove" else q.popleft()
                done += 1
            best[n] = min(best[n], (time.perf_counter() - start) / done)
        ratio = best[big] / max(best[small], 1e-9)
        grading.expect_true(ratio <= 20 or best[big] <= 20e-6, f"one {op} takes "
                            f"{best[big] * 1e6:,.0f} us in a queue of {big:,} blocks and "
                            f"{best[small] * 1e6:,.1f} us in one of {small:,}: {ratio:,.0f}x",
                            f"{op} is O(n): it walks, rebuilds or scans the queue; take the "
                            "block's neighbours from prev and next and link them to each other")


def _telling(cls: type) -> type:
    """``cls`` as the served workloads use it: an error in popleft or remove tells the
    queue it was asked on (head first, before the call)."""

    def told(q, op: str, run):
        node, queued = q.next.get(q.HEAD, q.TAIL), []
        while node != q.TAIL and len(queued) < len(q) + 2:
            queued.append(node)
            node = q.next.get(node, q.TAIL)
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
