"""Small helpers every module shares."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
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


#: glibc's ``mallopt`` parameters (``malloc.h``) and the values :func:`keep_freed_memory`
#: sets: blocks up to 32 MiB come from the heap (a 2,048-token step's gate-up output on
#: SmolLM2 is 2048 x 3072 x 4 B = 25 MB), and up to 1 GiB of freed heap is kept
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES = 32 * 2**20, 2**30


@functools.cache
def keep_freed_memory() -> bool:
    """Ask glibc's ``malloc`` to keep the memory a step frees for the next step; ``True``
    where it did (Linux with glibc), ``False`` elsewhere or with ``PAGED_LIB_MALLOC=system``.

    PyTorch's CPU allocator caches nothing: each model step allocates its activations
    afresh and frees them. glibc serves a block over its mmap threshold (128 KB at first)
    with a fresh ``mmap`` and unmaps it at ``free``, and gives the heap's free top back
    to the system past 128 KB, so every page of the next step's tensors faults in again
    and is zeroed by the kernel. Raising both thresholds (``mallopt``, the knobs of
    ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``) keeps that memory in the
    heap, where the next step finds it. Measured here (SmolLM2, the chat trace, two
    threads): its first step, all 32 prompts at once, took 3.2-3.5 s before and 1.4 s
    after. The setting is the whole process's; it costs the memory of one step's
    activations, kept."""
    if os.environ.get("PAGED_LIB_MALLOC") == "system":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        if not hasattr(libc, "gnu_get_libc_version"):  # another libc's mallopt differs
            return False
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
