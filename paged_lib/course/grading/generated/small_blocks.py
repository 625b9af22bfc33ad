"""03.1-03.3's generated stage: seeded block-table scenarios (appends, forks of forks, frees;
block sizes 1 to 16; pools that run out and hand blocks out of order), replayed on a pool
with the library alone and one with the learner's piece, compared after every step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from paged_lib.blocks import BlockAllocator, BlockTable, OutOfBlocks, Slot
from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric, small_ints
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
                f"more blocks held by others), steps {list(self.steps)}"
                + " from s0 holding 2 x block size - 2 tokens" * (self.block_size > 2 ** 53))

    def states(self) -> list[str]:
        return ([f"block size {self.block_size}"] * (self.block_size in (3, 5, 6, 7, 12))
                + ["a fork of a fork"] * any(s[0] == "fork" and s[1] != "s0" for s in self.steps)
                + ["the pool runs out"] * (_peak(self) > len(self.free))
                + ["blocks handed out of order"] * (list(self.free) != sorted(self.free))
                + ["num_tokens / block_size as a float rounds"] * (self.block_size > 2 ** 53))

    def smaller(self) -> Iterator[Scenario]:
        for k in range(len(self.steps)):
            if _valid(self.steps[:k] + self.steps[k + 1:]):
                yield dataclasses.replace(self, steps=self.steps[:k] + self.steps[k + 1:])
        for k, step in enumerate(self.steps):
            for n in numeric.shorter(step[2]) if step[0] == "append" else ():
                yield dataclasses.replace(self, steps=self.steps[:k] + (
                    ("append", step[1], n),) + self.steps[k + 1:])
        renumbered = lambda free: tuple(sorted(free).index(b) for b in free)
        if self.held:
            yield dataclasses.replace(self, held=0, free=renumbered(self.free))
        if len(self.free) > 1 + 2 * (self.block_size > 2 ** 53):  # (s0's two blocks stay)
            yield dataclasses.replace(self, free=renumbered(self.free[:-1]))


def _valid(steps: tuple[tuple, ...]) -> bool:  # each step names a live sequence, a fork a new one
    live = {"s0"}
    for kind, who, *rest in steps:
        if who not in live or kind == "fork" and rest[0] in live:
            return False
        live.add(rest[0]) if kind == "fork" else live.discard(who) if kind == "free" else None
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


def _s0(s: Scenario, allocator: BlockAllocator, cls: type = BlockTable) -> BlockTable:
    """s0 empty, or at a block size past 2**53 two blocks less two slots (n / b rounds)."""
    big = s.block_size > 2 ** 53
    return cls(allocator, s.block_size, [allocator.allocate() for _ in range(2 * big)],
               (2 * s.block_size - 2) * big)


def _peak(s: Scenario) -> int:
    """The most blocks the library's tables hold at once on an unbounded pool."""
    alloc = BlockAllocator(10_000)
    tables, peak = {"s0": _s0(s, alloc)}, 0
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
    """03.1's, 03.2's and 03.3's scenarios (seeds 0, 1, ...; the last, block size > 2**53)."""
    return [_draw(seed) for seed in range(count)] + [Scenario(count, 2 ** 53 + 5, (3, 0, 4, 1), 1, (
        ("append", "s0", 1), ("fork", "s0", "s1"), ("append", "s1", 2), ("append", "s0", 2)))]


#: a failing scenario that passes once its block size is small, or a power of two, or once
#: the pool hands its blocks out in increasing order
CONTRASTS = (numeric.Contrast(
    lambda s: dataclasses.replace(s, block_size=16) if s.block_size > 2 ** 53 else None,
    "it passes once the block size is small (n = num_tokens, b = block_size): "
    + small_ints.FLOAT_HINT), numeric.Contrast(
    lambda s: dataclasses.replace(s, block_size=1 << s.block_size.bit_length())
    if s.block_size & (s.block_size - 1) else None,
    "it passes once the block size is a power of two: a token's offset is num_tokens % "
    "block_size (a bit mask or a shift is that only for powers of two)"),
    numeric.Contrast(lambda s: dataclasses.replace(s, free=tuple(sorted(s.free))),
                     "it passes once the pool hands out blocks in increasing order: keep the "
                     "blocks in the table's order (a set, or sorting, puts them in id order)"))


class _Table(BlockTable):
    """The grader's tables: a subclass, so a fork that builds a plain BlockTable shows."""


def _world(s: Scenario, free_block: Callable | None = None) -> dict[str, BlockTable]:
    allocator = busy_pool(s.held + len(s.free), s.free)
    return {"s0": _s0(s, with_free(allocator, free_block) if free_block else allocator,
                      _Table)}


