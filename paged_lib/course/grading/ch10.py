"""Checks for chapter 10 (prefix caching), each against :mod:`paged_lib.engine.prefix_cache`:
named cases, a wrong answer named by the slip that gives it, generated cases (:class:`Prompt`,
:class:`Hit`), then random workloads (:mod:`~.generated`); 10.3 also times ``popleft``/``remove``
at 1,000 and 100,000 blocks; 10.4 tells the first call that differs (pool before, call, answers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from paged_lib.course import grading
from paged_lib.course.grading import generated
from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.generated.numeric import Contrast
from paged_lib.engine.hooks import EngineHooks
from paged_lib.engine.prefix_cache import (
    BlockHash,
    FreeBlockQueue,
    PrefixCachingAllocator,
    allocate_slots,
    block_hashes,
    hash_block_tokens,
    longest_cache_hit,
)

__all__ = ["check_allocate_slots", "check_block_hashes", "check_free_queue",
           "check_longest_cache_hit", "hit_cases", "prompt_cases"]


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


#: extra keys as requests carry them, in their order
_EXTRAS = [(), ("lora-7",), ("salt-9", "lora-7"), ("lora-2", "mm:3f2a", "salt-1"),
           ("mm:9c01", 4, "mm:9c01")]
_SIZES = (16, 5, 3, 2)


@dataclass(frozen=True)
class Prompt:
    """10.1: prompt ``family`` cut to ``length`` tokens, hashed at ``block_size``."""

    seed: int
    family: int
    length: int
    block_size: int
    extras: tuple

    def tokens(self) -> list[int]:
        return [(7919 * t + 104_729 * self.family + 13) % 152_000 for t in range(self.length)]

    def describe(self) -> str:
        t, before = self.tokens(), list(_SIZES[:self.seed % len(_SIZES)])
        again = f" (the same tokens were hashed at block size(s) {before} just before)"
        return (f"{self.length} tokens {t[:5]}{' ...' if self.length > 5 else ''}, block size "
                f"{self.block_size}, extra keys {self.extras}" + (again if before else ""))

    def states(self) -> list[str]:
        return ([f"{len(self.extras)} extra keys"] * (len(self.extras) > 1)
                + ["a text hashed again at another block size"] * bool(self.seed % len(_SIZES))
                + ["token ids past 100,000"] * (max(self.tokens(), default=0) > 100_000))

    def smaller(self) -> Iterator[Prompt]:
        n = self.length
        yield from numeric.fewer(self, length=sorted({x for x in (0, self.block_size, n // 2,
                                                                  n - 1) if 0 <= x < n}))


def prompt_cases(families: int = 10) -> list[Prompt]:
    """Each family's prompt at block sizes 16, 5, 3 and 2, in turn, then a long prompt."""
    out = [Prompt(len(_SIZES) * f + k, f, (9, 16, 30, 31, 47)[f % 5], bs,
                  _EXTRAS[f % len(_EXTRAS)]) for f in range(families)
           for k, bs in enumerate(_SIZES)]
    return out + [Prompt(len(out), families, 20_000, 16, ("lora-7",))]


def check_block_hashes(fn: Callable[..., Any]) -> None:
    """``block_hashes(token_ids, block_size, extra_keys=()) -> list[BlockHash]``."""
    with grading.exercise("10.1"):
        for name, tokens, block_size, extra in _HASH_SCENARIOS:
            _check_hashes(fn, name, tokens, block_size, extra)
        generated.check("block_hashes", fn, "one hash per full block, each chained on the "
                        "one before, with the extra keys")
        numeric.check("10.1", prompt_cases(), lambda p: _check_hashes(
            fn, "generated", p.tokens(), p.block_size, p.extras))


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
                        f"{type(got).__name__}", "return a list with one BlockHash per full block")
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
            what = (f"{where}: block {i}'s hash differs (expected {_short(w)}, got {_short(g)})")
            grading.fail(what, _hash_hint(fn, i, g, got, want, tokens, block_size, extra))


_unseen = itertools.count(1)


def _right_on_new_tokens(fn, tokens: list[int], block_size: int, extra: tuple) -> bool:
    """Is ``fn`` right on ``tokens`` renamed to ids no call has asked about?"""
    base = 10**9 + 10**6 * next(_unseen)
    names = {t: base + k for k, t in enumerate(dict.fromkeys(tokens))}
    fresh = [names[t] for t in tokens]
    try:
        return _call(fn, list(fresh), block_size, extra) == block_hashes(fresh, block_size, extra)
    except Exception:  # noqa: BLE001 - the learner's function: the usual hint then
        return False


