"""Checks for chapter 00's warm-up exercise."""

from __future__ import annotations

from collections.abc import Callable

from paged_lib import grading


def check_ceil_div(ceil_div: Callable[[int, int], int]) -> None:
    """Exercise 00.1: blocks needed for ``n`` tokens, ``ceil(n / b)`` in integers."""
    with grading.exercise("00.1", "Ceil division"):
        cases = [(0, 16), (1, 16), (16, 16), (17, 16), (40, 16), (1000, 16), (7, 1),
                 (10**18 + 1, 16)]
        for n, b in cases:
            got = ceil_div(n, b)
            expected = -(-n // b)
            grading.expect_equal(
                got, expected, f"ceil_div({n}, {b})",
                hint="a partly filled block still counts as a whole block; stay in integers "
                     "(float division loses precision for large n)")
            grading.expect_true(isinstance(got, int),
                                f"ceil_div({n}, {b}) returned a {type(got).__name__}, not an int",
                                hint="use // rather than / and math.ceil")
