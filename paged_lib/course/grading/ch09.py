"""Chapter 09 (block size); 09.3 is in :mod:`~paged_lib.course.grading.ch09_tiles`.

09.1 ``internal_waste``: generated cases only (valid input, then bad input too), a wrong
answer named by the typical mistake that gives it. 09.2 ``choose_block_size``: fixed cases
(wastes exactly at a budget), the mistake named likewise; bad input; generated cases.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from paged_lib.course import grading
from paged_lib.course.grading.ch09_tiles import check_attend_tiles
from paged_lib.course.grading.generated import numeric, small_counts
from paged_lib.course.grading.generated.small_attention import rng
from paged_lib.course.grading.slips import name_mistake
from paged_lib.studies.block_size import KERNEL_BLOCK_SIZES, choose_block_size, internal_waste
from paged_lib.util import cdiv

__all__ = ["check_attend_tiles", "check_choose_block_size", "check_internal_waste",
           "run_demo"]


# ------------------------------------------------------------------ 09.1 internal_waste


def _wrong_waste(lengths: Sequence[int], b: int) -> dict[str, float]:
    """What the typical mistakes return on one case, with the hint that names each."""
    n = [int(x) for x in lengths]
    held = sum(cdiv(x, b) * b for x in n)
    out: dict[str, float] = {}

    def share(blocks: Callable[[int], int], over: str = "held") -> float | None:
        h = sum(blocks(x) * b for x in n)
        den = h if over == "held" else sum(n)
        return None if den == 0 else (h - sum(n)) / den

    out["a full last block counted as one block more (x // B + 1 blocks: off by one "
        "block)"] = share(lambda x: x // b + 1)
    out["the partly filled last block is not counted (x // B blocks): it is the one that "
        "holds the waste"] = share(lambda x: x // b)
    out["averaged over sequences instead of over slots: a long sequence holds more slots "
        "and weighs more"] = sum((cdiv(x, b) * b - x) / (cdiv(x, b) * b) for x in n) / len(n)
    out["divided by the tokens, not by the slots held"] = share(lambda x: cdiv(x, b), "tokens")
    out["returned the filled share: the waste is the empty one"] = 1 - (held - sum(n)) / held
    out["a sequence whose length is a multiple of the block size has no empty slot (B - "
        "length % B counts a whole empty block there)"] = sum(b - x % b for x in n) / held
    out["divided by the last blocks' slots only: the share is over every slot the "
        "sequences hold"] = (held - sum(n)) / (len(n) * b)
    mean = sum(n) / len(n)
    out["computed on the mean length: each sequence rounds up its own last block"] = \
        (math.ceil(mean / b) * b - mean) / (math.ceil(mean / b) * b)
    out["computed in float32, then cast to a float: the share is off in its 8th digit "
        "(Python's floats are float64)"] = float(np.float32(held - sum(n)) / np.float32(held))
    return {hint: v for hint, v in out.items() if v is not None}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12 + 1e-9 * abs(b)  # as the check's own comparison


def check_internal_waste(fn: Callable[[Sequence[int], int], float]) -> None:
    """09.1: the empty share of whole blocks, over all slots."""
    with grading.exercise("09.1"):
        # valid input first, where a shrink neither reaches bad input nor stops at a crash
        # (x // B blocks divides by 0 on [1] at 3), then all of it
        numeric.check("09.1", [c for c in waste_cases() if _valid(c)],
                      lambda p: _valid(p) and _run_waste(fn, p, crash_ok=True))
        numeric.check("09.1", waste_cases(), lambda p: _run_waste(fn, p), (_NEGATIVE,))


def _valid(p: Waste) -> bool:
    return bool(p.lengths) and min((p.block_size, *p.lengths)) > 0


_BAD = "bad input (no lengths, a length or block size below 1) raises ValueError"


@dataclass(frozen=True)
class Waste:
    """One generated case of 09.1 (bad input too: what a parsed trace or a config holds)."""

    seed: int
    lengths: tuple[int, ...]
    block_size: int

    def describe(self) -> str:
        return f"internal_waste({list(self.lengths)}, {self.block_size})"

    def states(self) -> list[str]:
        out = ["a negative length"] if any(n < 0 for n in self.lengths) else []
        out += ["a negative block size"] if self.block_size < 0 else []
        out += ["a pool past 2**32 slots"] if sum(map(abs, self.lengths)) > 2 ** 32 else []
        return out + ["a length listed twice"] if len(set(self.lengths)) < len(
            self.lengths) else out

    def smaller(self) -> Iterator[Waste]:
        n = self.lengths
        for i in range(len(n)):
            yield dataclasses.replace(self, lengths=n[:i] + n[i + 1:])
            for x in sorted({1, -1, max(n[i] // 2, 1)} - {n[i]}):
                yield dataclasses.replace(self, lengths=n[:i] + (x,) + n[i + 1:])
        yield from numeric.fewer(self, block_size=sorted({1, -1, self.block_size // 2} - {0}))


_LENGTHS = [1, 1, 3, 7, 16, 33, 100, 4097, 0, -1, -5, 10 ** 10 + 1]
_SIZES = [1, 3, 5, 6, 12, 16, 100, 3 * 10 ** 9, 0, -1, -16]


def waste_cases(count: int = 40) -> list[Waste]:
    """09.1's generated cases (seeds 0, 1, ...): block sizes not powers of two, repeated
    lengths, pools past 2**32 slots, and bad input beyond 0: negative lengths and sizes."""
    out = []
    for seed in range(count):
        pick = rng(901 + seed)
        out.append(Waste(seed, tuple(pick(_LENGTHS) for _ in range(pick([0, 1, 2, 3, 5]))),
                         pick(_SIZES)))
    return out


def _run_waste(fn: Callable, p: Waste, crash_ok: bool = False) -> None:
    args = (list(p.lengths), p.block_size)
    try:
        want = internal_waste(*args)
    except ValueError:
        grading.expect_value_error(fn, args, "bad input", hint=_BAD)
        return
    try:
        got = fn(*args)
    except Exception:
        if crash_ok:
            return
        raise
    grading.expect_true(isinstance(got, numbers.Real) and not isinstance(got, bool),
                        f"expected a float, got {got!r}", hint="return the share as a float")
    if isinstance(got, numbers.Integral) and not _close(float(got), want):
        grading.fail(f"expected {want!r}, got {got!r} (an int)",
                     hint="integer division (//) rounded the share down: divide with /")
    hint = name_mistake(p, got, want, filter(_valid, waste_cases()),
                        lambda c: _wrong_waste(c.lengths, c.block_size),
                        lambda c: fn(list(c.lengths), c.block_size),
                        "each sequence holds ceil(length / B) whole blocks; the waste is "
                        "their empty slots over all their slots", _close)
    grading.expect_close(got, want, "the waste", rel=1e-9, abs_=1e-12, hint=hint)


#: a failing bad input that raises once its negative numbers are 0
_NEGATIVE = numeric.Contrast(
    lambda p: dataclasses.replace(p, lengths=tuple(max(n, 0) for n in p.lengths),
                                  block_size=max(p.block_size, 0))
    if min((p.block_size, *p.lengths)) < 0 else None,
    "it raises ValueError for a length or block size of 0 and not for a negative one: "
    "test below 1 (n < 1), not equal to 0")


# --------------------------------------------------------------- 09.2 choose_block_size

#: (lengths, allowed, max_waste, what it tests)
_CHOICE_CASES: list[tuple[list[int], list[int], float, str]] = [
    ([96, 192], [32, 48, 16, 64], 0.05, "an unsorted list of sizes"),
    ([5, 16, 40, 300], [8, 16, 32], 0.10, "vLLM's CUDA kernel sizes"),
    ([3], [1, 2, 4], 0.25, "a waste exactly at the budget"),
    ([20, 70, 33], [256, 512, 1024], 0.05, "FlashAttention's sizes, none fits"),
    ([3], [4, 2], 0.10, "no size fits; two waste the same"),
    ([500, 900, 1500], [32, 8, 16, 256, 64], 0.12, "a long trace"),
    ([47, 95], [20, 24, 40], 0.01, "no size fits; the least wasteful is not the smallest "
     "(sizes that are not powers of two)"),
    ([9], [10, 5], 0.1, "both waste exactly the budget of 0.1 (in float32 a bit more)"),
    ([7], [10, 1], 0.3, "size 10 wastes 3/10, which Python's float division makes exactly the "
     "float 0.3 (a hair below 3/10)"),
    ([13], [20, 4], 0.35, "size 20 wastes 7/20, which Python's float division makes exactly "
     "the float 0.35 (a hair below 7/20; in float32 a bit less)"),
    ([5, 25, 45, 42], [20, 5], 0.35, "size 20 wastes 63 of its 180 slots, which Python's "
     "float division makes exactly the float 0.35"),
    ([23040] * 10_000 + [23039], [25600, 256], 0.1, "size 25600 wastes one slot more than "
     "0.1 of 256,025,600: a hair above the budget as floats, equal to it in float32"),
]


def _wrong_choices(lengths: list[int], allowed: list[int], budget: float) -> dict[str, Any]:
    waste = {b: internal_waste(lengths, b) for b in allowed}
    waste32 = {b: float(np.float32(w)) for b, w in waste.items()}
    per_seq = {b: sum((cdiv(x, b) * b - x) / (cdiv(x, b) * b) for x in lengths) / len(lengths)
               for b in allowed}
    fits = [b for b in allowed if waste[b] <= budget]
    least = min(waste, key=lambda b: (waste[b], b))
    pfits = [b for b in allowed if per_seq[b] <= budget]
    each = [b for b in allowed if all(internal_waste([x], b) <= budget for x in lengths)]
    fits32 = [b for b in allowed if waste32[b] <= budget]
    out: dict[str, Any] = {
        "the waste computed in float32: a waste exactly at the budget rounds above it "
        "(Python's floats are float64)":
            max(fits32) if fits32 else min(waste32, key=lambda b: (waste32[b], b)),
        **_at_budget(lengths, allowed, budget, least),
        "waste averaged over sequences instead of over slots": max(pfits)
            if pfits else min(per_seq, key=lambda b: (per_seq[b], b)),
        "the budget held by every sequence on its own: it is on the memory all the "
        "sequences hold together": max(each) if each else least}
    if fits:
        strict = [b for b in allowed if waste[b] < budget]
        out["a waste exactly at max_waste fits (at most, not below)"] = \
            max(strict) if strict else least
        out["the smallest block that fits the budget: the largest one is asked (fewer, "
            "bigger blocks for the kernel and the block manager)"] = min(fits)
        out["the least wasteful size although several keep the budget: within the budget "
            "the kernel's side decides (fewer, bigger blocks)"] = least
        out["the first size that fits in the list's order: allowed is not sorted"] = fits[0]
        out["the last size that fits in the list's order: allowed is not sorted"] = fits[-1]
        out["the last size that fits in a set's order: allowed is not sorted, and a set "
            "is not either (small ones only happen to come out so)"] = \
            [b for b in set(allowed) if waste[b] <= budget][-1]
    else:
        out["two sizes waste the same: return the smaller"] = \
            max(b for b in allowed if waste[b] == waste[least])
        out["when no size fits, return the one that wastes least"] = max(allowed)
        out["when no size fits, return the one that wastes least: the smallest size does "
            "only when the sizes divide each other"] = min(allowed)
        out["when no size fits, return the one that wastes least (not the first "
            "listed)"] = allowed[0]
    return out


def _at_budget(lengths: list[int], allowed: list[int], budget: float, least: int
               ) -> dict[str, int]:
    """What answers return that compare the waste with the budget otherwise than as the
    float 09.1 returns (Python's float division) and the float max_waste as given."""
    held = {b: sum(cdiv(x, b) * b for x in lengths) for b in allowed}
    tokens = sum(lengths)
    f32 = np.float32
    rules: dict[str, Callable[[int], bool]] = {
        "the waste equals the budget as the float you are given (Python's float division of "
        "the empty slots by the slots held gives exactly max_waste), so the size is "
        "acceptable: compared as exact fractions with Fraction(max_waste) it lands above, "
        "as the float 0.3 (or 0.35) is a hair below 3/10 (7/20)":
            lambda b: Fraction(held[b] - tokens, held[b]) <= Fraction(budget),
        "the waste equals the budget as the floats you are given (Python's, float64), so "
        "the size is acceptable: max_waste rounded to float32 (np.float32, a float32 "
        "tensor) is a hair below 0.35 and the waste lands above it":
            lambda b: (held[b] - tokens) / held[b] <= float(f32(budget)),
        "the waste is a hair above the budget (one slot in 256 million) as Python's floats "
        "(float64) compute it, so the size is not acceptable: in float32 (torch's default "
        "dtype, or np.float32) both round to the same number":
            lambda b: bool(f32(held[b] - tokens) / f32(held[b]) <= f32(budget)),
        "the waste computed as 1 - tokens / held: the subtraction rounds (1 - 7/10 is "
        "0.30000000000000004, above 0.3); the waste is the empty slots over the slots "
        "held, (held - tokens) / held, as 09.1 returns it":
            lambda b: 1 - tokens / held[b] <= budget,
        "the budget multiplied out (held - tokens <= max_waste * held): the product rounds "
        "(0.35 * 180 is 62.99999999999999, below 63 empty slots); divide, as 09.1 does, "
        "and compare the two floats":
            lambda b: held[b] - tokens <= budget * held[b],
    }
    out = {}
    for hint, fits in rules.items():
        sizes = [b for b in allowed if fits(b)]
        out[hint] = max(sizes) if sizes else least
    return out


def _show(lengths: Sequence[int]) -> str:
    """``lengths`` as a list, runs of one length written ``[n] * k`` when it is long."""
    if len(lengths) <= 12:
        return str(list(lengths))
    runs = [(n, len(list(g))) for n, g in itertools.groupby(lengths)]
    return " + ".join(f"[{n}] * {k}" if k > 1 else f"[{n}]" for n, k in runs)


def check_choose_block_size(fn: Callable[[Sequence[int], Sequence[int], float], int]) -> None:
    """09.2: the largest allowed block size within the waste budget."""
    with grading.exercise("09.2"):
        for lengths, allowed, budget, about in _CHOICE_CASES:
            what = f"choose_block_size({_show(lengths)}, {allowed}, {budget}) ({about})"
            want = choose_block_size(lengths, allowed, budget)
            none_fits = all(internal_waste(lengths, b) > budget for b in allowed)
            lost = ("no allowed size keeps the budget here, but the engine still needs a "
                    "block size: the one that loses least memory on this workload")
            try:
                got = fn(list(lengths), list(allowed), budget)
            except ValueError as err:
                grading.fail(f"{what}: your function raised ValueError ({err}) on valid input",
                             lost if none_fits else "raise ValueError only for bad input")
            grading.expect_int(got, what, hint=lost if none_fits and got is None
                               else "return one of the allowed sizes, an int")
            hint = name_mistake((lengths, allowed, budget), got, want, _CHOICE_CASES,
                                lambda c: _wrong_choices(*c[:3]),
                                lambda c: fn(list(c[0]), list(c[1]), c[2]),
                                "the largest allowed size whose waste (over all slots) is at "
                                "most max_waste; if none, the least wasteful, the smaller on "
                                "a tie")
            grading.expect_equal(int(got), want, what=what, hint=hint)
        for args, what in ((([5], [], 0.1), "no allowed size"),
                           (([5], [8], 1.0), "max_waste = 1"),
                           (([5], [8], -0.1), "a negative max_waste")):
            grading.expect_value_error(fn, args, f"choose_block_size with {what}",
                                hint="bad input (no allowed size, max_waste outside "
                                "[0, 1)) raises ValueError")
        small_counts.choice_stage(fn)  # generated: budgets one ulp from a waste


# ------------------------------------------------------------------------------ demo


def run_demo(internal_waste_fn: Callable[..., float],
             choose_block_size_fn: Callable[..., int]) -> None:
    """The learner's functions on the chapter's two traces, next to the library's."""
    from paged_lib.workloads import alpaca_like, sharegpt_like

    traces = {"sharegpt": sharegpt_like(120, seed=0),
              "alpaca": alpaca_like(400, seed=0, rate=16)}
    lengths = {name: [r.final_len for r in trace] for name, trace in traces.items()}

    def waste() -> None:
        for name, lens in lengths.items():
            mine = [internal_waste_fn(lens, b) for b in (16, 64, 256)]
            ref = [internal_waste(lens, b) for b in (16, 64, 256)]
            print(f"{name}: waste at blocks of 16 / 64 / 256 tokens, yours "
                  + " / ".join(f"{w:.1%}" for w in mine) + ", library "
                  + " / ".join(f"{w:.1%}" for w in ref))

    def choice() -> None:
        for name, lens in lengths.items():
            for kernel, sizes in KERNEL_BLOCK_SIZES.items():
                b = choose_block_size_fn(lens, list(sizes), 0.05)
                lib = choose_block_size(lens, list(sizes), 0.05)
                print(f"{name}, {kernel} {sizes}, budget 5%: you choose {b} (library: {lib})")

    grading.on_learner_code(waste, "exercise 09.1", "the traces' waste with your function")
    grading.on_learner_code(choice, "exercises 09.1 and 09.2", "your block-size choices")