def _hash_hint(fn, i, g, got, want, tokens, block_size, extra) -> str:
    """Block ``i``'s hash ``g``: one kept from an earlier call (right on new tokens) or from an
    earlier block of the same tokens (right where no block repeats), else the slip's."""
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
        (True, hash_block_tokens(parent, tokens[:(i + 1) * s], extra), "each hash_block_tokens "
         "call takes only that block's own tokens (the prefix comes in through the parent)"),
        (True, hash_block_tokens(parent, tokens[i * s:(i + 1) * s - 1], extra), "off by one "
         "in the block's slice: block i holds tokens [i * block_size, (i + 1) * block_size)")]:
        if applies and g == guess:
            return hint
    if isinstance(g, BlockHash) and g.token_ids == tuple(chunk) and g.extra_keys != extra:
        return (f"extra keys forgotten or changed: block {i} was hashed with {g.extra_keys}, "
                f"the request's are {extra}: every block takes them as given (order, repeats)")
    if any(h == g for j, h in enumerate(want) if j != i):
        return "the hashes are in the wrong order: one per full block, first block first"
    return (f"block {i}'s hash stands for its own {s} tokens and the extra keys, on top of "
            f"block {i - 1}'s hash" if i else
            "block 0's hash stands for its own tokens and the extra keys, with parent None")


def _short(h: Any) -> str:
    return f"BlockHash(value={h.value:#x}, token_ids={h.token_ids})" if isinstance(
        h, BlockHash) else repr(h)


# ------------------------------------------------------------------ 10.2 longest_cache_hit