def replay(s: Scenario, append: Callable = BlockTable.append_token,
           fork: Callable = BlockTable.fork, free_block: Callable | None = None) -> None:
    """Run ``s`` with the library in one world and ``append``/``fork`` in the other (03.3:
    the library's, on a pool freeing through ``free_block``), comparing after every step."""
    ref, mine = _world(s), _world(s, free_block)
    pools = ref["s0"].allocator, mine["s0"].allocator
    for n, (kind, who, child) in enumerate(_unrolled(s.steps), 1):
        if free_block or kind == "free":
            for tables in (ref, mine):
                with contextlib.suppress(OutOfBlocks):
                    _do(tables, kind, who, child)
        elif kind == "append":
            where = f"step {n} ({who} appends token {ref[who].num_tokens})"
            _append_step(ref[who], mine[who], where, append)
        else:
            ref[child] = ref[who].fork()
            mine[child] = _fork_step(ref[child], mine[who], f"step {n} ({child} = fork of "
                                     f"{who})", fork)
        where = f"step {n} ({kind} {who})"
        forked = kind == "fork" and "the child gets the parent's blocks, in order, and num_tokens"
        for name, table in ref.items():
            grading.expect_equal(mine[name].blocks, table.blocks, f"{where}: {name}'s blocks",
                                 forked or "the table's last block must be where the token "
                                 "went: a new block is appended, a copied one replaces the "
                                 "shared, in the table's own list _blocks (table.blocks is a "
                                 "copy)")
            grading.expect_equal(mine[name].num_tokens, table.num_tokens, f"{where}: {name}'s "
                                 "num_tokens", forked or "a successful append adds exactly one "
                                 "token (num_tokens += 1)")
        (want_refs, want_free), (refs, free) = map(pool_state, pools)
        grading.expect_equal(refs, want_refs, f"{where}: ref counts", (
            "free drops one reference (ref_counts[block] -= 1), whatever the count: a block "
            "with k holders keeps k - 1 (of two holders, one is freed, so one remains)")
            if free_block else "incref every block of the table, once; otherwise the first "
            "table to free it hands a block still in use back to the pool" if kind == "fork"
            else "every block a table holds counts that table once")
        held = [b for b in free if want_refs[b]]
        grading.expect_true(not held, f"{where}: block(s) {held} on the free list, still held",
                            "a block that still has a holder (count > 0) must not go back on "
                            "the free list yet, or a new request would overwrite live tokens")
        grading.expect_equal(free, want_free, f"{where}: free list", (
            "the last holder returns the block to the *right* end of the free list "
            "(allocate() takes from the left)" if sorted(free) == sorted(want_free) else
            "a block whose count reaches 0 goes back on the free list, once") if free_block
            else "blocks come only from allocator.allocate() and go back only through "
            "allocator.free()")


def _call(fn: Callable, table: BlockTable, where: str) -> object:
    """``fn(table)``; a crash is told with the table it crashed on and the rule it broke."""
    state, fork = repr(table), "fork" in where
    try:
        return fn(table)
    except (NotImplementedError, OutOfBlocks, AssertionError):  # a stub, the pool, a verdict
        raise
    except Exception as err:  # noqa: BLE001 - the learner's crash, told with its rule
        text = f"{type(err).__name__}: {err}"
        grading.fail(f"{where}: your code raised {text}, on {state}", numeric.Named(next((
            h for on, h in [
                ("deque" in text, "the free list is empty: take a block only with "
                 "allocator.allocate(), which raises OutOfBlocks then"),
                ("IndexError" in text and fork, "table.blocks has one entry per block, not one "
                 "per token"),
                ("IndexError" in text, "the table holds no block yet, or its last block is "
                 "full (num_tokens % block_size == 0): allocate this token's new block before "
                 "you read its last block"),
                ("Error: " in text and fork, "incref the block ids in table.blocks (not their "
                 "positions 0, 1, ...), then type(table)(allocator, block_size, blocks, "
                 "num_tokens)"),
                ("Error: " in text, "the allocator has allocate(), incref(block), free(block) "
                 "(drops one reference), refcount(block); a table's blocks and num_tokens are "
                 "read-only (change _blocks, _num_tokens); Slot(block, offset, copy=(src, dst))"
                 )] if on), "")) or None)


