"""Generated scenarios for 03.1 (``append_token``) and 03.2 (``fork``), on the harness of
:mod:`~paged_lib.course.grading.generated.numeric`.

The named scenarios use block sizes of 1, 2, 4, 8 and 16 only, so arithmetic that holds
for powers of two alone (``num_tokens & (block_size - 1)`` for the offset) passes them.
Here seeded scenarios take block sizes that are not powers of two (3, 5, 6, 7, 12) as
well, pools whose free lists come back shuffled, up to six sequences that append, fork
(forks of forks) and free in any order, and pools so tight that a new block or a
copy-on-write sometimes finds none. Each is replayed side by side with the library by
:func:`~paged_lib.course.grading.ch03_replay.replay`, as the named ones are; the first
that fails is shrunk (fewer steps, shorter appends, fewer free blocks).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from paged_lib.blocks import BlockAllocator, BlockTable
from paged_lib.course.grading.ch03_replay import replay
from paged_lib.course.grading.generated import numeric

__all__ = ["CONTRASTS", "Scenario", "block_scenarios", "block_stage"]

BLOCK_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)


@dataclass(frozen=True)
class Scenario:
    """Steps as the named scenarios have them (``("append", name, count)``, ``("fork",
    parent, child)``, ``("free", name)``) on a pool of ``held + len(free)`` blocks whose
    free list is ``free``, in that order."""

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
    """Every step names a live sequence (the named scenarios' rules)."""
    live = {"s0"}
    for kind, who, *rest in steps:
        if who not in live:
            return False
        if kind == "fork":
            if rest[0] in live:
                return False
            live.add(rest[0])
        elif kind == "free":
            live.discard(who)
    return True


def _peak(s: Scenario) -> int:
    """The most blocks the library's tables hold at once on an unbounded pool."""
    alloc = BlockAllocator(10_000)
    tables = {"s0": BlockTable(alloc, s.block_size)}
    peak = 0
    for kind, who, *rest in s.steps:
        if kind == "append":
            for _ in range(rest[0]):
                tables[who].append_token()
        elif kind == "fork":
            tables[rest[0]] = tables[who].fork()
        else:
            tables.pop(who).free()
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
    """03.1's and 03.2's generated scenarios (seeds 0, 1, ...)."""
    return [_draw(seed) for seed in range(count)]


def _power_of_two(s: Scenario) -> Scenario | None:
    if s.block_size & (s.block_size - 1) == 0:
        return None
    return dataclasses.replace(s, block_size=1 << s.block_size.bit_length())


def _in_order(s: Scenario) -> Scenario | None:
    if list(s.free) == sorted(s.free):
        return None
    return dataclasses.replace(s, free=tuple(sorted(s.free)))


#: a failing scenario that passes once its block size is a power of two, or once the pool
#: hands its blocks out in increasing order
CONTRASTS = (numeric.Contrast(_power_of_two, (
    "it passes once the block size is a power of two: a token's offset is num_tokens % "
    "block_size and its block num_tokens // block_size; a bit mask (& (block_size - 1)) "
    "or a shift (>> log2) is that only for powers of two")),
    numeric.Contrast(_in_order, (
        "it passes once the pool hands out blocks in increasing order: a table's i-th "
        "block holds its tokens i * block_size onwards, so keep the blocks in the table's "
        "order (a set, or sorting, puts them in the order of their ids)")))


def run_scenario(s: Scenario, append: Callable, fork: Callable) -> None:
    replay("generated", s.held + len(s.free), s.free, s.block_size, list(s.steps),
           append=append, fork=fork)


def block_stage(ex: str, append: Callable, fork: Callable) -> None:
    """The generated stage of 03.1 or 03.2 (the other function is the library's)."""
    numeric.check(ex, block_scenarios(), lambda s: run_scenario(s, append, fork), CONTRASTS)
