"""Exercise 10.3: the LRU free queue's ``popleft`` and ``remove``.

The learner's class keeps the library's representation
(:class:`paged_lib.engine.prefix_cache.FreeBlockQueue`: ``next`` and ``prev`` dicts between
a ``HEAD`` and a ``TAIL`` sentinel, and a count ``_len``) and writes the two methods that
take a block out. The check replays scripted operations next to a plain list and, after
every one, walks the links both ways (they must agree, and hold exactly the queued
blocks); then it counts the dict operations one ``remove`` and one ``popleft`` make in a
queue of 100,000 blocks (a walk or a rebuild is O(n), the real thing a handful); then it
serves random workloads with the class as the caching pool's free queue, next to the
library's (:mod:`paged_lib.course.grading.generated`, on small pools, where blocks are
evicted, hit while free and reused in any order).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
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


def check_free_queue(cls: Any) -> None:
    """``cls``: a :class:`FreeBlockQueue` subclass with its own ``popleft`` and ``remove``."""
    with grading.exercise("10.3"):
        calls: list[str] = []
        try:
            with grading._refusing_twin(_POPLEFT, calls):  # 10.3's second twin
                _check(cls)
        except grading.TwinCalled:
            pass
        if calls:
            grading.fail(calls[0], "write popleft yourself from the spec: the check compares "
                         "your queue with the library's, so delegating proves nothing")
        generated.check("FreeBlockQueue", _telling(cls), "popleft takes the least recently "
                        "freed block (the front); remove takes out any queued block, whatever "
                        "blocks are around it (block 0 too: a block is queued when it is in "
                        "next, whatever next[block] holds), and relinks its neighbours")


def _telling(cls: type) -> type:
    """``cls`` as the served workloads use it: an error in popleft or remove tells the
    queue it was asked on (walked from HEAD, before the call)."""

    def told(q, op: str, run):
        queued = _walk(q.next, q.HEAD, q.TAIL, len(q) + 2)[0]
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


def _check(cls: Any) -> None:
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
        _replay(cls, name, start, ops)
    _check_constant_time(cls)
    _check_scaling(cls)


def _replay(cls, name: str, start: list[int], ops: list[tuple]) -> None:
    q = cls(start)
    model = list(start)
    _check_links(q, model, f"scenario '{name}', a new queue of {start}")
    for k, op in enumerate(ops):
        where = f"scenario '{name}', step {k + 1} {_op_str(op)} on {model}"
        if op[0] == "append":
            q.append(op[1])
            model.append(op[1])
        elif op[0] == "popleft":
            _popleft(q, model, where)
        else:
            _remove(q, model, op[1], where)
        _check_links(q, model, where, op)


def _op_str(op: tuple) -> str:
    return f"{op[0]}({', '.join(map(str, op[1:]))})"


def _popleft(q, model: list[int], where: str) -> None:
    if not model:
        try:
            got = q.popleft()
        except IndexError:
            return
        except Exception as err:  # noqa: BLE001 - named in the verdict
            grading.fail(f"{where}: popleft raised {type(err).__name__}: {err}",
                         "popleft on an empty queue raises IndexError (as "
                         "collections.deque does) and changes nothing")
        grading.fail(f"{where}: popleft on an empty queue returned {got!r}",
                     "popleft on an empty queue raises IndexError: the block after HEAD "
                     "is then the TAIL sentinel, not a block")
    got = q.popleft()
    if got == model[-1] and len(model) > 1:
        grading.fail(f"{where}: popleft returned block {got}, expected {model[0]}",
                     "popleft takes the head (the block freed longest ago: LRU), not the "
                     "tail")
    grading.expect_equal(got, model[0], f"{where}: popleft's block",
                         "popleft returns the block right after HEAD")
    model.pop(0)


def _remove(q, model: list[int], block: int, where: str) -> None:
    if block not in model:
        before = (dict(q.next), dict(q.prev), len(q))
        try:
            q.remove(block)
        except ValueError:
            pass
        except Exception as err:  # noqa: BLE001 - named in the verdict
            grading.fail(f"{where}: remove raised {type(err).__name__}: {err}",
                         "remove of a block that is not in the queue raises ValueError "
                         "(saying so) and changes nothing")
        else:
            grading.fail(f"{where}: remove of block {block}, which is not in the queue, "
                         "raised nothing",
                         "remove of a block that is not in the queue raises ValueError: "
                         "unlinking it anyway corrupts the links")
        grading.expect_true((dict(q.next), dict(q.prev), len(q)) == before,
                            f"{where}: the refused remove changed the queue",
                            "check first, then change: a refused remove leaves the links "
                            "as they were")
        return
    q.remove(block)
    model.remove(block)


def _walk(links: dict, start: Any, stop: Any, limit: int) -> tuple[list[Any], str | None]:
    """Follow ``links`` from ``start`` to ``stop``; (blocks met, what went wrong or None)."""
    out, node = [], start
    for _ in range(limit + 2):
        if node not in links:
            return out, f"it reaches {node!r}, which has no link onwards"
        node = links[node]
        if node == stop:
            return out, None
        out.append(node)
    return out, "it never ends (a cycle)"


def _check_links(q, model: list[int], where: str, op: tuple | None = None) -> None:
    head, tail = q.HEAD, q.TAIL
    n = len(model) + 4
    forward, f_err = _walk(q.next, head, tail, n)
    backward, b_err = _walk(q.prev, tail, head, n)
    backward.reverse()
    popped = op is not None and op[0] == "popleft"
    removed = op[1] if op is not None and op[0] == "remove" else None
    if f_err or forward != model:
        hint = ("remove left a neighbour pointing at the removed block: next of the block "
                "before it must point at the block after it" if removed in forward
                else "after popleft, next[HEAD] must be the new head" if popped
                else "next must lead from HEAD through the queued blocks in order to TAIL")
        grading.fail(f"{where}: walking next from HEAD gives {forward}"
                     f"{' (' + f_err + ')' if f_err else ''}, expected {model}", hint)
    if b_err or backward != model:
        hint = ("popleft did not unlink the new head's prev: prev of the new head must be "
                "HEAD, or a walk back from TAIL still meets the block you took"
                if popped else
                "remove left a neighbour pointing at the removed block: prev of the block "
                "after it must point at the block before it" if removed is not None
                else "prev must lead back from TAIL through the queued blocks to HEAD")
        grading.fail(f"{where}: walking prev back from TAIL gives {backward}"
                     f"{' (' + b_err + ')' if b_err else ''}, expected {model} (next says "
                     f"{forward}): the two directions disagree", hint)
    extra = sorted((set(q.next) - {head}) - set(model), key=str) + \
        sorted((set(q.prev) - {tail}) - set(model), key=str)
    if extra:
        grading.fail(f"{where}: block(s) {sorted(set(extra), key=str)} are no longer queued "
                     "but still have next/prev entries",
                     "delete the taken block's own next and prev entries too: while they "
                     "exist it counts as queued ('in' says so, append refuses it)")
    grading.expect_equal(len(q), len(model), f"{where}: len(queue)",
                         "keep _len in step: popleft and remove each take one block out")


class _Counting(dict):
    """A dict that counts every read, write and element iterated (``ops[0]``)."""

    def __init__(self, data: dict, ops: list[int]):
        super().__init__(data)
        self.ops = ops

    def _tick(self, n: int = 1) -> None:
        self.ops[0] += n

    def __getitem__(self, k):
        self._tick()
        return super().__getitem__(k)

    def __setitem__(self, k, v):
        self._tick()
        super().__setitem__(k, v)

    def __delitem__(self, k):
        self._tick()
        super().__delitem__(k)

    def __contains__(self, k):
        self._tick()
        return super().__contains__(k)

    def get(self, k, default=None):
        self._tick()
        return super().get(k, default)

    def pop(self, k, *default):
        self._tick()
        return super().pop(k, *default)

    def _each(self, items: Iterator) -> Iterator:
        for x in items:
            self._tick()
            yield x

    def __iter__(self):
        return self._each(super().__iter__())

    def keys(self):
        return list(self._each(iter(super().keys())))

    def values(self):
        return list(self._each(iter(super().values())))

    def items(self):
        return list(self._each(iter(super().items())))

    def copy(self):
        self._tick(len(self))
        return dict(super().items())


_BIG = 100_000


def _check_constant_time(cls) -> None:
    q = cls(range(_BIG))
    where = f"a queue of {_BIG:,} blocks"
    for op, arg in (("remove", _BIG // 2), ("popleft", None), ("remove", _BIG - 1),
                    ("remove", 1), ("popleft", None)):
        ops = [0]
        q.next, q.prev = _Counting(q.next, ops), _Counting(q.prev, ops)
        if op == "remove":
            q.remove(arg)
        else:
            q.popleft()
        if ops[0] > 40:
            grading.fail(f"{where}: one {op}({'' if arg is None else arg}) made {ops[0]:,} "
                         "reads and writes of next/prev",
                         f"{op} walked or rebuilt the queue (O(n), like list.remove): take "
                         "the block's neighbours from prev and next and link them to each "
                         "other, a constant number of dict operations")
        q.next, q.prev = dict(dict.items(q.next)), dict(dict.items(q.prev))  # uncounted
    grading.expect_equal(len(q), _BIG - 5, f"{where}: len after 5 blocks taken out",
                         "keep _len in step: popleft and remove each take one block out")


def _seconds_per_op(q, op: str, blocks: list[int]) -> float:
    start = time.perf_counter()
    for b in blocks:
        if op == "remove":
            q.remove(b)
        else:
            q.popleft()
    return (time.perf_counter() - start) / len(blocks)


def _check_scaling(cls) -> None:
    """Time per op in a queue of 100,000 blocks against one of 1,000 (best of 5 runs of
    100 ops each, the sizes taking turns): O(1) stays flat, a scan (a list kept beside
    the links, say) grows about 100x. Catches what no dict count sees."""
    sizes = (1_000, _BIG)
    queues = {n: cls(range(n)) for n in sizes}
    for op in ("remove", "popleft"):
        runs: dict[int, list[float]] = {n: [] for n in sizes}
        for r in range(5):  # the sizes take turns, so a busy spell slows both
            for n in sizes:
                lo = n // 2 + 100 * r if op == "remove" else 0
                runs[n].append(_seconds_per_op(queues[n], op, list(range(lo, lo + 100))))
        best = {n: min(t) for n, t in runs.items()}
        ratio = best[_BIG] / max(best[sizes[0]], 1e-9)
        if ratio > 20 and best[_BIG] > 20e-6:
            grading.fail(f"one {op} takes {best[_BIG] * 1e6:,.0f} us in a queue of {_BIG:,} "
                         f"blocks and {best[sizes[0]] * 1e6:,.1f} us in one of "
                         f"{sizes[0]:,}: {ratio:,.0f}x",
                         f"{op} is O(n): something scans the queue (list.remove or a search "
                         "in a list kept beside the links?); the links alone find the "
                         "neighbours in O(1)")

