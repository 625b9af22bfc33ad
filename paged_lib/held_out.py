"""The shipped model's held-out text: Python files it never trained on.

The split is defined once, by ``tools/train_tiny_model.py`` (its ``stdlib_files`` and
``is_held_out``); this module loads that script and walks its held-out files, so every
measurement on held-out text (chapter 11's quantised caches and sliding windows) reads
the same files in the same order.
"""

from __future__ import annotations

import importlib.util
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

TRAINING_SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "train_tiny_model.py"


def training_script():
    """``tools/train_tiny_model.py`` as a module (loaded once)."""
    if not TRAINING_SCRIPT.is_file():
        raise FileNotFoundError(f"{TRAINING_SCRIPT} is missing: the held-out split is "
                                "defined by the training script of the repository")
    name = "paged_lib._train_tiny_model"
    if name not in sys.modules:  # its dataclasses look themselves up there while defined
        spec = importlib.util.spec_from_file_location(name, TRAINING_SCRIPT)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def held_out_files() -> Iterator[bytes]:
    """The bytes of each held-out standard-library file, in the training script's order."""
    script = training_script()
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in script.stdlib_files():
        if script.is_held_out(path.relative_to(root).as_posix()):
            yield path.read_bytes()
