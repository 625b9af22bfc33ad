"""Checks for chapter 00's warm-up exercise, and the chapter's kernel run on its answer."""

from __future__ import annotations

from collections.abc import Callable

from paged_lib.course import grading
from paged_lib.course.grading.generated import small_ints


def check_ceil_div(ceil_div: Callable[[int, int], int]) -> None:
    """Exercise 00.1: blocks needed for ``n`` tokens, ``ceil(n / b)`` in integers."""
    small_ints.check_division("00.1", "ceil_div", ceil_div)


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
