"""``make grade``: run the exercise notebooks and print a scoreboard.

    python -m paged_lib.course.grading.scoreboard                 # every exercises/*.ipynb
    python -m paged_lib.course.grading.scoreboard --chapter 03    # one chapter
    python -m paged_lib.course.grading.scoreboard --strict        # unfinished counts as failed

Each notebook runs under nbval (``pytest --nbval-lax``): a fresh kernel in the notebook's
own folder, one test per code cell, going on after an error so one unfinished exercise
does not hide the next. Exercises are found
by their Markdown headings (``### Exercise 03.2: title``); each check cell prints a
verdict line (see :mod:`paged_lib.course.grading`) that is collected here.

Exit status: 1 if any exercise failed (or, with ``--strict``, is unfinished), else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from paged_lib.course.grading import FAIL, PASS, TODO, VERDICT_RE

HEADING_RE = re.compile(r"^#+\s*Exercise\s+(\d+\.\d+)\s*[:.\-\u2014]\s*(.+?)\s*$", re.M)
_VERDICT = re.compile(VERDICT_RE + r"(.*)$", re.M)
STATUS = {PASS: "passed", FAIL: "failed", TODO: "not attempted"}


@dataclass
class Exercise:
    ex_id: str
    title: str
    mark: str = TODO
    message: str = "not run"


@dataclass
class CellError:
    index: int
    ename: str
    evalue: str
    learner_cell: bool  # the cell holds a `# YOUR CODE HERE` part
    section: str | None  # id of the exercise heading above the cell


@dataclass
class NotebookResult:
    path: Path
    exercises: list[Exercise] = field(default_factory=list)
    errors: list[CellError] = field(default_factory=list)


def _text(outputs: list) -> str:
    parts = []
    for out in outputs:
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def collect(nb, path: Path) -> NotebookResult:
    """Read exercises, verdicts and errors off an executed notebook."""
    result = NotebookResult(path)
    by_id: dict[str, Exercise] = {}
    section = None
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            for ex_id, title in HEADING_RE.findall(cell.source):
                by_id[ex_id] = Exercise(ex_id, title)
                result.exercises.append(by_id[ex_id])
                section = ex_id
            continue
        if cell.cell_type != "code":
            continue
        for mark, ex_id, rest in _VERDICT.findall(_text(cell.get("outputs", []))):
            ex = by_id.setdefault(ex_id, Exercise(ex_id, rest.split(":")[0]))
            if ex not in result.exercises:
                result.exercises.append(ex)
            message = rest.split(": ", 1)[1] if ": " in rest else rest
            ex.mark, ex.message = mark, message
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                result.errors.append(CellError(i, out["ename"], out["evalue"],
                                               "# YOUR CODE HERE" in cell.source, section))
    # An error in an exercise's section whose check never printed a verdict explains it.
    for err in result.errors:
        ex = by_id.get(err.section or "")
        if ex is None or ex.message != "not run":
            continue
        if err.ename == "NotImplementedError":
            ex.message = "not attempted yet"
        else:
            ex.mark = FAIL
            ex.message = f"cell {err.index} raised {err.ename}: {err.evalue}"[:200]
    return result


def run_notebooks(paths: list[Path], timeout: int = 600) -> list:
    """Execute notebooks under nbval (``pytest --nbval-lax``) and return them with outputs.

    Each code cell is one nbval test run in a fresh kernel per notebook, in the notebook's
    folder; a failing cell does not stop the cells after it. Nothing is saved back.
    """
    import nbformat

    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "outputs.json"
        cmd = [sys.executable, "-m", "pytest", "--nbval-lax", "-p", "no:cacheprovider",
               "-p", "paged_lib.course.grading.nbval_plugin", f"--scoreboard-json={record}",
               f"--nbval-cell-timeout={timeout}", "--tb=no", "-q", "--no-header", "-rN",
               "-W", "ignore", *map(str, paths)]
        env = {**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}
        proc = subprocess.run(cmd, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
        if not record.exists():
            raise RuntimeError(f"nbval did not run the notebooks:\n{proc.stdout or ''}")
        recorded = json.loads(record.read_text())
    notebooks = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        cells = recorded.get(str(path.resolve()), {})
        code = [c for c in nb.cells if c.cell_type == "code"]
        for k, cell in enumerate(code):
            cell.outputs = [nbformat.from_dict(o) for o in cells.get(str(k), [])]
        notebooks.append(nb)
    return notebooks


def grade(paths: list[Path], timeout: int = 600, progress: bool = False) -> list[NotebookResult]:
    """Run each notebook under nbval and read its exercises' verdicts."""
    results = []
    for path in map(Path, paths):
        if progress:
            print(f"  {path.name} ...", end="", flush=True)
        start = time.perf_counter()
        [nb] = run_notebooks([path], timeout)
        results.append(collect(nb, path))
        if progress:
            print(f" {time.perf_counter() - start:.0f} s", flush=True)
    return results


def render(results: list[NotebookResult]) -> tuple[str, dict[str, int]]:
    counts = {"passed": 0, "failed": 0, "not attempted": 0}
    lines = []
    width = max((len(e.title) for r in results for e in r.exercises), default=10)
    for r in results:
        lines.append(r.path.stem)
        if not r.exercises:
            lines.append("   (no exercises found)")
        for e in r.exercises:
            status = STATUS[e.mark]
            counts[status] += 1
            detail = f"  {e.message}" if e.mark == FAIL else ""
            lines.append(f"   {e.mark} {e.ex_id:<5} {e.title:<{width}}  {status}{detail}")
    total = sum(counts.values())
    lines.append("")
    lines.append(f"{counts['passed']} passed, {counts['failed']} failed, "
                 f"{counts['not attempted']} not attempted (of {total} exercises)")
    return "\n".join(lines), counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Grade the exercise notebooks.")
    parser.add_argument("folder", nargs="?", type=Path, default=Path("exercises"))
    parser.add_argument("--chapter", help="only this chapter, e.g. 03")
    parser.add_argument("--strict", action="store_true",
                        help="unfinished exercises count as failures")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    pattern = f"{args.chapter}_*.ipynb" if args.chapter else "*.ipynb"
    paths = sorted(args.folder.glob(pattern))
    if not paths:
        print(f"no notebooks match {args.folder / pattern}", file=sys.stderr)
        return 2
    print(f"Grading {len(paths)} notebook(s) in {args.folder}/ (each runs under nbval):",
          flush=True)
    results = grade(paths, args.timeout, progress=True)
    text, counts = render(results)
    print("\n" + text)
    bad = counts["failed"] + (counts["not attempted"] if args.strict else 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
