#!/usr/bin/env python
"""Execute notebooks in place, the way their stored outputs are meant to be produced.

    python tools/run_notebooks.py notebooks/01_kv_bytes.ipynb solutions/01_kv_bytes.ipynb

Each notebook runs in a fresh kernel whose working directory is the notebook's folder,
with a fixed hash seed, and stores no timestamps or widget state
(:func:`paged_lib.course.notebooks.execute`); the script prints each wall time. A cell
error stops that notebook and the script exits non-zero without saving it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient.exceptions import CellExecutionError

from paged_lib.course.notebooks import execute


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    failed = 0
    for path in args.paths:
        start = time.perf_counter()
        try:
            nb = execute(path, args.timeout)
        except CellExecutionError as err:
            failed += 1
            print(f"FAILED {path}:\n{str(err)[-3000:]}", file=sys.stderr)
            continue
        seconds = time.perf_counter() - start
        nbformat.write(nb, path)
        print(f"{seconds:6.1f} s  {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
