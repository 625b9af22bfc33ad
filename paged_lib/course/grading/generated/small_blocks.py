"""03.1-03.3's generated stage: seeded block-table scenarios (appends, forks of forks, frees;
block sizes 1 to 16; pools that run out and hand blocks out of order), replayed on two pools,
one with the library alone and one with the learner's piece, compared after every step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from paged_lib.blocks import BlockAllocator, BlockTable, OutOfBlocks, Slot
from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.toy_pool import busy_pool, pool_state, with_free

BLOCK_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)


@dataclass(frozen=True)
class Scenario:
    """``steps`` from one table ``s0`` on a pool of ``held + len(free)`` blocks whose free
    list is ``free``, in that order."""

    seed: int
    block_size: int
    free: tuple[int, ...]
    held: int
    steps: tuple[tuple, ...]

    def describe(self) -> str:
        return (f"block size {self.block_size}, free list {list(self.free)} ({self.held} "
                f"more blocks held by others), steps {list(self.steps)}")

    def states(self) -> list[str]:
        out = [f"block size {self.block_size}"] if self.block_size in (3, 5, 6, 7, 12) else []
        out += ["a fork of a fork"] if any(s[0] == "fork" and s[1] != "s0"
                                           for s in self.steps) else []
        out += ["the pool runs out"] if _peak(self) > len(self.free) else []
        out += ["blocks handed out of order"] if list(self.free) != sorted(self.free) else []
        return out

    def smaller(self) -> Iterator[Scenario]:
        for k in range(len(self.steps)):
            steps = self.steps[:k] + self.steps[k + 1:]
            if _valid(steps):
                yield dataclasses.replace(self, steps=steps)
        for k, step in enumerate(self.steps):
            if step[0] == "append":
                for n in numeric.shorter(step[2]):
                    yield dataclasses.replace(self, steps=self.steps[:k] + (
                        ("append", step[1], n),) + self.steps[k + 1:])
        if self.held:
            yield dataclasses.replace(self, held=0, free=_renumbered(self.free))
        if len(self.free) > 1:
            yield dataclasses.replace(self, free=_renumbered(self.free[:-1]))


def _renumbered(free: tuple[int, ...]) -> tuple[int, ...]:
    """The same free list in the same order, its blocks renamed 0, 1, ..."""
    return tuple(sorted(free).index(b) for b in free)


def _valid(steps: tuple[tuple, ...]) -> bool:
    """Every step names a live sequence, and a fork a new one."""
    live = {"s0"}
    for kind, who, *rest in steps:
        if who not in live or kind == "fork" and rest[0] in live:
            return False
        if kind == "fork":
            live.add(rest[0])
        elif kind == "free":
            live.discard(who)
    return True


def _unrolled(steps: tuple[tuple, ...]) -> Iterator[tuple]:
    """The steps one token at a time: (kind, who, the child's name or None)."""
    for kind, who, *rest in steps:
        for _ in range(rest[0] if kind == "append" else 1):
            yield kind, who, rest[0] if kind == "fork" else None


def _do(tables: dict[str, BlockTable], kind: str, who: str, child: str | None) -> None:
    if kind == "append":
        tables[who].append_token()
    elif kind == "fork":
        tables[child] = tables[who].fork()
    else:
        tables.pop(who).free()


def _peak(s: Scenario) -> int:
    """The most blocks the library's tables hold at once on an unbounded pool."""
    alloc = BlockAllocator(10_000)
    tables, peak = {"s0": BlockTable(alloc, s.block_size)}, 0
    for step in _unrolled(s.steps):
        _do(tables, *step)
        peak = max(peak, 10_000 - alloc.num_free)
    return peak


def _draw(seed: int) -> Scenario:
    rng = random.Random(303 + seed)
    bs = rng.choice(BLOCK_SIZES)
    live, steps, n = ["s0"], [("append", "s0", rng.randint(1, 3 * bs))], 1
    for _ in range(rng.randint(3, 10)):
        who, r = rng.choice(live), rng.random()
        if r < 0.55:
            steps.append(("append", who, rng.randint(1, 2 * bs + 1)))
        elif r < 0.85 and len(live) < 6:
            steps.append(("fork", who, f"s{n}"))
            live.append(f"s{n}")
            n += 1
        elif len(live) > 1:
            steps.append(("free", who))
            live.remove(who)
    s = Scenario(seed, bs, (), rng.choice((0, 0, 2, 5)), tuple(steps))
    size = max(1, _peak(s) + rng.choice((-2, -1, 0, 0, 1, 3)))
    return dataclasses.replace(s, free=tuple(rng.sample(range(size + s.held), size)))


def block_scenarios(count: int = 40) -> list[Scenario]:
    """03.1's, 03.2's and 03.3's scenarios (seeds 0, 1, ...)."""
    return [_draw(seed) for seed in range(count)]


#: a failing scenario that passes once its block size is a power of two, or once the pool
#: hands its blocks out in increasing order
CONTRASTS = (numeric.Contrast(
    lambda s: dataclasses.replace(s, block_size=1 << s.block_size.bit_length())
    if s.block_size & (s.block_size - 1) else None, (
        "it passes once the block size is a power of two: a token's offset is num_tokens % "
        "block_size and its block num_tokens // block_size; a bit mask (& (block_size - 1)) "
        "or a shift (>> log2) is that only for powers of two")),
    numeric.Contrast(lambda s: dataclasses.replace(s, free=tuple(sorted(s.free))), (
        "it passes once the pool hands out blocks in increasing order: a table's i-th "
        "block holds its tokens i * block_size onwards, so keep the blocks in the table's "
        "order (a set, or sorting, puts them in the order of their ids)")))


def block_stage(ex: str, append: Callable, fork: Callable) -> None:
    """The check of 03.1 or 03.2 (``ex``); the other function is the library's."""
    numeric.check(ex, block_scenarios(), lambda s: replay(s, append, fork), CONTRASTS)


def free_stage(free_block: Callable) -> None:
    """03.3's stage: the library's tables on a pool whose ``free`` is ``free_block``."""
    numeric.check("03.3", block_scenarios(), lambda s: replay_free(s, free_block))


class _Table(BlockTable):
    """The grader's tables: a subclass, so a fork that builds a plain BlockTable shows."""


class _World:
    """One pool in the scenario's starting state and its named tables."""

    def __init__(self, s: Scenario, free_block: Callable | None = None):
        self.allocator = busy_pool(s.held + len(s.free), s.free)
        if free_block is not None:
            with_free(self.allocator, free_block)
        self.block_size = s.block_size
        self.tables: dict[str, BlockTable] = {"s0": _Table(self.allocator, s.block_size)}


def replay(s: Scenario, append: Callable, fork: Callable) -> None:
    """Run ``s`` with the library in one world and ``append``/``fork`` in the other,
    comparing after every step."""
    ref, mine = _World(s), _World(s)
    for n, (kind, who, child) in enumerate(_unrolled(s.steps), 1):
        if kind == "append":
            where = f"step {n} ({who} appends token {ref.tables[who].num_tokens})"
            _append_step(ref, mine, who, where, append)
        elif kind == "fork":
            _fork_step(ref, mine, who, child, f"step {n} ({child} = fork of {who})", fork)
        else:
            for world in (ref, mine):
                _do(world.tables, kind, who, child)
        _compare(ref, mine, f"step {n} ({kind} {who})")


def replay_free(s: Scenario, free_block: Callable) -> None:
    """Run ``s`` with the library's tables on two pools, the second freeing through
    ``free_block`` (a table's free, and copy-on-write leaving a shared block)."""
    ref, mine = _World(s), _World(s, free_block)
    for n, step in enumerate(_unrolled(s.steps), 1):
        for world in (ref, mine):
            with contextlib.suppress(OutOfBlocks):
                _do(world.tables, *step)
        where = f"step {n} ({step[0]} {step[1]}, the library's table freeing with yours)"
        refs, free = pool_state(ref.allocator)
        got_refs, got_free = pool_state(mine.allocator)
        grading.expect_equal(got_refs, refs, f"{where}: ref_counts", (
            "free drops one reference (ref_counts[block] -= 1), whatever the count: a block "
            "with k holders keeps k - 1 (of two holders, one is freed, so one remains)"))
        held = [b for b in got_free if refs[b]]
        grading.expect_true(not held, f"{where}: block(s) {held} on the free list, still held",
                            "a block that still has a holder (count > 0) must not go back on "
                            "the free list yet, or a new request would overwrite live tokens")
        grading.expect_equal(got_free, free, f"{where}: free_block_ids", (
            "the last holder returns the block to the *right* end of the free list "
            "(allocate() takes from the left, so the block freed longest ago is reused first)"
            if sorted(got_free) == sorted(free) else
            "a block whose count reaches 0 goes back on the free list, once"))


def _append_step(ref: _World, mine: _World, who: str, where: str, append: Callable) -> None:
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
                         f"{expected!r}",
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
                     f"your code returned {got!r}",
                     "this token needs a new block (or a copy of a shared block): call "
                     "allocator.allocate() and let OutOfBlocks propagate")
    if not isinstance(got, Slot):
        grading.fail(f"{where}: expected {expected!r}, got {got!r}",
                     "return a Slot(block, offset, copy)")
    _diagnose_append(ref, mine, expected, got, where)


