"""Small helpers every module shares."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: how many size-``b`` pieces hold ``a`` items.

    ``cdiv(33, 16) == 3``. The one spelling of it in the course (Triton's is
    ``triton.cdiv``; inside kernels, ``tl.cdiv``). Works on int tensors too.
    """
    return -(-a // b)
