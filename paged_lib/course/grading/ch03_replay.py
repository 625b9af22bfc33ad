"""The side-by-side replay behind the chapter 03 checks of ``append_token`` and ``fork``.

A :class:`World` is one pool, its named tables and a toy KV store that applies every
``Slot`` (a copy first, then the token). :func:`replay` runs a scripted scenario
(``("append", name, count)``, ``("fork", parent, child)``, ``("free", name)``) twice,
with the library in one world and the learner's function in the other, and after every
step compares what a learner's bug would change: the slot, the tables, the reference
counts, the free list and the tokens each sequence reads back (so a missing
copy-on-write shows up as a sequence whose token another one overwrote). Each
difference fails with a hint that names the mistake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paged_lib.blocks import BlockAllocator, BlockTable, OutOfBlocks, Slot
from paged_lib.course import grading
from paged_lib.course.grading.toy_pool import ToyStore, busy_pool, pool_state


@dataclass
class World:
    """One pool, its named tables, a toy KV store and what each sequence should read."""

    allocator: BlockAllocator
    block_size: int
    tables: dict[str, BlockTable] = field(default_factory=dict)
    tokens: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.store = ToyStore(self.block_size)

    def write(self, name: str, slot: Slot) -> None:
        label = f"{name}:{len(self.tokens[name])}"
        self.store.write(slot, label)
        self.tokens[name].append(label)

    def read(self, name: str) -> list[Any]:
        """What ``name``'s sequence reads through its table (the kernel's view)."""
        return self.store.read(self.tables[name])


def _slot_str(slot: Any) -> str:
    if isinstance(slot, Slot):
        return f"Slot(block={slot.block}, offset={slot.offset}, copy={slot.copy})"
    return repr(slot)


def replay(scenario: str, num_blocks: int, free_list: tuple[int, ...] | None, block_size: int,
           steps: list[tuple], *, append, fork) -> None:
    """Run ``steps`` on two pools :func:`busy_pool` ``(num_blocks, free_list)``, the library
    in one and ``append``/``fork`` in the other, comparing after every step."""
    ref, mine = (World(busy_pool(num_blocks, free_list), block_size) for _ in range(2))
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


def _new_table(world: World, name: str) -> None:
    world.tables[name] = _Table(world.allocator, world.block_size)
    world.tokens[name] = []


def _append_step(ref: World, mine: World, who: str, where: str, append) -> None:
    try:
        expected = ref.tables[who].append_token()
    except OutOfBlocks:
        expected = None
    table = mine.tables[who]
    before = (pool_state(mine.allocator), table.blocks, table.num_tokens)
    try:
        got = append(table)
    except OutOfBlocks as err:
        if expected is not None:
            grading.fail(f"{where}: your code ran out of blocks ({err}); expected "
                         f"{_slot_str(expected)}",
                         "take a block only when the token starts a new block or the last "
                         "block is shared and part-filled; anything more leaks blocks")
        after = (pool_state(mine.allocator), table.blocks, table.num_tokens)
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


def _diagnose_append(ref: World, mine: World, who: str, expected: Slot, got: Slot,
                     where: str) -> None:
    """Name the mistake from how the learner's state differs from the reference."""
    if got.copy != expected.copy:
        grading.fail(f"{where}: expected {_slot_str(expected)}, got {_slot_str(got)}",
                     _copy_hint(expected, got, ref.block_size))
    ref_counts, _ = pool_state(ref.allocator)
    got_counts, _ = pool_state(mine.allocator)
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


def _compare(ref: World, mine: World, where: str) -> None:
    ref_counts, ref_free = pool_state(ref.allocator)
    got_counts, got_free = pool_state(mine.allocator)
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


def _fork_step(ref: World, mine: World, parent: str, child: str, where: str, fork) -> None:
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
    if any(v is w for v in getattr(got, "__dict__", {}).values()
           if isinstance(v, list | dict | set) for w in vars(table).values()):
        grading.fail(f"{where}: the child and the parent share one list object",
                     "give the child its own copy of the block list: when one of them "
                     "appends a block or copies on write, the other's table would change too")
    mine.tables[child] = got
    mine.tokens[child] = list(mine.tokens[parent])
