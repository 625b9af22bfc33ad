"""Checks for chapter 03 (block tables).

Each check runs the learner's code next to the library's :mod:`paged_lib.blocks` on
scripted scenarios, step by step. After every step it compares what a learner's bug
would change: the slot, the table, the reference counts, the free list, and the tokens
each sequence reads back from a toy KV store that applies every ``Slot`` (so a missing
copy-on-write shows up as a sequence whose token was overwritten by another).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paged_lib.blocks import BlockAllocator, BlockTable, OutOfBlocks, Slot
from paged_lib.course import grading
from paged_lib.course.grading.toy_pool import busy_pool

#: Exercise id -> the library object the learner's code re-implements.
TWINS: dict[str, str] = {
    "03.1": "paged_lib.blocks.BlockTable.append_token",
    "03.2": "paged_lib.blocks.BlockTable.fork",
    "03.3": "paged_lib.blocks.BlockAllocator.free",
}


# ------------------------------------------------------------------ a world to replay

@dataclass
class _World:
    """One pool, its named tables, a toy KV store and what each sequence should read."""

    allocator: BlockAllocator
    block_size: int
    tables: dict[str, BlockTable] = field(default_factory=dict)
    store: dict[int, list[Any]] = field(default_factory=dict)
    tokens: dict[str, list[str]] = field(default_factory=dict)

    def write(self, name: str, slot: Slot) -> None:
        if slot.copy is not None:
            src, dst = slot.copy
            self.store[dst] = list(self.store.get(src, [None] * self.block_size))
        row = self.store.setdefault(slot.block, [None] * self.block_size)
        label = f"{name}:{len(self.tokens[name])}"
        if 0 <= slot.offset < self.block_size:
            row[slot.offset] = label
        self.tokens[name].append(label)

    def read(self, name: str) -> list[Any]:
        """What ``name``'s sequence reads through its table (the kernel's view)."""
        table, out = self.tables[name], []
        for t in range(table.num_tokens):
            blocks = table.blocks
            j = t // self.block_size
            block = blocks[j] if j < len(blocks) else None
            out.append(self.store.get(block, [None] * self.block_size)[t % self.block_size])
        return out


def _state(world: _World) -> tuple[list[int], list[int]]:
    return list(world.allocator.ref_counts), list(world.allocator.free_block_ids)


def _slot_str(slot: Any) -> str:
    if isinstance(slot, Slot):
        return f"Slot(block={slot.block}, offset={slot.offset}, copy={slot.copy})"
    return repr(slot)


# ------------------------------------------------------------------ 03.1 append_token

# Steps: ("append", name, count) / ("fork", parent, child) / ("free", name)
_APPEND_SCENARIOS: list[tuple[str, int, tuple[int, ...] | None, int, list[tuple]]] = [
    ("the 40-token example (block size 16, free list 5, 2, 9)", 12, (5, 2, 9), 16,
     [("append", "A", 40)]),
    ("fork a 6-token sequence (block size 4), then both write", 6, None, 4,
     [("append", "parent", 6), ("fork", "parent", "child"), ("append", "child", 1),
      ("append", "parent", 1), ("append", "child", 3), ("append", "parent", 3)]),
    ("fork when the last block is exactly full (block size 4, 8 tokens)", 6, None, 4,
     [("append", "parent", 8), ("fork", "parent", "child"), ("append", "child", 2),
      ("append", "parent", 2), ("free", "parent"), ("append", "child", 3)]),
    ("two forks of a 40-token prompt (block size 16, free list 5, 2, 9, 10, 11)", 12,
     (5, 2, 9, 10, 11), 16,
     [("append", "parent", 40), ("fork", "parent", "s1"), ("fork", "parent", "s2"),
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
    with grading.exercise("03.1", "append_token with copy-on-write"):
        for name, num_blocks, free_list, block_size, steps in _APPEND_SCENARIOS:
            ref = _World(busy_pool(num_blocks, free_list), block_size)
            mine = _World(busy_pool(num_blocks, free_list), block_size)
            _replay(steps, ref, mine, name, append=append_token, fork=BlockTable.fork)


def _replay(steps, ref: _World, mine: _World, scenario: str, *, append, fork) -> None:
    n = 0
    for step in steps:
        kind, who = step[0], step[1]
        count = step[2] if kind == "append" else 1
        for world in (ref, mine):
            if kind != "free" and who not in world.tables:
                _new_table(world, who)
        for _ in range(count):
            n += 1
            where = f"scenario '{scenario}', step {n}"
            if kind == "append":
                _append_step(ref, mine, who, f"{where} ({who} appends token "
                             f"{ref.tables[who].num_tokens})", append)
            elif kind == "fork":
                _fork_step(ref, mine, who, step[2], f"{where} ({step[2]} = fork of {who})",
                           fork)
            else:
                for world in (ref, mine):
                    world.tables.pop(who).free()
            _compare(ref, mine, f"{where} ({kind} {who})")


class _Table(BlockTable):
    """The grader's tables: a subclass, so a fork that builds a plain BlockTable shows."""


