"""Checks for chapter 00's warm-up exercise (and 01.2, the same division), and the
chapter's kernel run on its answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paged_lib.course import grading
from paged_lib.course.grading.generated import small_ints
from paged_lib.util import cdiv

CASES = [(1, 16), (0, 16), (16, 16), (17, 16), (40, 16), (1000, 16), (7, 1), (5, 3), (100, 128)]


def _hint(n: int, b: int, got: Any) -> str:
    """Name the slip from the wrong number it produced."""
    if got == n // b:
        return "a partly filled last block still takes a whole block: round up, not down"
    if isinstance(got, float) and got != int(got):
        return "`/` gives a fraction of a block; blocks are whole: round up"
    if n % b == 0 and got == n // b + 1:
        return (f"when n is a multiple of b the last block is exactly full: {n} tokens in "
                f"blocks of {b} need {n // b}, not one more")
    return "ceil(n / b): the number of b-sized blocks that hold n items, 0 for n = 0"


def check_ceil_div(ceil_div: Callable[[int, int], int], ex: str = "00.1",
                   name: str = "ceil_div") -> None:
    """Exercise 00.1 (and 01.2, ``logical_blocks``): blocks needed for ``n`` tokens,
    ``ceil(n / b)`` in integers."""
    with grading.exercise(ex):
        for n, b in CASES:
            got = ceil_div(n, b)
            grading.expect_equal(got, cdiv(n, b), f"{name}({n}, {b})", hint=_hint(n, b, got))
            grading.expect_int(got, f"{name}({n}, {b})",
                               hint="use // rather than / and math.ceil: a count of blocks "
                                    "is an int")
        small_ints.count_stage(ex, ceil_div)  # generated: counts past 2**53


def run_demo(ceil_div: Callable[[int, int], int], n: int = 1000, block: int = 128) -> None:
    """The chapter's vector add, launched with the learner's ``ceil_div`` as the grid size.

    Too few programs leave the tail of the output unwritten; the demo says how much.
    """
    import torch

    from paged_lib.course.demos.tour import add_kernel

    programs = grading.on_learner_code(lambda: ceil_div(n, block), "exercise 00.1",
                                       "the kernel launch your ceil_div sizes")
    if programs is None:
        return
    x = torch.arange(n, dtype=torch.float32)
    out = torch.zeros_like(x)
    add_kernel[(int(programs),)](x, x, out, n, BLOCK=block)
    wrong = int((out != 2 * x).sum())
    print(f"add(x, x) for {n} elements, {block} per program: your ceil_div launched "
          f"{programs} programs; {n - wrong} of {n} outputs written correctly")