def _diagnose_append(ref: _World, mine: _World, expected: Slot, got: Slot,
                     where: str) -> None:
    """Name the mistake from how the learner's state differs from the reference."""
    if got.copy != expected.copy:
        grading.fail(f"{where}: expected {expected!r}, got {got!r}", _copy_hint(expected, got))
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
    if got.offset != expected.offset:
        grading.fail(f"{where}: expected {expected!r}, got {got!r}",
                     f"token number num_tokens goes to offset num_tokens % block_size (0 .. "
                     f"{ref.block_size - 1}); count the tokens before it, not after")
    if got.block != expected.block:
        grading.fail(f"{where}: expected {expected!r}, got {got!r}",
                     "this token starts a new block: allocate one and write at offset 0"
                     if expected.offset == 0 else
                     "the token goes into the table's last block (after any copy, the new one)")


def _copy_hint(expected: Slot, got: Slot) -> str:
    if expected.copy is None and expected.offset == 0:
        return ("the token starts a new block: nothing is written into the old, full "
                "block, so nothing is copied (copy=None), even if that block is shared")
    if expected.copy is None:
        return ("the last block has one holder (ref count 1): write in place, copy=None; "
                "copy only when someone else holds the block too (ref count > 1)")
    if got.copy is None:
        return (f"the last block {expected.copy[0]} is shared (ref count > 1) and part-filled: "
                "writing in place would change the other sequences' tokens. Copy-on-write: "
                "allocate a new block, make it this table's last block, and return "
                "copy=(shared block, new block)")
    return (f"copy=(src, dst): src is the shared block being left ({expected.copy[0]}), dst "
            f"the newly allocated one that the token goes to ({expected.copy[1]})")


def _compare(ref: _World, mine: _World, where: str) -> None:
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


def _fork_step(ref: _World, mine: _World, parent: str, child: str, where: str,
               fork: Callable) -> None:
    ref.tables[child] = ref.tables[parent].fork()
    table = mine.tables[parent]
    free_before, blocks_before = mine.allocator.num_free, table.blocks
    nothing = ("fork allocates nothing: the child shares the parent's physical blocks (that "
               "is the memory saving); copies happen later, on write")
    try:
        got = fork(table)
    except OutOfBlocks as err:
        grading.fail(f"{where}: your fork ran out of blocks ({err})", nothing)
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
                         f"{where}: free blocks after the fork", nothing)
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