def _append_step(ref: BlockTable, table: BlockTable, where: str, append: Callable) -> None:
    try:
        expected = ref.append_token()
    except OutOfBlocks:
        expected = None
    pool = table.allocator
    before = (pool_state(pool), table.blocks, table.num_tokens)
    try:
        got = _call(append, table, where)
    except OutOfBlocks as err:
        grading.expect_true(expected is None, f"{where}: your code ran out of blocks ({err}); "
                            f"expected {expected!r}", "take a block only when the token starts "
                            "a new block or the last block is shared and part-filled")
        after = (pool_state(pool), table.blocks, table.num_tokens)
        grading.expect_true(after == before, f"{where}: OutOfBlocks was raised but the table "
                            f"or allocator changed: before {before}, after {after}",
                            "not atomic: call allocator.allocate() before changing anything, "
                            "so a failed append leaves everything as it was")
        return
    what = f"{where}: expected {expected!r}, got {got!r}"
    grading.expect_true(expected is not None, f"{where}: no block is free, so this append "
                        f"must raise OutOfBlocks; your code returned {got!r}", "this token "
                        "needs a new block: call allocator.allocate() and let OutOfBlocks "
                        "propagate")
    grading.expect_true(isinstance(got, Slot), what, "return a Slot(block, offset, copy)")
    want_refs, refs = pool_state(ref.allocator)[0], pool_state(pool)[0]
    b = next((b for b, (w, h) in enumerate(zip(want_refs, refs, strict=True)) if w != h), None)
    taken = ref.allocator.num_free - pool.num_free
    new, copy, want_copy = expected.offset == 0, got.copy, expected.copy
    for wrong, hint in [
        (copy != want_copy and want_copy is None and new, "the token starts a new block: "
         "nothing is written into the old, full block, so nothing is copied (copy=None)"),
        (copy != want_copy and want_copy is None, "the last block has one holder (ref count "
         "1): write in place, copy=None; copy only when it is shared (ref count > 1)"),
        (copy != want_copy and copy is None, f"the last block {(want_copy or '?')[0]} is shared "
         "(ref count > 1) and part-filled: copy-on-write, allocate a new block, make it the "
         "table's last block, return copy=(shared block, new block)"),
        (copy != want_copy, "copy is a tuple (src, dst), as Slot declares it: the engine compares "
         "the copies it collects" if isinstance(copy, list) and tuple(copy) == want_copy else
         "copy=(src, dst): src is the shared block being left, dst the newly allocated one"),
        (b is not None and b == got.block and (refs[b], want_refs[b]) == (2, 1),
         "a stray incref: allocate() already sets the new block's count to 1"),
        (b is not None and want_copy is not None and b == want_copy[0],
         "after copy-on-write this table no longer holds the shared block: drop its reference "
         "(allocator.free(src))" + ", once" * (b is not None and refs[b] < want_refs[b])),
        (b is not None and taken < 0 and new, "this token starts a new block (its offset, "
         "num_tokens % block_size, is 0): allocate one; count the tokens before it"),
        (b is not None and taken > 0, "you took a block this token does not need: allocate "
         "only for a new block, or to copy a shared, part-filled last block"),
        (got.offset != expected.offset, "token number num_tokens goes to offset num_tokens % "
         "block_size; count the tokens before it, not after"),
        (got.block != expected.block and new, "this token starts a new block: allocate one"),
        (got.block != expected.block, "the token goes into the table's last block (after any "
         "copy, the new one)")]:
        if wrong:
            grading.fail(what + (f"; ref counts {refs}, expected {want_refs}" if b is not None
                                 else ""), hint)


def _fork_step(ref: BlockTable, table: BlockTable, where: str, fork: Callable) -> BlockTable:
    pool, free_before = table.allocator, table.allocator.num_free
    nothing = ("fork allocates nothing: the child shares the parent's physical blocks; "
               "copies happen later, on write")
    try:
        got = _call(fork, table, where)
    except OutOfBlocks as err:
        grading.fail(f"{where}: your fork ran out of blocks ({err})", nothing)
    grading.expect_true(isinstance(got, BlockTable), f"{where}: fork returned "
                        f"{type(got).__name__}, expected a BlockTable",
                        "return a new table over the same blocks")
    for wrong, what, hint in [
        (got is table, "fork returned the parent itself", "the child is a second table"),
        (type(got) is not type(table), f"fork of a {type(table).__name__} returned a "
         f"{type(got).__name__}", "build the child with the parent's own class, "
         "type(table)(...), so a subclass's fork returns the subclass"),
        (got.allocator is not pool or got.block_size != table.block_size,
         "the child has another allocator or block size", "the same pool and block size"),
        (pool.num_free != free_before, f"{pool.num_free} blocks free after the fork, "
         f"{free_before} before", nothing),
        (any(v is w for v in getattr(got, "__dict__", {}).values()
             if isinstance(v, list | dict | set) for w in vars(table).values()),
         "the child and the parent share one list object", "give the child its own copy of "
         "the block list, or when one of them appends the other's table changes too")]:
        grading.expect_true(not wrong, f"{where}: {what}", hint)
    return got
