"""02.2's, 02.4's and 02.5's generated cases (:mod:`.numeric`) and the library's answer to
02.5: last steps with max_len up to 10**6 + 3; batches of up to six requests with tied prompt
lengths; traces out of arrival order in pools just large enough, with preemptions."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric
from paged_lib.fragmentation import request_slots, simulate_timeline
from paged_lib.util import cdiv
from paged_lib.workloads import Request

SIM_KEYS = ("token_states", "reserved", "internal", "external", "num_steps", "preemptions")


def reference_paged(requests: Sequence[Request], capacity_tokens: int,
                    block_size: int) -> dict[str, int]:
    timeline = simulate_timeline(requests, "paged", capacity_tokens, block_size,
                                 max_len=max(r.final_len for r in requests))
    return {**timeline.slot_steps, "num_steps": timeline.num_steps,
            "preemptions": timeline.preemptions}


SIM_TIME_LIMIT_S = 10.0  #: per trace (the solution needs well under 1)


def _still_running(what: str) -> None:
    grading.fail(f"{what}: still running after {SIM_TIME_LIMIT_S:.0f} s",
                 "a loop that never ends: does every running request finish after "
                 "output_len steps and give its blocks back, and does time move on "
                 "when nothing can be admitted?")


def run_paged(simulate_paged: Callable, requests: list[Request], capacity: int,
              block_size: int, hint: str, what: str) -> None:
    want = reference_paged(requests, capacity, block_size)
    with grading.time_limit(SIM_TIME_LIMIT_S, lambda: _still_running(what)):
        got = simulate_paged(list(requests), capacity, block_size)
    grading.expect_dict(got, SIM_KEYS, f"return a dict with keys {SIM_KEYS}", f"{what}: ")
    for key in SIM_KEYS:
        grading.expect_int(got[key], f"{what}: {key}")
    shown = ", ".join(f"{k} {want[k]} (yours {got[k]})" for k in SIM_KEYS if got[k] != want[k])
    grading.expect_true(not shown, f"{what}: expected {shown}", hint)


@dataclass(frozen=True)
class Trace:
    """02.5: ``requests`` as (prompt, output, arrival); the pool holds the largest request's
    blocks plus ``spare`` blocks, plus ``odd`` slots no block can use."""

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
        return ["two or more preemptions"] * (want["preemptions"] > 1) + [
            "listed out of arrival order"] * (list(self.requests) != sorted(
                self.requests, key=lambda r: r[2])) + [f"block size {self.block_size}"] * (
            self.block_size in (3, 5, 7)) + ["capacity not a multiple of block_size"] * (
            self.capacity() % self.block_size > 0)

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


def trace_cases(count: int = 30) -> list[Trace]:
    out = []
    for seed in range(count):
        rng = random.Random(205 + seed)
        requests = tuple((rng.randint(1, 12), rng.randint(1, 10),
                          rng.choice([0.0, 0.0, 1.0, 1.5, 2.0, 3.2, 5.0]))
                         for _ in range(rng.randint(2, 7)))
        out.append(Trace(seed, requests, rng.choice([1, 2, 3, 4, 5, 7]),
                         rng.choice([0, 1, 2, 4]), rng.choice([0, 1, 3])))
    return out


_ORDER = ("the spec's order each step: arrivals, grow the running requests (preempting "
          "while short), admit from the head of the queue, account, then every running "
          "request produces its token and the finished ones leave")
_VICTIM = ("the victim is the most recently *admitted* running request (of two that arrived "
           "at the same step, the one admitted after the other: ties keep list order); it "
           "frees all its blocks and goes back to the head of the queue")


def trace_stage(simulate_paged: Callable) -> None:
    numeric.check("02.5", trace_cases(), lambda p: run_paged(simulate_paged, *p.build(), (
        _VICTIM if reference_paged(*p.build())["preemptions"] else _ORDER), "the trace"), (
        numeric.Contrast(lambda p: dataclasses.replace(p, requests=tuple(sorted(
            p.requests, key=lambda r: r[2]))), "it passes once the list is in arrival order: "
            "requests join in order of arrival time a, not of the list or of the step ceil(a); "
            "ties keep list order"),
        numeric.Contrast(lambda p: dataclasses.replace(p, requests=tuple((x, o, -(-a // 1))
            for x, o, a in p.requests)), "it passes once every arrival is a whole number: one "
            "arriving at time a joins at step ceil(a) (3.2: 4), not round(a) or int(a)")))


@dataclass(frozen=True)
class Slots:
    """02.2: ``orca_max_slots(*args)``, args (tokens, final, max)."""

    seed: int
    args: tuple[int, int, int]

    def describe(self) -> str:
        n, f, m = self.args
        return f"orca_max_slots{self.args}" + (" (its last step)" if n == f else "")

    def states(self) -> list[str]:
        n, f, m = self.args
        return ["its last step"] * (n == f) + ["final_len = max_len"] * (f == m) + [
            "its last step, final_len < max_len"] * (n == f < m)

    def smaller(self) -> Iterator[Slots]:
        for x in sorted(set(self.args)):
            for y in numeric.shorter(x):
                c = tuple(y if v == x else v for v in self.args)  # equal ones stay equal
                if 1 <= c[0] <= c[1] <= c[2]:
                    yield Slots(self.seed, c)


def slot_cases(count: int = 30) -> list[Slots]:
    out = []
    for seed in range(count):
        r = random.Random(202 + seed)
        m = r.choice([1, 2, 40, 500, 2048, 3000, 131072, 10 ** 6 + 3])
        f = r.choice([1, m, m - 1, r.randint(1, m)]) or 1
        out.append(Slots(seed, (r.choice([1, f, f - 1, r.randint(1, f)]) or 1, f, m)))
    return out


@dataclass(frozen=True)
class Batch:
    """02.4: ``requests`` (prompt, output) at ``step``, paged with blocks of ``size`` or
    (``orca``) Orca (Max) with max_len the longest plus ``size``."""

    seed: int
    requests: tuple[tuple[int, int], ...]
    step: int
    orca: bool
    size: int

    def args(self) -> tuple[list[int], list[int], int, Callable]:
        top = max((p + o for p, o in self.requests), default=0) + self.size
        return [p for p, _ in self.requests], [o for _, o in self.requests], self.step, (
            (lambda n, f: request_slots("orca-max", n, f, max_len=top)) if self.orca else
            (lambda n, f: request_slots("paged", n, f, block_size=self.size)))

    def describe(self) -> str:
        p, o, step, _ = self.args()
        return f"batch_snapshot({p}, {o}, {step}, slots) with " + (
            "Orca (Max) slots" if self.orca else f"paged slots, blocks of {self.size}")

    def states(self) -> list[str]:
        p, o, step, _ = self.args()
        return ["an empty batch"] * (not p) + ["two requests of the same prompt length"] * (
            len(set(p)) < len(p)) + ["a request in its last step"] * (step + 1 in o) + [
            "a request that just left"] * (step in o) + ["block size not a power of two"] * (
            not self.orca and self.size & (self.size - 1) > 0)

    def smaller(self) -> Iterator[Batch]:
        r = self.requests
        for k, (p, o) in enumerate(r):
            yield dataclasses.replace(self, requests=r[:k] + r[k + 1:])
            for x in numeric.shorter(o):
                yield dataclasses.replace(self, requests=r[:k] + ((p, x),) + r[k + 1:])
        yield from numeric.fewer(self, step=numeric.shorter(self.step, 0))


def batch_cases(count: int = 40) -> list[Batch]:
    out = []
    for seed in range(count):
        r = random.Random(204 + seed)
        reqs = tuple((r.choice([1, 5, 16, 17, 30]), r.choice([1, 2, 3, 8, 20]))
                     for _ in range(r.choice([0, 1, 2, 3, 4, 6])))
        out.append(Batch(seed, reqs, r.choice([0, 1, *(o - x for _, o in reqs for x in (0, 1))]),
                         seed % 2 == 1, r.choice([0, 7, 100] if seed % 2 else [3, 5, 12, 16])))
    return out