def _new_table(world: _World, name: str) -> None:
    world.tables[name] = _Table(world.allocator, world.block_size)
    world.tokens[name] = []


def _append_step(ref: _World, mine: _World, who: str, where: str, append) -> None:
    try:
        expected = ref.tables[who].append_token()
    except OutOfBlocks:
        expected = None
    table = mine.tables[who]
    before = (_state(mine), table.blocks, table.num_tokens)
    try:
        got = append(table)
    except OutOfBlocks as err:
        if expected is not None:
            grading.fail(f"{where}: your code ran out of blocks ({err}); expected "
                         f"{_slot_str(expected)}",
                         "take a block only when the token starts a new block or the last "
                         "block is shared and part-filled; anything more leaks blocks")
        after = (_state(mine), table.blocks, table.num_tokens)
        grading.expect_true(after == before, f"{where}: OutOfBlocks was raised but the "
                            f"table or allocator changed: before {before}, after {after}",
                            "not atomic: call allocator.allocate() before changing anything "
                            "(the table, num_tokens, or the shared block's ref count), so a "
                            "failed append leaves everything as it was")
        return
    if expected is None:
        grading.fail(f"{where}: no block is free, so this append must raise OutOfBlocks; "
                     f"your code returned {_slot_str(got)}",
                     "this token needs a new block (or a copy of a shared block): call "
                     "allocator.allocate() and let OutOfBlocks propagate")
    if not isinstance(got, Slot):
        grading.fail(f"{where}: expected {_slot_str(expected)}, got {got!r}",
                     "return a Slot(block, offset, copy)")
    _diagnose_append(ref, mine, who, expected, got, where)
    mine.write(who, got)
    ref.write(who, expected)


def _diagnose_append(ref: _World, mine: _World, who: str, expected: Slot, got: Slot,
                     where: str) -> None:
    """Name the mistake from how the learner's state differs from the reference."""
    if got.copy != expected.copy:
        grading.fail(f"{where}: expected {_slot_str(expected)}, got {_slot_str(got)}",
                     _copy_hint(expected, got, ref.block_size))
    ref_counts, _ = _state(ref)
    got_counts, _ = _state(mine)
    for b, (want, have) in enumerate(zip(ref_counts, got_counts, strict=True)):
        if have == want:
            continue
        if have == 2 and want == 1 and b == got.block:
            grading.fail(f"{where}: block {b} has ref count {have} after your append, "
                         f"expected {want}",
                         "a stray incref: allocate() already sets the new block's count to 1 "
                         "(this table is its only holder); an extra incref means the block "
                         "is never returned to the free list")
        if expected.copy is not None and b == expected.copy[0]:
            grading.fail(f"{where}: shared block {b} has ref count {have}, expected {want}",
                         "after copy-on-write this table no longer holds the shared block: "
                         "drop its reference (allocator.free(src)); the other holders keep it")
        taken = ref.allocator.num_free - mine.allocator.num_free
        if taken < 0 and expected.offset == 0:
            hint = ("this token starts a new block (its offset, num_tokens % block_size, is "
                    "0): allocate one; count the tokens before it, not after")
        elif taken > 0:
            hint = ("you took a block this token does not need: allocate only when the token "
                    "starts a new block, or to copy a shared, part-filled last block")
        else:
            hint = ("take exactly one block per new block or copy, and change no other "
                    "block's count")
        grading.fail(f"{where}: ref counts {got_counts}, expected {ref_counts}", hint)
    if (got.block, got.offset) != (expected.block, expected.offset):
        grading.fail(f"{where}: expected {_slot_str(expected)}, got {_slot_str(got)}",
                     _place_hint(expected, got, ref.block_size))


