"""Checks for chapter 03 (block tables).

Each check runs the learner's code next to the library's :mod:`paged_lib.blocks` on a
few scripted scenarios, step by step, and reports the first step where they disagree
(wrong slot, a block not recorded, a leaked block, a wrong free list) with a hint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paged_lib import grading
from paged_lib.blocks import BlockAllocator, BlockTable, OutOfBlocks, Slot


def _busy_pool(num_blocks: int, free_in_order: tuple[int, ...] | None) -> BlockAllocator:
    """A pool whose free list is exactly ``free_in_order`` (None: a fresh pool)."""
    allocator = BlockAllocator(num_blocks)
    if free_in_order is not None:
        for _ in range(num_blocks):
            allocator.allocate()
        for b in free_in_order:
            allocator.free(b)
    return allocator


# ------------------------------------------------------------------ 03.1 append_token

# name, pool size, free list (None: fresh), block size, appends as (request, count)
_APPEND_SCENARIOS = [
    ("the 40-token example (block size 16, free list 5, 2, 9)", 12, (5, 2, 9), 16,
     [("A", 40)]),
    ("a block filled exactly (block size 4, 8 tokens)", 4, None, 4, [("A", 8)]),
    ("block size 1", 3, None, 1, [("A", 3)]),
    ("three requests taking turns (block size 3)", 8, None, 3,
     [("A", 1), ("B", 1), ("C", 1)] * 4 + [("A", 3)]),
    ("the pool runs out (2 blocks of 2, 5 tokens)", 2, None, 2, [("A", 5)]),
]


def _slot_str(slot: Any) -> str:
    if isinstance(slot, Slot):
        return f"Slot(block={slot.block}, offset={slot.offset})"
    return repr(slot)


def check_append_token(append_token: Callable[..., Any]) -> None:
    """``append_token(block_table, num_tokens, allocator, block_size) -> Slot``."""
    with grading.exercise("03.1", "Allocate on demand"):
        for scenario in _APPEND_SCENARIOS:
            _run_append_scenario(append_token, *scenario)


def _run_append_scenario(append_token, name, num_blocks, free_list, block_size, appends):
    ref_alloc = _busy_pool(num_blocks, free_list)
    alloc = _busy_pool(num_blocks, free_list)
    ref: dict[str, BlockTable] = {}
    mine: dict[str, list[int]] = {}
    step = 0
    for request, count in appends:
        for _ in range(count):
            step += 1
            table = ref.setdefault(request, BlockTable(ref_alloc, block_size))
            block_table = mine.setdefault(request, [])
            n = table.num_tokens
            where = f"scenario '{name}', step {step} ({request}'s token {n})"
            try:
                expected = table.append_token()
            except OutOfBlocks:
                expected = None
            before = list(block_table)
            try:
                got = append_token(block_table, n, alloc, block_size)
            except OutOfBlocks as err:
                if expected is not None:
                    grading.fail(f"{where}: your code ran out of blocks ({err}), but "
                                 f"expected {_slot_str(expected)}",
                                 "allocate only when the last block is full or there is "
                                 "none yet (num_tokens % block_size == 0); anything more "
                                 "leaks blocks")
                grading.expect_equal(block_table, before,
                                     f"{where}: block_table after OutOfBlocks",
                                     "when allocate() fails nothing may change")
                continue
            if expected is None:
                grading.fail(f"{where}: the pool is empty, so allocate() raises "
                             f"OutOfBlocks; your code returned {_slot_str(got)}",
                             "call allocator.allocate() and let OutOfBlocks propagate: "
                             "the scheduler above decides what to do about it")
            if not isinstance(got, Slot):
                grading.fail(f"{where}: expected {_slot_str(expected)}, got {got!r}",
                             "return Slot(block, offset)")
            if (got.block, got.offset) != (expected.block, expected.offset):
                grading.fail(f"{where}: expected {_slot_str(expected)}, got {_slot_str(got)}",
                             _append_hint(got, expected, len(block_table) - len(table.blocks),
                                          block_size))
            grading.expect_equal(block_table, table.blocks,
                                 f"{where}: block_table afterwards",
                                 "append the new block to block_table itself "
                                 "(block_table.append(block)), once per new block")
            grading.expect_true(alloc.num_free == ref_alloc.num_free,
                                f"{where}: {alloc.num_free} blocks free afterwards, "
                                f"expected {ref_alloc.num_free} (a block was taken and "
                                f"never recorded: leaked)",
                                "call allocate() only when a token starts a new block, "
                                "and record every block you take")


def _append_hint(got: Slot, expected: Slot, extra_blocks: int, block_size: int) -> str:
    if extra_blocks > 0:
        return ("you took a new block before the last one was full: allocate only when "
                "num_tokens % block_size == 0")
    if extra_blocks < 0 or (expected.offset == 0 and got.offset != 0):
        return ("token number num_tokens starts a new block when num_tokens % block_size "
                "== 0: allocate one then")
    if not 0 <= got.offset < block_size or got.offset != expected.offset:
        return (f"offsets run from 0 to block_size - 1 = {block_size - 1}: "
                "offset = num_tokens % block_size")
    return "the token goes into the last block of block_table, block_table[-1]"


# ------------------------------------------------------------------ 03.2 free_block


class _LearnerAllocator(BlockAllocator):
    """The library's allocator with the learner's ``free_block`` as its ``free``."""

    def __init__(self, num_blocks: int, free_block: Callable[..., Any]):
        super().__init__(num_blocks)
        self._free_block = free_block

    def free(self, block: int) -> None:
        self._free_block(block, self.ref_counts, self.free_block_ids)


def _state(alloc: BlockAllocator) -> tuple[list[int], list[int]]:
    return list(alloc.ref_counts), list(alloc.free_block_ids)


def check_free_block(free_block: Callable[..., Any]) -> None:
    """``free_block(block, ref_counts, free_block_ids) -> None``."""
    with grading.exercise("03.2", "Free with reference counts"):
        _check_free_steps(free_block)
        _check_free_lifecycle(free_block)


def _expect_state(alloc, refs, free, what, hint_refs, hint_free):
    got_refs, got_free = _state(alloc)
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
                  "(free_block_ids.append): allocate() takes from the left, so the block "
                  "freed longest ago is reused first")
    for bad, why, hint in [
        (0, "block 0 is already free: a double free",
         "check ref_counts[block] == 0 before changing anything, and raise ValueError; "
         "otherwise the block would sit on the free list twice and two requests would "
         "write into it"),
        (4, "block 4 does not exist in a pool of 4",
         "check 0 <= block < len(ref_counts) and raise ValueError"),
        (-1, "block -1 does not exist",
         "Python reads ref_counts[-1] as the last block: check 0 <= block < "
         "len(ref_counts) yourself and raise ValueError"),
    ]:
        before = _state(alloc)
        try:
            alloc.free(bad)
        except ValueError:
            pass
        else:
            grading.fail(f"free({bad}): expected ValueError ({why}), nothing was raised",
                         hint)
        grading.expect_equal(_state(alloc), before, f"state after the refused free({bad})",
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
        _expect_state(alloc, *_state(ref_alloc), f"after '{what}'",
                      "each free drops exactly one reference",
                      "only a block whose count reaches 0 goes back, on the right end")
    grading.expect_equal(alloc.num_free, 6, "free blocks after every table is freed",
                         "every block must come back once its last holder frees it")


# ------------------------------------------------------------------ 03.3 predictions

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
    allocator = _busy_pool(12, (5, 2, 9, 10, 11))
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
    if isinstance(slot, tuple) and len(slot) == 3:
        return slot
    return slot


def check_predictions(predict: Callable[[], dict[str, Any]]) -> None:
    """``predict() -> dict`` with the keys of :data:`PREDICTION_KEYS`."""
    with grading.exercise("03.3", "Predict the reference counts"):
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
                shown = repr(expected)
            else:
                ok = isinstance(mine, dict) and dict(mine) == expected
                shown = repr(expected)
            if not ok:
                grading.fail(f"{key}: expected {shown}, got {mine!r}", _PREDICTION_HINTS[key])
