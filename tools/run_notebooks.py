#!/usr/bin/env python
"""Execute notebooks in place, the way their stored outputs are meant to be produced.

    python tools/run_notebooks.py notebooks/01_kv_bytes.ipynb solutions/01_kv_bytes.ipynb

Each notebook runs in a fresh kernel whose working directory is the notebook's folder
(as nbval and JupyterLab run it), with a fixed hash seed, and prints its wall time. A
cell error stops that notebook and the script exits non-zero without saving it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def execute(path: Path, timeout: int = 600) -> float:
    nb = nbformat.read(path, as_version=4)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            extra_arguments=["--IPKernelApp.log_level=ERROR"],
                            record_timing=False,  # timestamps per cell only churn diffs
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()
    nb.metadata.pop("widgets", None)  # random model ids: storing them churns git diffs
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    elapsed = time.perf_counter() - start
    nbformat.write(nb, path)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    failed = 0
    for path in args.paths:
        try:
            seconds = execute(path, args.timeout)
        except CellExecutionError as err:
            failed += 1
            print(f"FAILED {path}:\n{str(err)[-3000:]}", file=sys.stderr)
            continue
        print(f"{seconds:6.1f} s  {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
