"""Generated counts for 00.1 (ceil division), 01.2 (logical blocks) and 01.3 (last-block
fill), on the harness of :mod:`~paged_lib.course.grading.generated.numeric`.

Their fixed cases hold one count past 2**53, ``10**18 + 1`` at blocks of 16, whose
quotient 62,500,000,000,000,000.0625 a float rounds to a whole number: code that takes
the float quotient's integer part and adds one for a remainder lands on the right answer
there by luck. Here seeded counts sit where floats round the other way (``10**18 + 17``,
``2**53 + 1``, ``3 * 10**17 + 5``, ``2**62 + 3``) and next to small ones, at block sizes
that are not powers of two (3, 7, 100, 2**20 + 1) as well as 1 and 16, and each answer is
compared with the library's integer one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric
from paged_lib.util import cdiv

__all__ = ["Count", "count_cases", "count_stage"]

_NS = [0, 1, 15, 10 ** 18 + 17, 2 ** 53 + 1, 3 * 10 ** 17 + 5, 2 ** 62 + 3, 10 ** 15 + 7,
       2 ** 53 + 15]
_BS = [16, 3, 7, 100, 2 ** 20 + 1, 1]


def _n(n: int) -> str:
    for base, name in ((10 ** 18, "10**18"), (10 ** 17, "10**17"), (10 ** 15, "10**15"),
                       (2 ** 53, "2**53"), (2 ** 62, "2**62")):
        if n >= base and n - base < 100:
            return f"{name} + {n - base}"
        if n >= 3 * base and n - 3 * base < 100 and base == 10 ** 17:
            return f"3 * {name} + {n - 3 * base}"
    return str(n)


@dataclass(frozen=True)
class Count:
    """One generated case: ``n`` items in blocks of ``b``."""

    seed: int
    n: int
    b: int

    def describe(self) -> str:
        return (f"n = {_n(self.n)}, block size {self.b}"
                + (" (n / b as a float is rounded: n is past 2**53)" if self.n > 2 ** 53
                   else " (n / b as a float keeps about 16 digits: its fraction is rounded)"
                   if self.n > 2 ** 40 else ""))

    def states(self) -> list[str]:
        out = ["n past 2**53, rounded the other way"] if self.n > 2 ** 53 and \
            self.n != 10 ** 18 + 1 else []
        return out + ([f"block size {self.b}"] if self.b not in (1, 3, 16) else [])

    def smaller(self) -> Iterator[Count]:
        yield from numeric.fewer(self, n=[x for x in _NS if x < self.n],
                                 b=[x for x in _BS if x < self.b])


def count_cases(count: int = 30) -> list[Count]:
    """(n, b) pairs drawn in turn from the counts and sizes (seeds 0, 1 ...)."""
    return [Count(k, _NS[k % len(_NS)], _BS[(k // len(_NS) + k) % len(_BS)])
            for k in range(count)]


def _fill(n: int, b: int) -> float:
    return ((n % b) or b) / b if n else 0.0


#: what each exercise asks of (n, b), and what it calls the answer
ASKED: dict[str, tuple[Callable[[int, int], float], str]] = {
    "00.1": (cdiv, "ceil_div"), "01.2": (cdiv, "blocks"), "01.3": (_fill, "fill")}
_HINT = ("stay in integers: n // b and n % b are exact at any size, n / b is a float that "
         "holds 53 bits and rounds past 2**53")


def run_count(ex: str, fn: Callable, p: Count) -> None:
    want_of, name = ASKED[ex]
    got, want = fn(p.n, p.b), want_of(p.n, p.b)
    if ex == "01.3":
        grading.expect_close(got, want, name, rel=1e-9, hint=_HINT)
        return
    grading.expect_int(got, name)
    grading.expect_equal(got, want, name, hint=_HINT)


def count_stage(ex: str, fn: Callable) -> None:
    """The generated stage of 00.1, 01.2 or 01.3 (``ex``)."""
    numeric.check(ex, count_cases(), lambda p: run_count(ex, fn, p))

