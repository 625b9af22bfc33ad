"""Checks for chapter 00's warm-up exercise, and the chapter's kernel run on its answer."""

from __future__ import annotations

from collections.abc import Callable

from paged_lib.course.grading.generated import small_ints


def check_ceil_div(ceil_div: Callable[[int, int], int]) -> None:
    """Exercise 00.1: blocks needed for ``n`` tokens, ``ceil(n / b)`` in integers."""
    small_ints.check_division("00.1", "ceil_div", ceil_div)
