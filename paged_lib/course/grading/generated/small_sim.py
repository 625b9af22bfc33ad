"""Generated traces for 02.5 (a time-stepped paged simulator), on the harness of
:mod:`~paged_lib.course.grading.generated.numeric`.

02.5's six named traces are each built around one rule; in the one that preempts, the
victim is also the first running request of the latest arrival time, so a victim chosen
by arrival time alone (ties broken towards the earliest admitted) passes. Here seeded
traces of two to seven requests, listed out of arrival order, several arriving at the
same step, come into pools just large enough for the largest request, with block sizes
of 1 to 7 and capacities that no block size divides: several preemptions, readmissions,
and queues behind them. Each is compared with the chapter's simulator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from paged_lib.course import grading
from paged_lib.course.grading.ch02_answers import reference_paged
from paged_lib.course.grading.generated import numeric
from paged_lib.util import cdiv
from paged_lib.workloads import Request

__all__ = ["Trace", "trace_cases", "trace_stage"]

_KEYS = ("token_states", "reserved", "internal", "external", "num_steps", "preemptions")


@dataclass(frozen=True)
class Trace:
    """One generated trace of 02.5: ``requests`` as (prompt, output, arrival); the pool
    holds the largest request's blocks plus ``spare`` blocks, plus ``odd`` slots no block
    can use."""

    seed: int
    requests: tuple[tuple[int, int, float], ...]
    block_size: int
    spare: int
    odd: int

    def capacity(self) -> int:
        need = max(cdiv(p + o, self.block_size) for p, o, _ in self.requests)
        return (need + self.spare) * self.block_size + min(self.odd, self.block_size - 1)

    def build(self) -> tuple[list[Request], int, int]:
        return [Request(*r) for r in self.requests], self.capacity(), self.block_size

    def describe(self) -> str:
        want = reference_paged(*self.build())
        return (f"requests {[Request(*r) for r in self.requests]}, capacity_tokens "
                f"{self.capacity()}, block_size {self.block_size} (the chapter's simulator: "
                f"{want['preemptions']} preemption(s), {want['num_steps']} steps)")

    def states(self) -> list[str]:
        want = reference_paged(*self.build())
        out = ["two or more preemptions"] if want["preemptions"] > 1 else []
        out += ["listed out of arrival order"] if list(self.requests) != sorted(
            self.requests, key=lambda r: r[2]) else []
        out += [f"block size {self.block_size}"] if self.block_size in (3, 5, 7) else []
        out += ["capacity not a multiple of block_size"] if self.capacity() % \
            self.block_size else []
        return out

    def smaller(self) -> Iterator[Trace]:
        for k in range(len(self.requests)):
            if len(self.requests) > 1:
                yield dataclasses.replace(self, requests=self.requests[:k]
                                          + self.requests[k + 1:])
        for k, (p, o, a) in enumerate(self.requests):
            for smaller in ((p, o, 0.0), (max(1, p // 2), o, a), (p, max(1, o // 2), a),
                            (p, o - 1, a)):
                if smaller != (p, o, a) and smaller[1] >= 1:
                    yield dataclasses.replace(self, requests=self.requests[:k] + (smaller,)
                                              + self.requests[k + 1:])
        yield from numeric.fewer(self, spare=[0] if self.spare else [],
                                 odd=[0] if self.odd else [])


def _draw(seed: int) -> Trace:
    rng = random.Random(205 + seed)
    requests = tuple((rng.randint(1, 12), rng.randint(1, 10),
                      rng.choice([0.0, 0.0, 1.0, 1.5, 2.0, 3.7, 5.0]))
                     for _ in range(rng.randint(2, 7)))
    return Trace(seed, requests, rng.choice([1, 2, 3, 4, 5, 7]), rng.choice([0, 1, 2, 4]),
                 rng.choice([0, 1, 3]))


def trace_cases(count: int = 30) -> list[Trace]:
    return [_draw(seed) for seed in range(count)]


_ORDER = ("the spec's order each step: arrivals, grow the running requests (preempting "
          "while short), admit from the head of the queue, account, then every running "
          "request produces its token and the finished ones leave")
_VICTIM = ("the victim is the most recently *admitted* running request (of two that arrived "
           "at the same step, the one admitted after the other: ties keep list order); it "
           "frees all its blocks and goes back to the head of the queue")


def run_trace(simulate_paged: Callable, time_limit: Callable, p: Trace) -> None:
    requests, capacity, bs = p.build()
    want = reference_paged(requests, capacity, bs)
    with time_limit("generated trace") if time_limit else contextlib.nullcontext():
        got = simulate_paged(list(requests), capacity, bs)
    grading.expect_true(isinstance(got, dict), f"expected a dict, got {type(got).__name__}")
    wrong = [k for k in _KEYS if got.get(k) != want[k]]
    if wrong:
        shown = ", ".join(f"{k} {want[k]} (yours {got.get(k)})" for k in wrong)
        grading.fail(f"expected {shown}", _VICTIM if want["preemptions"] else _ORDER)


def trace_stage(simulate_paged: Callable, time_limit: Callable | None = None) -> None:
    """02.5's generated stage; ``time_limit(what)``: the grader's guard against a loop that
    never ends."""
    numeric.check("02.5", trace_cases(), lambda p: run_trace(simulate_paged, time_limit, p))
