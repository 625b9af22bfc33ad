"""Checks for chapter 03 (block tables): 03.1-03.3 replay the scenarios of
:mod:`.generated.small_blocks` next to the library (03.3 first refuses bad frees); 03.4
compares the predictions with the library's run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paged_lib.blocks import BlockTable, Slot
from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric, small_blocks
from paged_lib.course.grading.toy_pool import busy_pool, pool_state, with_free


def check_append_token(append_token: Callable[[BlockTable], Any]) -> None:
    """03.1: ``append_token(table) -> Slot`` with on-demand allocation and copy-on-write."""
    with grading.exercise("03.1"):
        numeric.check("03.1", small_blocks.block_scenarios(), lambda s: small_blocks.replay(
            s, append_token), small_blocks.CONTRASTS)


def check_fork(fork: Callable[[BlockTable], Any]) -> None:
    """03.2: ``fork(table) -> BlockTable`` sharing every block and allocating nothing."""
    with grading.exercise("03.2"):
        numeric.check("03.2", small_blocks.block_scenarios(), lambda s: small_blocks.replay(
            s, fork=fork), small_blocks.CONTRASTS)


def check_free_block(free_block: Callable[..., Any]) -> None:
    """03.3: ``free_block(block, ref_counts, free_block_ids) -> None``."""
    with grading.exercise("03.3"):
        alloc = with_free(busy_pool(4, (1, 0)), free_block)  # 0 and 1 free, 2 and 3 held
        for bad, why, hint in [
            (0, "block 0 is already free: a double free", "refuse a block whose count is "
             "already 0 (ValueError), or it sits on the free list twice"),
            (4, "block 4 does not exist in a pool of 4",
             "refuse blocks outside 0 .. len(ref_counts) - 1 with a ValueError"),
            (-1, "block -1 does not exist", "Python reads ref_counts[-1] as the last block: "
             "refuse negative blocks yourself with a ValueError")]:
            before = pool_state(alloc)
            grading.expect_value_error(alloc.free, (bad,), f"free({bad}) ({why})", hint)
            grading.expect_equal(pool_state(alloc), before, f"state after the refused "
                                 f"free({bad})", "raise before changing anything")
        numeric.check("03.3", small_blocks.block_scenarios(),
                      lambda s: small_blocks.replay(s, free_block=free_block))


#: 03.4's keys, each with the hint for a wrong answer
PREDICTION_HINTS = {
    "refs after the forks": "a fork adds one holder to every block of the table it forks",
    "child 1's slot": "block 9 is shared and only half full, so the child first copies it "
                      "into the next free block",
    "child 2's slot": "block 9 is still shared after child 1 copied it away",
    "parent's slot": "after both children copied block 9 away, it has one holder: a block "
                     "with one holder is written in place",
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
    return {"refs after the forks": {b: allocator.refcount(b) for b in (5, 2, 9)},
            "child 1's slot": child1.append_token(),
            "child 2's slot": child2.append_token(),
            "parent's slot": parent.append_token(),
            "refs at the end": {b: allocator.refcount(b) for b in (5, 2, 9, 10, 11)}}


def check_predictions(predict: Callable[[], dict[str, Any]]) -> None:
    """03.4: ``predict() -> dict`` with the keys of :data:`PREDICTION_HINTS`."""
    with grading.exercise("03.4"):
        got, keys = predict(), list(PREDICTION_HINTS)
        grading.expect_dict(got, keys, f"use exactly the keys {keys}", "predict(): ")
        for key, expected in prediction_scenario().items():
            mine = got[key]
            if _shape(mine) != _shape(expected):
                grading.fail(f"{key}: expected {expected!r}, got {mine!r}",
                             _prediction_hint(key, expected, mine))
            for n in _numbers(mine):  # 3.0 == 3: equal, but a count or an id is an int
                grading.expect_int(n, f"{key}: {mine!r}")


def _shape(x: Any) -> Any:
    """A slot as (block, offset, copy), its copy a tuple: a list or a tuple is as good."""
    x = (x.block, x.offset, x.copy) if isinstance(x, Slot) else x
    return (*x[:2], tuple(x[2]) if isinstance(x[2], tuple | list) else x[2]) \
        if isinstance(x, tuple | list) and len(x) == 3 else x


def _numbers(x: Any) -> list[Any]:
    """Every block id, count and offset in an answer (a dict, or a slot of any shape)."""
    return [n for v in (x.items() if isinstance(x, dict) else _shape(x)) if v is not None
            for n in (_numbers(v) if isinstance(v, tuple | list) else [v])]


def _prediction_hint(key: str, expected: Any, mine: Any) -> str:
    """The key's hint, or the one field of a slot (or the form of an answer) that is off."""
    if isinstance(expected, dict):
        return (f"give the counts as a dict {{block: count}}, one entry per block asked: "
                f"{sorted(expected)}" if not isinstance(mine, dict) else
                f"give one count for each of the blocks {sorted(expected)}, no others"
                if set(mine) != set(expected) else PREDICTION_HINTS[key])
    shape = _shape(mine)
    if not (isinstance(shape, tuple) and len(shape) == 3):
        return "give a slot as Slot(block, offset, copy), copy=(src, dst) or None"
    block, offset, copy = shape
    if offset != expected.offset and block == expected.block and copy == expected.copy:
        return (f"the new token is token 40 of the sequence (counting from 0): it goes at "
                f"offset 40 % 16 = {expected.offset} of the last block")
    if expected.copy and copy == expected.copy[::-1]:
        return "copy=(src, dst): src is the shared block, dst the new block"
    if expected.copy and isinstance(copy, tuple) and copy[:1] == expected.copy[:1] and \
            block != expected.block:
        return ("a copy-on-write takes the next block on the free list (5, 2, 9 went to the "
                "prompt, so 10, then 11), and the token is written into the copy")
    return PREDICTION_HINTS[key]
