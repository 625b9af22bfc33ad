"""Generated inputs for chapter 02, on the harness of
:mod:`~paged_lib.course.grading.generated.numeric`.

02.2 (one Orca (Max) request's slots): the fixed cases are requests in the middle of
their life. Here seeded cases include a request in its last step (it stores its final
length), one whose final length is max_len, both at once, and max_len of 1 to 10**6 + 3.

02.4 (a batch snapshot): the fixed batches have requests of distinct prompt lengths. Here
seeded batches of zero to six requests, with prompt lengths that repeat (as the samples
of one prompt have), outputs of 1 token, steps at a request's last step and just past it,
paged with block sizes that are not powers of two and Orca (Max) with a max_len just
above the longest request, are compared with the chapter's snapshot.

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
from paged_lib.fragmentation import request_slots
from paged_lib.util import cdiv
from paged_lib.workloads import Request

__all__ = ["Batch", "Slots", "Trace", "batch_cases", "batch_stage", "slot_cases",
           "slot_stage", "trace_cases", "trace_stage"]

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


# ------------------------------------------------------------------ 02.2 one request


@dataclass(frozen=True)
class Slots:
    """One generated case of 02.2: ``orca_max_slots(num_tokens, final_len, max_len)``."""

    seed: int
    num_tokens: int
    final_len: int
    max_len: int

    def describe(self) -> str:
        n, f, m = self.num_tokens, self.final_len, self.max_len
        return (f"orca_max_slots({n}, {f}, {m})" + (" (its last step: it stores its final "
                "length)" if n == f else "") + (" (its final length is max_len)" if f == m
                                                else ""))

    def states(self) -> list[str]:
        n, f, m = self.num_tokens, self.final_len, self.max_len
        return ((["its last step"] if n == f else []) + (["final_len = max_len"] if f == m
                                                        else [])
                + (["last step, final_len < max_len"] if n == f < m else []))

    def smaller(self) -> Iterator[Slots]:
        n, f, m = self.num_tokens, self.final_len, self.max_len
        for x in (n, f, m):
            for y in numeric.shorter(x):
                c = dataclasses.replace(self, **{k: y if v == x else v for k, v in (
                    ("num_tokens", n), ("final_len", f), ("max_len", m))})
                if 1 <= c.num_tokens <= c.final_len <= c.max_len:
                    yield c


def slot_cases(count: int = 30) -> list[Slots]:
    out = []
    for seed in range(count):
        r = random.Random(202 + seed)
        m = r.choice([1, 2, 40, 500, 2048, 3000, 131072, 10 ** 6 + 3])
        f = r.choice([1, m, m - 1, r.randint(1, m)]) or 1
        out.append(Slots(seed, r.choice([1, f, f - 1, r.randint(1, f)]) or 1, f, m))
    return out


def slot_stage(run: Callable[[int, int, int], None]) -> None:
    """02.2's generated stage; ``run(num_tokens, final_len, max_len)``: the chapter's check
    of one case."""
    numeric.check("02.2", slot_cases(), lambda p: run(p.num_tokens, p.final_len,
                                                      p.max_len), (numeric.Contrast(
        lambda p: dataclasses.replace(p, final_len=p.final_len + 1)
        if p.num_tokens == p.final_len < p.max_len else None,
        "it passes while the request still has tokens to produce and fails in its last "
        "step, when it stores its final length: it still holds all max_len slots then "
        "(reserved 0, internal max_len - final_len) and frees them after the step"),))


# ------------------------------------------------------------------ 02.4 a batch


@dataclass(frozen=True)
class Batch:
    """One generated case of 02.4: a batch at ``step`` under ``policy`` ("paged", with
    blocks of ``size``, or "orca-max", with max_len the longest request plus ``size``)."""

    seed: int
    prompts: tuple[int, ...]
    outputs: tuple[int, ...]
    step: int
    policy: str
    size: int

    def slots(self) -> Callable[[int, int], tuple[int, int, int]]:
        if self.policy == "paged":
            return lambda n, f: request_slots("paged", n, f, block_size=self.size)
        top = max((p + o for p, o in zip(self.prompts, self.outputs, strict=True)), default=0)
        return lambda n, f: request_slots("orca-max", n, f, max_len=top + self.size)

    def describe(self) -> str:
        return (f"batch_snapshot({list(self.prompts)}, {list(self.outputs)}, {self.step}, "
                f"slots) with " + (f"paged slots, blocks of {self.size}" if self.policy ==
                                   "paged" else "Orca (Max) slots"))

    def states(self) -> list[str]:
        pairs = list(zip(self.prompts, self.outputs, strict=True))
        out = ["an empty batch"] if not pairs else []
        out += ["two requests of the same prompt length"] if len(set(self.prompts)) < \
            len(pairs) else []
        out += ["a request in its last step"] if any(self.step == o - 1 for o in
                                                     self.outputs) else []
        out += ["a request that just left"] if self.step in self.outputs else []
        return out + (["block size not a power of two"] if self.policy == "paged" and
                      self.size & (self.size - 1) else [])

    def smaller(self) -> Iterator[Batch]:
        for k in range(len(self.prompts)):
            yield dataclasses.replace(self, prompts=self.prompts[:k] + self.prompts[k + 1:],
                                      outputs=self.outputs[:k] + self.outputs[k + 1:])
        for k, o in enumerate(self.outputs):
            for x in numeric.shorter(o):
                yield dataclasses.replace(self, outputs=self.outputs[:k] + (x,)
                                          + self.outputs[k + 1:])
        yield from numeric.fewer(self, step=numeric.shorter(self.step, 0))


def _draw_batch(seed: int) -> Batch:
    r = random.Random(204 + seed)
    k = r.choice([0, 1, 2, 3, 4, 6])
    outputs = tuple(r.choice([1, 2, 3, 8, 20]) for _ in range(k))
    step = r.choice([0, 1, *(o - 1 for o in outputs), *outputs])
    paged = seed % 2 == 0
    return Batch(seed, tuple(r.choice([1, 5, 16, 17, 30]) for _ in range(k)), outputs, step,
                 "paged" if paged else "orca-max", r.choice([3, 5, 12, 16] if paged
                                                            else [0, 7, 100]))


def batch_cases(count: int = 40) -> list[Batch]:
    return [_draw_batch(seed) for seed in range(count)]


def batch_stage(run: Callable[[Batch], None]) -> None:
    """02.4's generated stage; ``run(batch)``: the chapter's check of one batch."""
    numeric.check("02.4", batch_cases(), run, (numeric.Contrast(
        lambda p: dataclasses.replace(p, prompts=tuple(x + 100 * i for i, x in enumerate(
            p.prompts))) if len(set(p.prompts)) < len(p.prompts) else None,
        "it passes once every request has a prompt length of its own: two requests of the "
        "same length (samples of one prompt) are still two requests, each counted; a dict "
        "or a set keyed by length keeps one"),))
