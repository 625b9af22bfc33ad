"""Checks for chapter 03 (block tables).

Each check runs the learner's code next to the library's :mod:`paged_lib.blocks` on
scripted scenarios, step by step. This module holds the scenarios, the checks and the
chapter's demo; the step-by-step comparison of ``append_token`` and ``fork`` (a toy KV
store that applies every ``Slot``, and the hints that name each mistake) is
:mod:`paged_lib.course.grading.ch03_replay`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paged_lib.blocks import BlockAllocator, BlockTable, Slot
from paged_lib.course import grading
from paged_lib.course.grading.ch03_replay import replay
from paged_lib.course.grading.generated.small_blocks import block_stage
from paged_lib.course.grading.toy_pool import busy_pool, pool_state

# ------------------------------------------------------------------ 03.1 append_token

# (name, pool size, free list or None for a fresh pool, block size, steps); steps:
# ("append", name, count) / ("fork", parent, child) / ("free", name)
_APPEND_SCENARIOS: list[tuple[str, int, tuple[int, ...] | None, int, list[tuple]]] = [
    ("the 40-token example (block size 16, free list 5, 2, 9)", 12, (5, 2, 9), 16,
     [("append", "A", 40)]),
    ("fork a 6-token sequence (block size 4), then both write", 6, None, 4,
     [("append", "parent", 6), ("fork", "parent", "child"), ("append", "child", 1),
      ("append", "parent", 1), ("append", "child", 3), ("append", "parent", 3)]),
    ("fork when the last block is exactly full (block size 4, 8 tokens)", 6, None, 4,
     [("append", "parent", 8), ("fork", "parent", "child"), ("append", "child", 2),
      ("append", "parent", 2), ("free", "parent"), ("append", "child", 3)]),
    # Not 03.4's scenario (40 tokens, free list 5, 2, 9, 10, 11): a ❌ here prints the
    # expected slots, which must not be that exercise's answers.
    ("two forks of a 21-token prompt (block size 8, free list 7, 3, 11, 1, 4)", 12,
     (7, 3, 11, 1, 4), 8,
     [("append", "parent", 21), ("fork", "parent", "s1"), ("fork", "parent", "s2"),
      ("append", "s1", 1), ("append", "s2", 1), ("append", "parent", 1)]),
    ("copy-on-write with no free block (pool of 2, block size 2)", 2, None, 2,
     [("append", "parent", 3), ("fork", "parent", "child"), ("append", "child", 1),
      ("append", "parent", 1), ("free", "child"), ("append", "parent", 1),
      ("append", "parent", 1)]),
    ("block size 1, with a fork", 5, None, 1,
     [("append", "A", 2), ("fork", "A", "B"), ("append", "B", 2), ("append", "A", 1)]),
]


def check_append_token(append_token: Callable[[BlockTable], Any]) -> None:
    """03.1: ``append_token(table) -> Slot`` with on-demand allocation and copy-on-write."""
    with grading.exercise("03.1"):
        for scenario in _APPEND_SCENARIOS:
            replay(*scenario, append=append_token, fork=BlockTable.fork)
        block_stage("03.1", append_token, BlockTable.fork)


# ------------------------------------------------------------------ 03.2 fork

_FORK_SCENARIOS: list[tuple[str, int, None, int, list[tuple]]] = [
    ("fork a 6-token sequence (block size 4)", 8, None, 4,
     [("append", "parent", 6), ("fork", "parent", "child"), ("append", "child", 1),
      ("append", "parent", 3), ("free", "parent"), ("append", "child", 2)]),
    ("fork twice, then fork the fork (block size 2)", 12, None, 2,
     [("append", "p", 5), ("fork", "p", "a"), ("fork", "p", "b"), ("fork", "a", "c"),
      ("append", "c", 1), ("append", "a", 2), ("free", "p"), ("free", "a"),
      ("append", "b", 1), ("free", "b"), ("append", "c", 1)]),
    ("fork an empty table", 4, None, 4,
     [("fork", "e", "f"), ("append", "f", 1), ("append", "e", 1)]),
]


def check_fork(fork: Callable[[BlockTable], Any]) -> None:
    """03.2: ``fork(table) -> BlockTable`` sharing every block and allocating nothing."""
    with grading.exercise("03.2"):
        for scenario in _FORK_SCENARIOS:
            replay(*scenario, append=BlockTable.append_token, fork=fork)
        block_stage("03.2", BlockTable.append_token, fork)


# ------------------------------------------------------------------ 03.3 free_block


class _LearnerAllocator(BlockAllocator):
    """The library's allocator with the learner's ``free_block`` as its ``free``."""

    def __init__(self, num_blocks: int, free_block: Callable[..., Any]):
        super().__init__(num_blocks)
        self._free_block = free_block

    def free(self, block: int) -> None:
        self._free_block(block, self.ref_counts, self.free_block_ids)


def check_free_block(free_block: Callable[..., Any]) -> None:
    """03.3: ``free_block(block, ref_counts, free_block_ids) -> None``."""
    with grading.exercise("03.3"):
        _check_free_steps(free_block)
        _check_free_lifecycle(free_block)


def _expect_state(alloc, refs, free, what, hint_refs, hint_free):
    got_refs, got_free = pool_state(alloc)
    grading.expect_equal(got_refs, refs, f"{what}: ref_counts", hint_refs)
    grading.expect_equal(got_free, free, f"{what}: free_block_ids", hint_free)


def _check_free_steps(free_block):
    alloc = _LearnerAllocator(4, free_block)
    for _ in range(4):
        alloc.allocate()  # every block in use, free list empty
    alloc.free(1)
    _expect_state(alloc, [1, 0, 1, 1], [1], "blocks 0-3 in use, then free(1)",
                  "free drops one reference: ref_counts[block] -= 1",
                  "a block whose count reaches 0 goes back on the free list")
    alloc.incref(0)
    alloc.free(0)
    _expect_state(alloc, [1, 0, 1, 1], [1], "block 0 held twice (incref), then free(0)",
                  "free drops one reference (ref_counts[block] -= 1): block 0 had two "
                  "holders, so one remains",
                  "block 0 still has a holder (count 1): it must not go back on the free "
                  "list yet, or a new request would overwrite live tokens")
    alloc.free(0)
    _expect_state(alloc, [0, 0, 1, 1], [1, 0], "then free(0) again (its last holder)",
                  "free drops one reference",
                  "the last holder returns the block to the *right* end of the free list "
                  "(allocate() takes from the left, so the block freed longest ago is "
                  "reused first)")
    for bad, why, hint in [
        (0, "block 0 is already free: a double free",
         "refuse a block whose count is already 0 (ValueError), before changing anything; "
         "otherwise it would sit on the free list twice and two requests would write "
         "into it"),
        (4, "block 4 does not exist in a pool of 4",
         "refuse blocks outside 0 .. len(ref_counts) - 1 with a ValueError"),
        (-1, "block -1 does not exist",
         "Python reads ref_counts[-1] as the last block: refuse negative blocks yourself "
         "with a ValueError"),
    ]:
        before = pool_state(alloc)
        grading.expect_value_error(alloc.free, (bad,), f"free({bad}) ({why})", hint)
        grading.expect_equal(pool_state(alloc), before,
                             f"state after the refused free({bad})",
                             "raise before changing ref_counts or free_block_ids")


def _check_free_lifecycle(free_block):
    """Fork, copy-on-write and frees through BlockTable, against the library."""
    ref_alloc, alloc = BlockAllocator(6), _LearnerAllocator(6, free_block)
    script: list[tuple[str, Callable[[dict[str, BlockTable]], None]]] = [
        ("parent takes 6 tokens (block size 4)",
         lambda t: [t["parent"].append_token() for _ in range(6)]),
        ("child = parent.fork()", lambda t: t.__setitem__("child", t["parent"].fork())),
        ("child appends a token (copy-on-write frees its share of block 1)",
         lambda t: t["child"].append_token()),
        ("parent.free()", lambda t: t["parent"].free()),
        ("child.free()", lambda t: t["child"].free()),
    ]
    ref = {"parent": BlockTable(ref_alloc, 4)}
    mine = {"parent": BlockTable(alloc, 4)}
    for what, action in script:
        action(ref)
        action(mine)
        _expect_state(alloc, *pool_state(ref_alloc), f"after '{what}'",
                      "each free drops exactly one reference",
                      "only a block whose count reaches 0 goes back, on the right end")
    grading.expect_equal(alloc.num_free, 6, "free blocks after every table is freed",
                         "every block must come back once its last holder frees it")


# ------------------------------------------------------------------ 03.4 predictions

PREDICTION_KEYS = ("refs after the forks", "child 1's slot", "child 2's slot",
                   "parent's slot", "refs at the end")

_PREDICTION_HINTS = {
    "refs after the forks": "a fork adds one holder to every block of the table it forks",
    "child 1's slot": "block 9 is shared and only half full: writing in place would change "
                      "the other sequences' tokens, so the child first copies it into the "
                      "next free block",
    "child 2's slot": "block 9 is still shared after child 1 copied it away",
    "parent's slot": "after both children copied block 9 away, how many holders does it "
                     "have? A block with one holder is written in place",
    "refs at the end": "each copy-on-write took one reference off block 9 and gave the "
                       "new block one; blocks 5 and 2 were never written",
}


def prediction_scenario() -> dict[str, Any]:
    """Run the exercise's scenario with the library and return the true answers."""
    allocator = busy_pool(12, (5, 2, 9, 10, 11))
    parent = BlockTable(allocator, block_size=16)
    for _ in range(40):
        parent.append_token()  # blocks [5, 2, 9], the last filled 8/16
    child1, child2 = parent.fork(), parent.fork()
    watched = (5, 2, 9, 10, 11)
    answers: dict[str, Any] = {
        "refs after the forks": {b: allocator.refcount(b) for b in (5, 2, 9)}}
    answers["child 1's slot"] = child1.append_token()
    answers["child 2's slot"] = child2.append_token()
    answers["parent's slot"] = parent.append_token()
    answers["refs at the end"] = {b: allocator.refcount(b) for b in watched}
    return answers


