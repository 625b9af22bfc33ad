"""Small helpers every module shares."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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


def cache_root() -> Path:
    """The folder where ``paged_lib`` keeps what it makes once and reuses (the compiled C
    kernel, a converted model): ``$PAGED_LIB_CACHE``, else ``~/.cache/paged_lib``, else (a
    home that cannot be written) ``paged_lib-<uid>`` in the system's temporary directory.
    Created if missing; ``OSError`` when none of them can be written."""
    for place in (os.environ.get("PAGED_LIB_CACHE"), Path.home() / ".cache" / "paged_lib",
                  Path(tempfile.gettempdir()) / f"paged_lib-{os.getuid()}"):
        if not place:
            continue
        try:
            Path(place).mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(place, os.W_OK):
            return Path(place)
    raise OSError("no writable folder for paged_lib's cache: set PAGED_LIB_CACHE to one")