def _copy_hint(expected: Slot, got: Slot, block_size: int) -> str:
    if expected.copy is None and got.copy is not None:
        if expected.offset == 0:
            return ("the token starts a new block: nothing is written into the old, full "
                    "block, so nothing is copied (copy=None), even if that block is shared")
        return ("the last block has one holder (ref count 1): write in place, copy=None; "
                "copy only when someone else holds the block too (ref count > 1)")
    if expected.copy is not None and got.copy is None:
        return (f"the last block {expected.copy[0]} is shared (ref count > 1) and part-filled: "
                "writing in place would change the other sequences' tokens. Copy-on-write: "
                "allocate a new block, make it this table's last block, and return "
                "copy=(shared block, new block)")
    return (f"copy=(src, dst): src is the shared block being left ({expected.copy[0]}), dst "
            f"the newly allocated one that the token goes to ({expected.copy[1]})")


def _place_hint(expected: Slot, got: Slot, block_size: int) -> str:
    if got.offset != expected.offset:
        return (f"token number num_tokens goes to offset num_tokens % block_size (0 .. "
                f"{block_size - 1}); count the tokens before it, not after")
    if expected.offset == 0:
        return "this token starts a new block: allocate one and write at offset 0"
    return "the token goes into the table's last block (after any copy, the new one)"


def _compare(ref: _World, mine: _World, where: str) -> None:
    ref_counts, ref_free = _state(ref)
    got_counts, got_free = _state(mine)
    for name, table in ref.tables.items():
        other = mine.tables[name]
        grading.expect_equal(other.blocks, table.blocks, f"{where}: {name}'s blocks",
                             "the table's last block must be where the token went: a new "
                             "block is appended, a copied block replaces the shared one")
        grading.expect_equal(other.num_tokens, table.num_tokens,
                             f"{where}: {name}'s num_tokens",
                             "a successful append adds exactly one token (num_tokens += 1)")
    grading.expect_equal(got_counts, ref_counts, f"{where}: ref counts",
                         "every block a table holds counts that table once")
    grading.expect_equal(got_free, ref_free, f"{where}: free list",
                         "blocks come only from allocator.allocate() and go back only "
                         "through allocator.free()")
    for name in ref.tables:
        got, want = mine.read(name), ref.read(name)
        grading.expect_equal(got, want, f"{where}: tokens that {name} reads back",
                             "another sequence's write landed in a block this one reads: "
                             "a shared block was written in place (copy-on-write missing) "
                             "or copy=(src, dst) named the wrong blocks")


# ------------------------------------------------------------------ 03.2 fork

_FORK_SCENARIOS: list[tuple[str, int, int, list[tuple]]] = [
    ("fork a 6-token sequence (block size 4)", 8, 4,
     [("append", "parent", 6), ("fork", "parent", "child"), ("append", "child", 1),
      ("append", "parent", 3), ("free", "parent"), ("append", "child", 2)]),
    ("fork twice, then fork the fork (block size 2)", 12, 2,
     [("append", "p", 5), ("fork", "p", "a"), ("fork", "p", "b"), ("fork", "a", "c"),
      ("append", "c", 1), ("append", "a", 2), ("free", "p"), ("free", "a"),
      ("append", "b", 1), ("free", "b"), ("append", "c", 1)]),
    ("fork an empty table", 4, 4,
     [("fork", "e", "f"), ("append", "f", 1), ("append", "e", 1)]),
]


def check_fork(fork: Callable[[BlockTable], Any]) -> None:
    """03.2: ``fork(table) -> BlockTable`` sharing every block and allocating nothing."""
    with grading.exercise("03.2", "fork"):
        for name, num_blocks, block_size, steps in _FORK_SCENARIOS:
            ref = _World(BlockAllocator(num_blocks), block_size)
            mine = _World(BlockAllocator(num_blocks), block_size)
            _replay(steps, ref, mine, name, append=BlockTable.append_token, fork=fork)