def _as_tuple(slot: Any) -> Any:
    if isinstance(slot, Slot):
        return (slot.block, slot.offset, slot.copy)
    return slot


def check_predictions(predict: Callable[[], dict[str, Any]]) -> None:
    """03.4: ``predict() -> dict`` with the keys of :data:`PREDICTION_KEYS`."""
    with grading.exercise("03.4"):
        got = predict()
        grading.expect_true(isinstance(got, dict), f"predict() returned {type(got).__name__}, "
                            "expected a dict", f"use the keys {list(PREDICTION_KEYS)}")
        missing = [k for k in PREDICTION_KEYS if k not in got]
        grading.expect_true(not missing, f"missing keys: {missing}",
                            f"use exactly the keys {list(PREDICTION_KEYS)}")
        answers = prediction_scenario()
        for key in PREDICTION_KEYS:
            expected, mine = answers[key], got[key]
            if isinstance(expected, Slot):
                ok = _as_tuple(mine) == _as_tuple(expected)
            else:
                ok = isinstance(mine, dict) and dict(mine) == expected
            if not ok:
                grading.fail(f"{key}: expected {expected!r}, got {mine!r}",
                             _prediction_hint(key, expected, mine))


def _prediction_hint(key: str, expected: Any, mine: Any) -> str:
    """The key's hint, or the one field of a slot (or the form of an answer) that is off."""
    if not isinstance(expected, Slot):
        if not isinstance(mine, dict):
            return (f"give the counts as a dict {{block: count}}, one entry per block "
                    f"asked: {sorted(expected)}")
        if set(mine) != set(expected):
            return f"give one count for each of the blocks {sorted(expected)}, no others"
        return _PREDICTION_HINTS[key]
    shape = _as_tuple(mine)
    if not (isinstance(shape, tuple) and len(shape) == 3):
        return "give a slot as Slot(block, offset, copy), copy=(src, dst) or None"
    block, offset, copy = shape
    if offset != expected.offset and block == expected.block and copy == expected.copy:
        return (f"the new token is token 40 of the sequence (counting from 0): it goes at "
                f"offset 40 % 16 = {expected.offset} of the last block")
    if expected.copy and copy == expected.copy[::-1]:
        return ("copy=(src, dst): src is the shared block the token's predecessors are "
                "copied from, dst the new block")
    if expected.copy and isinstance(copy, tuple) and copy[:1] == expected.copy[:1] and \
            block != expected.block:
        return ("a copy-on-write takes the next block on the free list (5, 2, 9 went to the "
                "prompt, so 10, then 11), and the token is written into the copy")
    return _PREDICTION_HINTS[key]


