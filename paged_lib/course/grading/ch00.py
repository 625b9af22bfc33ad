"""Checks for chapter 00's warm-up exercise."""

from paged_lib.course.grading.generated import small_ints


def check_ceil_div(ceil_div) -> None:
    """00.1: blocks needed for ``n`` tokens, ``ceil(n / b)`` in integers."""
    small_ints.check_division("00.1", "ceil_div", ceil_div)
