#!/usr/bin/env python
"""Generate exercises/ from solutions/ (never edit exercises by hand).

    python tools/make_exercises.py           # write exercises/NN_*.ipynb
    python tools/make_exercises.py --check   # exit 1 if exercises/ is out of sync

In code cells, each ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` region becomes
``# YOUR CODE HERE`` + ``raise NotImplementedError()`` at the region's indentation, and
``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN TESTS`` regions are removed. In Markdown
cells a solution region becomes ``YOUR ANSWER HERE``. Outputs and execution counts are
cleared, so the learner starts from a clean notebook.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
BEGIN_SOLUTION = re.compile(r"^(\s*)### BEGIN SOLUTION\s*$")
END_SOLUTION = re.compile(r"^\s*### END SOLUTION\s*$")
BEGIN_HIDDEN = re.compile(r"^\s*### BEGIN HIDDEN TESTS\s*$")
END_HIDDEN = re.compile(r"^\s*### END HIDDEN TESTS\s*$")


class MarkerError(ValueError):
    pass


def strip_regions(source: str, code: bool, where: str) -> str:
    out: list[str] = []
    state = None  # None, "solution" or "hidden"
    for n, line in enumerate(source.split("\n"), 1):
        if state is None:
            if m := BEGIN_SOLUTION.match(line):
                indent = m.group(1)
                if code:
                    out += [f"{indent}# YOUR CODE HERE", f"{indent}raise NotImplementedError()"]
                else:
                    out.append("YOUR ANSWER HERE")
                state = "solution"
            elif BEGIN_HIDDEN.match(line):
                state = "hidden"
            elif END_SOLUTION.match(line) or END_HIDDEN.match(line):
                raise MarkerError(f"{where}, line {n}: END marker without BEGIN")
            else:
                out.append(line)
        elif state == "solution":
            if END_SOLUTION.match(line):
                state = None
            elif BEGIN_SOLUTION.match(line) or BEGIN_HIDDEN.match(line):
                raise MarkerError(f"{where}, line {n}: nested BEGIN marker")
        elif END_HIDDEN.match(line):
            state = None
    if state is not None:
        raise MarkerError(f"{where}: {state} region is never closed")
    return "\n".join(out)


def make_exercise(solution: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    nb = nbformat.from_dict(solution)
    # Only what a learner's kernel needs: the Python version that last ran the solution
    # must not make exercises/ look out of sync.
    nb.metadata = {"kernelspec": solution.metadata.get("kernelspec", {
        "display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}),
        "language_info": {"name": "python"}}
    for i, cell in enumerate(nb.cells):
        where = f"{name}, cell {i}"
        if cell.cell_type == "code":
            cell.source = strip_regions(cell.source, code=True, where=where)
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("execution", None)
        elif cell.cell_type == "markdown":
            cell.source = strip_regions(cell.source, code=False, where=where)
    return nb


def render(path: Path) -> str:
    solution = nbformat.read(path, as_version=4)
    return nbformat.writes(make_exercise(solution, path.name)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report differences")
    parser.add_argument("--solutions", type=Path, default=ROOT / "solutions")
    parser.add_argument("--exercises", type=Path, default=ROOT / "exercises")
    args = parser.parse_args(argv)
    stale = []
    wanted = set()
    for sol in sorted(args.solutions.glob("*.ipynb")):
        target = args.exercises / sol.name
        wanted.add(target.name)
        text = render(sol)
        if target.exists() and target.read_text() == text:
            continue
        stale.append(target.name)
        if not args.check:
            args.exercises.mkdir(exist_ok=True)
            target.write_text(text)
    orphans = sorted(p.name for p in args.exercises.glob("*.ipynb") if p.name not in wanted)
    if args.check:
        for name in stale:
            print(f"out of sync: exercises/{name} (run `make exercises`)")
        for name in orphans:
            print(f"no solution for exercises/{name}")
        return 1 if stale or orphans else 0
    for name in stale:
        print(f"wrote exercises/{name}")
    for name in orphans:
        print(f"warning: exercises/{name} has no solution notebook")
    return 0


if __name__ == "__main__":
    sys.exit(main())