# ------------------------------------------------------------------ the chapter's demo


def run_demo(append_token: Callable[..., Any], fork: Callable[..., Any],
             free_block: Callable[..., Any]) -> list[Any]:
    """The chapter's two scenarios, driven by the learner's table and allocator.

    Prints whether every frame matches the library's, and returns the figures (the
    decode loop with three requests, then parallel sampling with copy-on-write).
    """
    from paged_lib.course.viz import blocks as viz

    learner_table = type("YourBlockTable", (BlockTable,),
                         {"append_token": append_token, "fork": fork})
    frames = grading.on_learner_code(
        lambda: (list(viz.grow_requests(table_cls=learner_table,
                                        allocator=_LearnerAllocator(5, free_block))),
                 viz.fork_and_write(table_cls=learner_table,
                                    allocator=_LearnerAllocator(8, free_block))),
        "exercises 03.1-03.3", "the chapter's drawings driven by your table and allocator")
    if frames is None:
        return []
    grown, forked = frames
    same = grown == list(viz.grow_requests()) and forked == viz.fork_and_write()
    print(f"your code drove {len(grown) + len(forked)} frames; "
          f"{'every frame equals' if same else 'some frames differ from'} the library's")
    finished = next(i for i, s in enumerate(grown) if "finished" in s.caption)
    return [viz.draw_frames([grown[finished], grown[finished + 1]]),
            viz.draw_frames([forked[1], forked[2], forked[4]])]
