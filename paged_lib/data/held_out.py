"""The shipped model's split of its training text: which files it trained on, which it never saw.

The text is the ``.py`` files of the running Python's standard library
(:func:`stdlib_files`: sorted, without tests, site-packages and IDLE); a file is held
out when a hash of its path says so (:func:`is_held_out`, about 1 file in
``HELD_OUT_EVERY``). The split is defined here, once: ``tools/train_tiny_model.py``
imports it to train on the other files and to evaluate on these, and every measurement
on held-out text (chapter 11's quantised caches and sliding windows, in
:mod:`paged_lib.studies`) reads :func:`held_out_files`, the same files in the same order.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path

HELD_OUT_EVERY = 20  # about 1 file in 20 is held out (chosen by a hash of its path)
SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
#: The rule in words, as the training record (``training.json``) states it.
HELD_OUT_RULE = f"sha256(relative path) first 4 bytes % {HELD_OUT_EVERY} == 0"


def stdlib_root() -> Path:
    """The running Python's standard library (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The stdlib's .py files, sorted, without tests, site-packages and IDLE."""
    root = stdlib_root()
    files = [
        p
        for p in root.rglob("*.py")
        if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
        and not p.name.startswith("test_")
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_held_out(rel_path: str) -> bool:
    """Deterministic split by a hash of the relative path (stable across machines)."""
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:4], "little") % HELD_OUT_EVERY == 0


def held_out_files() -> Iterator[bytes]:
    """The bytes of each held-out standard-library file, in :func:`stdlib_files`' order."""
    root = stdlib_root()
    for path in stdlib_files():
        if is_held_out(path.relative_to(root).as_posix()):
            yield path.read_bytes()
