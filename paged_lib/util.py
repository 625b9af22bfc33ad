"""Small helpers every module shares."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: how many size-``b`` pieces hold ``a`` items.

    ``cdiv(33, 16) == 3``. The one spelling of it in the course (Triton's is
    ``triton.cdiv``; inside kernels, ``tl.cdiv``). Works on int tensors too.
    """
    return -(-a // b)


class CheckFailed(AssertionError):
    """A check found a wrong answer: a learner's function (the course's graders) or an
    implementation that disagrees with the reference (the benchmarks, which then time
    nothing). ``message`` is what the reader sees; ``hint``, if any, names the mistake."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
