"""Exercise 10.3: the LRU free queue's ``popleft`` and ``remove``, in a subclass of the
library's :class:`~paged_lib.engine.prefix_cache.FreeBlockQueue` (its ``next``/``prev``
dicts and ``_len``). Scripted operations run on the learner's queue and the library's:
after each, the answer (or the error), ``next``, ``prev`` and ``len`` must be the
library's. Then the time per call in queues of 1,000 and 100,000 blocks (O(1) stays
flat), then random workloads with the class as the caching pool's free queue
(:mod:`paged_lib.course.grading.generated`, small pools: blocks evicted, hit while free,
reused in any order).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from paged_lib.course import grading
from paged_lib.course.grading import generated
from paged_lib.engine.prefix_cache import FreeBlockQueue

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