@dataclass(frozen=True)
class Hit:
    """10.2: a prompt of ``num_tokens`` whose full blocks are cached as ``pattern`` says:
    ("all", 0), ("prefix", k) or ("hole", j), all but block j."""

    seed: int
    num_tokens: int
    block_size: int
    pattern: tuple[str, int]
    zero: bool = True  # one of the cached blocks is physical block 0

    def cached(self) -> dict[int, int]:
        how, k = self.pattern
        keep = [i for i in range(self.num_tokens // self.block_size) if how == "all"
                or (how == "prefix" and i < k) or (how == "hole" and i != k)]
        ids = random.Random(1002 + self.seed).sample(range(2 ** 31 - 1), len(keep))
        if ids and self.zero:
            ids[len(ids) // 3] = 0  # block 0 is a block
        return dict(zip(keep, ids, strict=True))

    def describe(self) -> str:
        how, k = self.pattern
        return (f"a prompt of {self.num_tokens:,} tokens, block size {self.block_size} "
                f"({self.num_tokens // self.block_size:,} full blocks), cached: "
                + {"all": "every full block", "prefix": f"the first {k}",
                   "hole": f"all but block {k}"}[how])

    def states(self) -> list[str]:
        return (["more than 1,000 cached blocks"] * (self.num_tokens // self.block_size > 1000
                                                     and self.pattern != ("prefix", 0))
                + ["block size 5 or 7"] * (self.block_size in (5, 7)))

    def smaller(self) -> Iterator[Hit]:
        how, k = self.pattern
        for n in (self.num_tokens // 4, self.num_tokens // 2):
            if self.block_size < n < self.num_tokens:
                yield dataclasses.replace(self, num_tokens=n,
                                          pattern=(how, min(k, n // self.block_size - 1)))


def hit_cases() -> list[Hit]:
    """Short prompts at block sizes 5, 7, 16, 1 in every pattern, then long ones."""
    cases = [(n, bs, pattern) for bs in (5, 7, 16, 1) for n in (bs, bs + 1, 3 * bs, 3 * bs + 1, 50)
             for pattern in (("all", 0), ("prefix", 1), ("hole", 0), ("hole", 2))]
    cases += [(n, bs, pattern) for n, bs in ((131_072, 16), (32_768, 16), (20_001, 5))
              for pattern in (("all", 0), ("hole", n // bs - 2))]
    return [Hit(seed, *case) for seed, case in enumerate(cases)]


HIT_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, zero=False), "it passes when no cached block "
             "is physical block 0: block 0 is a block like any other (a miss is lookup(...) "
             "is None, not a falsy answer)"),
    Contrast(lambda p: dataclasses.replace(p, num_tokens=29 * p.block_size // 4, pattern=(
        p.pattern[0], min(p.pattern[1], 5))) if p.num_tokens > 1000 else None,
             "it passes on short prompts and fails on a long one (8,192 blocks): walk the "
             "hashes in a loop, not one call deep per block (Python stops recursion at about "
             "1,000 calls)"),
)


def check_longest_cache_hit(fn: Callable[..., Any]) -> None:
    """``longest_cache_hit(hashes, lookup, num_tokens, block_size) -> list[int]``."""
    with grading.exercise("10.2"):
        numeric.check("10.2", hit_cases(), lambda p: _check_hit(
            fn, p.num_tokens, p.block_size, p.cached()), HIT_CONTRASTS)
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
    where_last = (f"the prompt's last token (token {num_tokens - 1}, counting from 0) is in block "
                  f"{last}, " + ("part-filled" if num_tokens % block_size else "a full block"))
    for wrong, hint in [
        (len(got) > len(want) and got[:len(want)] == want and n > len(want), "every block of "
         "this prompt is cached, yet its last token must still be computed (its logits give "
         f"the first new token): {where_last}, so that block is not a hit"),
        (got == [cache[h] for h in hashes if h in cache] or (len(got) > n and got[:n] == leading),
         "you counted hits past the first miss: the hit is the leading run only"),
        (len(got) < len(want) and got == want[:len(got)], f"you stopped after {len(got)} "
         f"hit(s), the library reads {len(want)}: block {len(got)} is cached and "
         f"{where_last}; every cached block before that one is a hit"),
        (sorted(got) == sorted(want), "the blocks in the order of the hashes (the prompt's order)"),
        (True, "the library reads the blocks lookup finds for the leading hashes, up to the "
         f"first miss, and stops before the block that holds the last token: {where_last}")]:
        grading.expect_true(not wrong, f"expected {want}, got {got}", hint)


# ------------------------------------------------------------------ 10.3 the free queue

_POPLEFT = "paged_lib.engine.prefix_cache.FreeBlockQueue.popleft"

#: name, the queue's blocks at the start, then ("popleft",) / ("remove", b) / ("append", b);
#: removes come first, so that a popleft built on a wrong remove is told about remove
_SCRIPTS: list[tuple[str, list[int], list[tuple]]] = [
    ("remove the head, then the tail, then the middle", [7, 3, 9, 1, 5],
     [("remove", 7), ("remove", 5), ("remove", 9), ("append", 7), ("popleft",), ("remove", 7)]),
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
        calls: list[str] = []  # 10.3's second twin: the library's popleft
        with contextlib.suppress(grading.TwinCalled), grading._refusing_twin(_POPLEFT, calls):
            _check_queue(cls)
        if calls:
            grading.fail(calls[0], "write popleft yourself from the spec: the check compares "
                         "your queue with the library's, so delegating proves nothing")
        generated.check("FreeBlockQueue", _telling(cls), "popleft takes the least recently "
                        "freed block (the front); remove takes out any queued block, whatever "
                        "blocks are around it (block 0 too: a block is queued when it is in "
                        "next, whatever next[block] holds), and relinks its neighbours")


def _try(q: Any, op: tuple) -> tuple[Any, Exception | None]:
    try:
        return getattr(q, op[0])(*op[1:]), None
    except Exception as err:  # noqa: BLE001 - compared with the library's
        return None, err


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
            (want, refused), (got, err) = (_try(x, op) for x in (lib, q))
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


def _same_links(q: Any, lib: FreeBlockQueue, call: str, where: str) -> None:
    for name in ("next", "prev"):
        mine, want = dict(getattr(q, name)), dict(getattr(lib, name))
        grading.expect_true(not set(mine) - set(want), f"{where}: block(s) "
                            f"{sorted(set(mine) - set(want), key=str)} are no longer queued "
                            "but still have next/prev entries", "delete the taken block's "
                            "own next and prev entries too, or it still counts as queued")
        k = min((k for k in set(mine) | set(want) if mine.get(k, ()) != want.get(k, ())),
                key=str, default=None)
        grading.expect_true(k is None, f"{where}: {name}[{k!r}] is {mine.get(k, 'missing')!r}, the "
                            f"library's {want.get(k, 'missing')!r}", _LINKS.get(
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


# ------------------------------------------------------------------ 10.4 allocate_slots

@dataclass(frozen=True)
class State:
    """A caching pool, comparable: free queue (head first), ref counts, hashes, blocks per value."""

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
    cached = lambda h: f"tokens {h.token_ids[0]}..{h.token_ids[-1]}" + (
        f" {h.extra_keys}" if h.extra_keys else "")
    empty = sum(not bs for _, bs in s.by_value)
    return {"free queue (head first)": str(list(s.free)),
            "held (block: ref count)": str({b: r for b, r in enumerate(s.refs) if r} or "none"),
            "cached": "{" + ", ".join(f"{b}: {cached(h)}" for b, h in s.hashes) + "}",
            "cached_blocks (blocks per hash value)": str(
                [list(bs) for _, bs in s.by_value if len(bs) > 1] or "one each")
            + (f", {empty} hash value(s) kept with an empty list" if empty else "")}


def diagnose(ask: Ask, want: Any, want_state: State, got: Any, got_state: State) -> str:
    if not (isinstance(got, tuple) and len(got) == 2):  # a crash, or not a pair
        return ("a miss: nothing is cached under that hash value; pool.lookup(h) is None then"
                if isinstance(got, KeyError) and got.args[0] in {h.value for h in ask.hashes}
                else "a fresh block never cached has no hash: pool.block_hash.pop(block, None)"
                if isinstance(got, KeyError) else "a hit another table holds (ref count > 0) "
                "is not in the free queue: take it out only when its count is 0"
                if "not in the free queue" in str(got) else f"your function raised {got!r}: "
                "rerun it on the pool above" if isinstance(got, Exception) else "return a "
                "pair: (the table's blocks, the number of tokens the cache supplied)")
    (blocks, computed), (wb, wc), bs = got, want, ask.block_size
    cached_at = dict(ask.before.hashes)
    leading = next((k for k, h in enumerate(ask.hashes) if h not in cached_at.values()),
                   len(ask.hashes))
    counted = isinstance(computed, int)
    if computed != wc or blocks[:wc // bs] != wb[:wc // bs]:
        adopted = blocks[:computed // bs] if counted else []
        last = (len(ask.token_ids) - 1) // bs
        return next((hint for wrong, hint in [
            (wc and blocks == wb[wc // bs:], "the table is the whole text's: the hit's blocks "
             "first, then the fresh ones"),
            (counted and computed > wc and computed == leading * bs, "a full hit: every "
             "block is cached, yet the last token must be computed (its logits give the next "
             "token): at most (len(token_ids) - 1) // block_size blocks are adopted"),
            (any(cached_at.get(b) not in (None, h) and cached_at[b].value == h.value
                 for b, h in zip(adopted, ask.hashes, strict=False)), "a block whose hash has the "
             "same value is not a hit: compare the whole BlockHash, as pool.lookup does"),
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
             "a hit must be a leading run: after a miss, later hashes cannot be used")] if wrong),
            "the hit is the cached blocks of the longest run of leading hashes, in order, "
            "stopping at the first miss; num_computed_tokens their tokens")
    now = min(len(ask.token_ids) - wc, ask.max_new_tokens)
    if len(blocks) != len(wb):
        return (f"after its hit of {wc} tokens this request computes {now} now (its budget counts "
                f"only the tokens it computes): the table covers tokens 0..{wc + now - 1}, "
                f"{len(wb)} blocks; the rest of a chunked prompt takes its blocks in later steps")
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
        b = next(i for i, g in enumerate(got_state.refs) if g != want_state.refs[i])
        return (f"block {b}'s reference count is {got_state.refs[b]}, the library's "
                f"{want_state.refs[b]}: a hit takes one more reference, a fresh block starts at 1")
    if got_state.free != want_state.free:
        left = sorted(set(got_state.free) & set(wb))
        return (f"block {left[0]} is in your table and still in the free queue: a hit on a "
                "block with ref count 0 takes it out of the queue" if left else
                "only the blocks of the table leave the free queue; the others keep their order")
    got_h, want_h = dict(got_state.hashes), dict(want_state.hashes)
    stale = [b for b in wfresh if b in cached_at and got_h.get(b) == cached_at[b] != want_h.get(b)]
    full = (wc + now) // bs
    dup = [b for b in wb[:full] if b not in got_h and want_h[b] in cached_at.values()]
    got_v, want_v = dict(got_state.by_value), dict(want_state.by_value)
    evicted = [b for b in wfresh if b in cached_at and b in got_v.get(cached_at[b].value, ())]
    value = cached_at[evicted[0]].value if evicted else None
    unlisted = [b for b, h in got_state.hashes if b not in got_v.get(h.value, ())
                and b in want_v.get(h.value, ())]
    return next((hint() for wrong, hint in [
        (stale, lambda: f"block {stale[0]} was cached and is reused: it loses its old hash "
         "(eviction), in block_hash and in cached_blocks"),
        (any(b in want_h and got_h.get(b, want_h[b]) != want_h[b] for b in wb), lambda:
         "hashes[i] names block i of the table, the hit's blocks counted: cache table[i] under it"),
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
        (evicted, lambda: f"block {evicted[0]} was evicted but cached_blocks still lists it under "
         f"its old value, and block(s) {sorted(set(want_v.get(value, ())) - set(got_v[value]))} "
         "left the list instead: take out the very block evicted (list.remove(block)), not the "
         "list's first or last"),
        (unlisted, lambda: f"block {unlisted[0]} is still cached (block_hash), but "
         "cached_blocks no longer lists it under its value, which lists every block cached "
         "under it, oldest first: an eviction takes out only the block reused"),
        (got_state.by_value != want_state.by_value, lambda: "cached_blocks[value] lists every "
         "block cached under that value, oldest first: a block recomputed with the same hash "
         "is added after the others, a hit is not added again")] if wrong),
        "the pool after the call differs from the library's")


def compare(fn: Callable, ask: Ask) -> State:
    want, want_state = ask.answer(allocate_slots)
    try:
        got, got_state = ask.answer(fn)
    except (NotImplementedError, AssertionError):  # a stub, a verdict
        raise
    except Exception as err:  # noqa: BLE001 - the learner's crash, told with the pool
        got, got_state = err, want_state
    if got == want and got_state == want_state:
        return want_state
    mine, lib, before = _parts(got_state), _parts(want_state), _parts(ask.before)
    after = "; ".join(f"{k}: the library's {lib[k]}, yours {mine[k]}" for k in lib
                      if mine[k] != lib[k])
    found = [b for h in ask.hashes for b, c in ask.before.hashes if c == h]
    grading.fail(f"{ask.where}: the pool holds " + ", ".join(f"{k} {v}" for k, v in before.items())
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
    """(what, the pool, the calls made on it in turn: tokens, extra keys, block size, budget)."""
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
    # a prompt prefilled and freed, asked again longer under a chunked budget of 3
    chunked, (done,) = _prefilled(8, [(a, ())])
    for block in done[::-1]:
        chunked.free(block)
    return [
        ("the same 4 tokens asked with extra keys ('lora-2',) then ('lora-1',); another "
         "block's hash has lora-2's value", collision,
         [(a[:4] + [2], ("lora-2",), 4, 5), (a[:4] + [3], ("lora-1",), 4, 5)]),
        ("two blocks cached under one hash (a prompt asked again while it ran: blocks 2 "
         "and 3), then fresh blocks evict the newer copy, block 3, not the oldest", twins,
         [(list(range(700, 710)), (), 4, 10), (a, (), 4, 12)]),
        ("LRU eviction took a prefix's first block before its later ones: A's block 0 "
         "evicted, blocks 1 and 2 still cached and free; then block size 3 (not a power "
         "of two)", orphans, [(a + [1], (), 4, 5), (a[:7], (), 3, 7), (a[:7] + [2], (), 3, 5)]),
        ("a hit of 3 blocks, then a first chunk of 3 tokens (chunked prefill: the budget "
         "counts only the tokens computed)", chunked, [(a + [1, 2, 3, 4, 5], (), 4, 3)]),
    ]


def check_allocate_slots(fn: Callable[..., Any]) -> None:
    """``allocate_slots(pool, token_ids, hashes, block_size, max_new_tokens)``."""
    with grading.exercise("10.4"):
        for what, pool, calls in edge_states():
            for k, (tokens, extra, bs, budget) in enumerate(calls):
                ask = Ask(f"edge state '{what}'" + (f", call {k + 1}" if len(calls) > 1
                                                    else ""), snapshot(pool), tuple(tokens),
                          tuple(block_hashes(tokens, bs, extra)), bs, budget)
                pool = build(compare(fn, ask))

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