def _fork_step(ref: _World, mine: _World, parent: str, child: str, where: str, fork) -> None:
    ref.tables[child] = ref.tables[parent].fork()
    ref.tokens[child] = list(ref.tokens[parent])
    table = mine.tables[parent]
    free_before, blocks_before = mine.allocator.num_free, table.blocks
    got = fork(table)
    if not isinstance(got, BlockTable):
        grading.fail(f"{where}: fork returned {type(got).__name__}, expected a BlockTable",
                     "return a new table over the same blocks")
    grading.expect_true(got is not table, f"{where}: fork returned the parent itself",
                        "the child is a second table: two sequences that will diverge")
    grading.expect_true(type(got) is type(table),
                        f"{where}: fork of a {type(table).__name__} returned a "
                        f"{type(got).__name__}",
                        "build the child with the parent's own class, type(table)(...), so a "
                        "subclass's fork returns the subclass")
    grading.expect_true(got.allocator is table.allocator and
                        got.block_size == table.block_size,
                        f"{where}: the child has another allocator or block size",
                        "the child lives in the same pool, with the same block size")
    grading.expect_equal(mine.allocator.num_free, free_before,
                         f"{where}: free blocks after the fork",
                         "fork allocates nothing: the child shares the parent's physical "
                         "blocks (that is the memory saving); copies happen later, on write")
    grading.expect_equal(table.blocks, blocks_before, f"{where}: the parent's blocks",
                         "fork must not change the parent")
    grading.expect_equal(got.blocks, table.blocks, f"{where}: the child's blocks",
                         "the child maps its logical blocks to the same physical blocks")
    grading.expect_equal(got.num_tokens, table.num_tokens, f"{where}: the child's num_tokens",
                         "the child starts with all of the parent's tokens")
    want = [ref.allocator.refcount(b) for b in ref.tables[child].blocks]
    have = [mine.allocator.refcount(b) for b in got.blocks]
    grading.expect_equal(have, want, f"{where}: ref counts of the child's blocks",
                         "each shared block has one more holder: incref every block of the "
                         "table, once; otherwise the first table to free it hands a block "
                         "still in use back to the pool")
    if got._blocks is table._blocks:
        grading.fail(f"{where}: the child and the parent share one list object",
                     "give the child its own copy of the block list: when one of them "
                     "appends a block or copies on write, the other's table would change too")
    mine.tables[child] = got
    mine.tokens[child] = list(mine.tokens[parent])


# ------------------------------------------------------------------ 03.3 free_block


class _LearnerAllocator(BlockAllocator):
    """The library's allocator with the learner's ``free_block`` as its ``free``."""

    def __init__(self, num_blocks: int, free_block: Callable[..., Any]):
        super().__init__(num_blocks)
        self._free_block = free_block

    def free(self, block: int) -> None:
        self._free_block(block, self.ref_counts, self.free_block_ids)


def _alloc_state(alloc: BlockAllocator) -> tuple[list[int], list[int]]:
    return list(alloc.ref_counts), list(alloc.free_block_ids)


def check_free_block(free_block: Callable[..., Any]) -> None:
    """03.3: ``free_block(block, ref_counts, free_block_ids) -> None``."""
    with grading.exercise("03.3", "Free with reference counts"):
        _check_free_steps(free_block)
        _check_free_lifecycle(free_block)


def _expect_state(alloc, refs, free, what, hint_refs, hint_free):
    got_refs, got_free = _alloc_state(alloc)
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
        before = _alloc_state(alloc)
        try:
            alloc.free(bad)
        except ValueError:
            pass
        else:
            grading.fail(f"free({bad}): expected ValueError ({why}), nothing was raised",
                         hint)
        grading.expect_equal(_alloc_state(alloc), before,
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
        _expect_state(alloc, *_alloc_state(ref_alloc), f"after '{what}'",
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
    with grading.exercise("03.4", "Predict the reference counts"):
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
                             _PREDICTION_HINTS[key])


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
    try:
        grown = list(viz.grow_requests(table_cls=learner_table,
                                       allocator=_LearnerAllocator(5, free_block)))
        forked = viz.fork_and_write(table_cls=learner_table,
                                    allocator=_LearnerAllocator(8, free_block))
    except NotImplementedError:
        print("⏳ finish exercises 03.1-03.3, then run this cell again: your own table "
              "and allocator will drive the chapter's drawings")
        return []
    except Exception as err:  # a learner's bug: say so in one line
        print(f"❌ your table or allocator raised {type(err).__name__}: {err}")
        return []
    same = grown == list(viz.grow_requests()) and forked == viz.fork_and_write()
    print(f"your code drove {len(grown) + len(forked)} frames; "
          f"{'every frame equals' if same else 'some frames differ from'} the library's")
    finished = next(i for i, s in enumerate(grown) if "finished" in s.caption)
    return [viz.draw_frames([grown[finished], grown[finished + 1]]),
            viz.draw_frames([forked[1], forked[2], forked[4]])]
