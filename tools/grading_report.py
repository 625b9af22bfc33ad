#!/usr/bin/env python
"""What each exercise's check runs: seconds, generated cases, random workloads, states reached.

    python tools/grading_report.py                       # every solution notebook
    python tools/grading_report.py solutions/10_*.ipynb  # some

Each solution notebook runs in-process as :mod:`tools.mutants` runs it (cells as plain
Python in the notebook's folder). Around each exercise's check cell this tool watches the
two generated stages of :mod:`paged_lib.course.grading.generated`: ``numeric.check`` (seeded
inputs compared with the library's answer) and ``generated.find`` (random workloads served
next to the library's engine). It prints, per exercise, the check's wall seconds, how many
generated inputs and random workloads it ran, and how often those reached the states that
the named cases do not (each case's ``states()``; for workloads, ``generated.states``).
A solution must pass its own check, so every input and workload runs to the end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mutants  # noqa: E402  (sets up paged_lib before triton, as the notebooks do)

from paged_lib.course import grading, notebooks  # noqa: E402
from paged_lib.course.grading import generated  # noqa: E402
from paged_lib.course.grading.generated import numeric  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class Watch:
    """Counts what the generated stages run while it is active."""

    def __init__(self) -> None:
        self.inputs = 0
        self.workloads = 0
        self.states: dict[str, int] = {}
        self.hooks: list[tuple[str, int]] = []
        self._check, self._find = numeric.check, generated.find

    def _numeric(self, ex, cases, run, contrasts=()):
        cases = list(cases)
        self.inputs += len(cases)
        self._add(numeric.states(c for c in cases if hasattr(c, "states")))
        return self._check(ex, cases, run, contrasts)

    def _workloads(self, hook, hooks, count=generated.NUM_WORKLOADS):
        self.workloads += count
        self.hooks.append((hook, count))  # states counted after the timed cell
        return self._find(hook, hooks, count)

    def count_workload_states(self) -> None:
        """Add the states of the random workloads the check ran (outside the timed cell)."""
        for hook, count in self.hooks:
            self._add({k: v for k, v in generated.states(hook, count).items() if v})

    def _add(self, seen: dict[str, int]) -> None:
        for name, n in seen.items():
            self.states[name] = self.states.get(name, 0) + n

    def __enter__(self) -> Watch:
        numeric.check, generated.find = self._numeric, self._workloads
        return self

    def __exit__(self, *exc) -> None:
        numeric.check, generated.find = self._check, self._find


def report(path: Path) -> list[str]:
    """One line per exercise of the solution notebook ``path``."""
    nb = notebooks.read(path)
    checks = {ex.check_cell: ex.ex_id for ex in mutants.find_exercises(nb)}
    ns: dict = {"__name__": "__main__"}
    lines, quiet = [], io.StringIO()
    with contextlib.chdir(path.parent):
        for i, cell in notebooks.code_cells(nb):
            if i > max(checks, default=-1):
                break
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet), \
                    grading.record_verdicts() as seen, Watch() as watch:
                start = time.perf_counter()
                mutants.run_cell(cell.source, ns)
                took = time.perf_counter() - start
            if i not in checks:
                continue
            ex = checks[i]
            watch.count_workload_states()
            marks = "".join(m for m, e, _ in seen if e == ex) or "no verdict"
            reached = "; ".join(f"{k} {v}" for k, v in sorted(watch.states.items()))
            lines.append(f"[{ex}] {marks} {took:5.1f} s  generated inputs {watch.inputs:3}  "
                         f"random workloads {watch.workloads:2}  states: {reached or '-'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    for path in args.notebooks or sorted((ROOT / "solutions").glob("[0-9]*.ipynb")):
        print(path.name, flush=True)
        for line in report(path.resolve()):
            print("  " + line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
