"""``make grade``: run the exercise notebooks and print a scoreboard.

    python -m paged_lib.course.grading.scoreboard                 # every exercises/*.ipynb
    python -m paged_lib.course.grading.scoreboard --chapter 03    # one chapter
    python -m paged_lib.course.grading.scoreboard --strict        # unfinished counts as failed

Each notebook runs in a fresh kernel in its own folder
(:func:`paged_lib.course.notebooks.execute`), every cell whatever the cells above did,
so one unfinished exercise does not hide the next. Exercises are found by their Markdown
headings (``### Exercise 03.2: title``); each check cell prints a verdict line (see
:mod:`paged_lib.course.grading`) that is collected here.

Exit status: 1 if any exercise failed (or, with ``--strict``, is unfinished), else 0.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from paged_lib.course import notebooks
from paged_lib.course.grading import FAIL, PASS, TODO, VERDICT_RE

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
        for ex_id, title in notebooks.exercise_headings(cell):
            by_id[ex_id] = Exercise(ex_id, title)
            result.exercises.append(by_id[ex_id])
            section = ex_id
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


def grade(paths: list[Path], timeout: int = 600, progress: bool = False) -> list[NotebookResult]:
    """Run each notebook (every cell, going on after errors) and read its verdicts."""
    results = []
    for path in map(Path, paths):
        if progress:
            print(f"  {path.name} ...", end="", flush=True)
        start = time.perf_counter()
        results.append(collect(notebooks.execute(path, timeout, keep_going=True), path))
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
    print(f"Grading {len(paths)} notebook(s) in {args.folder}/ (each in a fresh kernel):",
          flush=True)
    results = grade(paths, args.timeout, progress=True)
    text, counts = render(results)
    print("\n" + text)
    from paged_lib.course import mine  # what the passing checks saved for chapter 13

    print(mine.share_line(mine.save_folder_for(args.folder)))
    bad = counts["failed"] + (counts["not attempted"] if args.strict else 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
