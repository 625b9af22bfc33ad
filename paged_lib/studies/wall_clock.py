"""The timer of the studies that time small things on a shared CPU.

:func:`fastest_ms` keeps the fastest of several runs, not the median: on a machine that
other processes share, interference only ever adds time, so the fastest run is the one
closest to what the code itself costs (Python's ``timeit`` advises the same).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def fastest_ms(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, in ms, after ``warmup`` untimed
    ones."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best
