"""No exercise can be copied from its chapter (CONTRIBUTING.md, "Exercise rules").

Two checks, over every chapter found on disk:

* the exercise registry :mod:`paged_lib.course.exercises` gives each exercise's twins (the
  library objects the learner re-implements); no chapter notebook may show a twin's
  source, neither by ``show_source(...)``/``getsource(...)`` of it (or of its class or
  module) nor as lines in a cell's stored output;
* fewer than 40% of the lines of each solution (the ``### BEGIN SOLUTION`` regions of
  ``solutions/NN_*.ipynb``) may appear in what the chapter notebook shows, its code cells
  and their text outputs, "names aside": variable names become ``_`` and ``self.`` is
  dropped, so renaming is not enough to make a copy original.

Run ``python tests/test_no_copying.py`` for a table of every exercise's share.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import keyword
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import nbformat
import pytest

from paged_lib.course.notebooks import code_cells, exercise_headings, solution_spans

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
MAX_SHARE = 0.40
TOKEN = re.compile(r"#.*|[rbfu]*'[^']*'|[rbfu]*\"[^\"]*\"|[A-Za-z_]\w*|\d[\w.]*"
                   r"|==|!=|<=|>=|//|\*\*|->|:=|[^\s\w]")
GENERIC = {"_", "=", "(", ")", ",", ":", "[", "]", "return", "*", "**"}


# ---------------------------------------------------------------- "names aside"

def normalise(line: str) -> str | None:
    """One line as a token string with names replaced by ``_``; None if trivial.

    Attribute names (``.append``, ``tl.load``'s ``load``) and keywords are kept: they say
    what the code does. A line is trivial when it is short or has no structure beyond
    names, calls and assignment (``x = f(y)``), so any two programs share it.
    """
    out: list[str] = []
    code = re.sub(r"\bself\.", "", line.strip())
    for tok in TOKEN.findall(code):
        if tok.startswith("#"):
            break
        name = tok[0].isalpha() or tok[0] == "_"
        if name and not keyword.iskeyword(tok) and not (out and out[-1] == "."):
            tok = "_"
        out.append(tok)
    if len(out) < 5 or set(out) <= GENERIC:
        return None
    return " ".join(out)


def solution_regions(path: Path) -> dict[str, list[str]]:
    """Exercise id -> lines inside its ``### BEGIN/END SOLUTION`` markers (code cells)."""
    regions: dict[str, list[str]] = {}
    current = None
    for cell in nbformat.read(path, as_version=4).cells:
        if headings := exercise_headings(cell):
            current = headings[-1][0]
        elif cell.cell_type == "code" and current:
            lines = cell.source.split("\n")
            for begin, end in solution_spans(cell.source):
                regions.setdefault(current, []).extend(lines[begin:end - 1])
    return regions


def output_text(cell: Any) -> str:
    """What a code cell shows as text: streams, text/plain, Markdown (show_source), HTML."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        for mime in ("text/plain", "text/markdown", "text/html"):
            if mime in out.get("data", {}):
                data = out.data[mime]
                parts.append(re.sub(r"<[^>]+>", "", data) if mime == "text/html" else data)
    return "\n".join(parts)


def shown_lines(chapter: Path) -> set[str]:
    """Normalised lines of every code cell's source and text output of a notebook."""
    shown: set[str] = set()
    for _, cell in code_cells(nbformat.read(chapter, as_version=4)):
        for line in (cell.source + "\n" + output_text(cell)).split("\n"):
            if (norm := normalise(line)) is not None:
                shown.add(norm)
    return shown


def copied_share(lines: list[str], shown: set[str]) -> tuple[float, list[str]]:
    """Share of a solution's non-trivial lines found in ``shown``, and those lines."""
    kept = [(line.strip(), n) for line in lines if (n := normalise(line)) is not None]
    hits = [line for line, n in kept if n in shown]
    return (len(hits) / len(kept) if kept else 0.0), hits


def shares() -> list[tuple[float, str, str, list[str]]]:
    """(share, solution notebook, exercise id, copied lines) for every exercise."""
    rows = []
    for sol in SOLUTIONS:
        chapter = ROOT / "notebooks" / sol.name
        if not chapter.exists():
            continue
        shown = shown_lines(chapter)
        for ex_id, lines in solution_regions(sol).items():
            share, hits = copied_share(lines, shown)
            rows.append((share, sol.name, ex_id, hits))
    return sorted(rows, key=lambda r: -r[0])


# ---------------------------------------------------------------- twins

def resolve(dotted: str) -> Any:
    """``paged_lib.blocks.BlockTable.append_token`` -> the object (longest module first)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def span(obj: Any) -> tuple[str, int, int] | None:
    """(file, first line, last line) of an object's source, None when it has none."""
    obj = getattr(obj, "fn", obj)  # a @triton.jit kernel wraps its function in .fn
    obj = getattr(obj, "__func__", obj)
    try:
        lines, start = inspect.getsourcelines(obj)
        return inspect.getsourcefile(obj) or "", max(start, 1), max(start, 1) + len(lines) - 1
    except (TypeError, OSError):
        return None


def twins() -> list[tuple[str, str, Any]]:
    from paged_lib.course.exercises import EXERCISES

    return [(ex.id, dotted, resolve(dotted)) for ex in EXERCISES.values() for dotted in ex.twins]


def shown_objects(nb: nbformat.NotebookNode) -> list[tuple[int, str, Any]]:
    """(cell, expression, object) for each argument of show_source/getsource calls."""
    ns: dict[str, Any] = {}
    trees = []
    for i, cell in code_cells(nb):
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:  # IPython magics: nothing of interest to us there
            continue
        trees.append((i, tree))
        for node in tree.body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                with contextlib.suppress(Exception):  # a name that is gone: nothing shown
                    exec(compile(ast.Module([node], []), "<imports>", "exec"), ns)
    found = []
    for i, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in (
                    "show_source", "getsource", "getsourcelines"):
                for arg in node.args:
                    expr = ast.unparse(arg)
                    try:
                        found.append((i, expr, eval(expr, dict(ns))))
                    except Exception:  # a notebook variable: the output check still sees it
                        continue
    return found


def twin_lines(obj: Any) -> list[str]:
    """Stripped, non-trivial source lines of a twin, without its docstring."""
    source = textwrap.dedent(inspect.getsource(getattr(obj, "fn", obj)))
    doc = inspect.getdoc(getattr(obj, "fn", obj)) or ""
    doc_lines = {d.strip() for d in doc.split("\n")}
    return [line.strip() for line in source.split("\n")
            if normalise(line) is not None and line.strip() not in doc_lines]


CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.fixture(scope="module")
def all_twins():
    return twins()


def twin_problems(nb: nbformat.NotebookNode, twins: list[tuple[str, str, Any]]) -> list[str]:
    """Every place where a notebook shows a twin's source, as a sentence."""
    problems = []
    shown = [(i, expr, span(obj)) for i, expr, obj in shown_objects(nb)]
    outputs = {line.strip() for _, c in code_cells(nb) for line in output_text(c).split("\n")}
    for ex_id, dotted, obj in twins:
        target = span(obj)
        for i, expr, where in shown:
            if target and where and where[0] == target[0] \
                    and where[1] <= target[1] and target[2] <= where[2]:
                problems.append(f"cell {i} shows the source of `{expr}`, which holds "
                                f"{dotted}, the answer to exercise {ex_id}")
        lines = twin_lines(obj)
        leaked = [line for line in lines if line in outputs]
        if len(leaked) >= 3 and len(leaked) >= 0.3 * len(lines):
            problems.append(f"outputs hold {len(leaked)} of {len(lines)} lines of {dotted} "
                            f"(exercise {ex_id}), e.g. `{leaked[0]}`")
    return problems


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_no_chapter_shows_an_exercise_twin(chapter, all_twins):
    problems = twin_problems(nbformat.read(chapter, as_version=4), all_twins)
    assert not problems, f"{chapter.name}:\n" + "\n".join(problems)


def test_twin_check_sees_show_source_of_the_class_and_copied_outputs():
    from paged_lib.blocks import BlockTable

    twin = [("99.1", "paged_lib.blocks.BlockTable.append_token", BlockTable.append_token)]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("from paged_lib import blocks, show_source"),
                nbformat.v4.new_code_cell("show_source(blocks.BlockTable.__init__)")]
    assert twin_problems(nb, twin) == []
    nb.cells.append(nbformat.v4.new_code_cell("show_source(blocks.BlockTable)"))
    assert ["cell 2 shows the source of `blocks.BlockTable`"] == \
        [p.split(", which")[0] for p in twin_problems(nb, twin)]
    nb.cells = nb.cells[:2]
    printed = inspect.getsource(BlockTable.append_token)
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text=printed)]
    assert "outputs hold" in twin_problems(nb, twin)[0]


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_solutions_are_not_in_their_chapter(solution):
    chapter = ROOT / "notebooks" / solution.name
    if not chapter.exists():
        pytest.skip(f"no chapter notebook for {solution.name}")
    shown = shown_lines(chapter)
    regions = solution_regions(solution)
    assert regions, f"{solution.name} has no solution regions under exercise headings"
    rows = sorted(((copied_share(lines, shown), ex_id) for ex_id, lines in regions.items()),
                  key=lambda r: -r[0][0])
    bad = [f"[{ex_id}] {share:.0%} of its lines are shown in the chapter, e.g. "
           + "; ".join(f"`{h}`" for h in hits[:3])
           for (share, hits), ex_id in rows if share >= MAX_SHARE]
    assert not bad, f"{chapter.name}:\n" + "\n".join(bad)


def test_normalise_puts_names_aside_but_keeps_what_code_does():
    assert normalise("self.blocks.append(self.allocator.allocate())") == \
        normalise("block_table.append(allocator.allocate())")
    assert normalise("offset = n % block_size") == normalise("o = num_tokens % bs  # why")
    assert normalise("offset = n % block_size") != normalise("offset = n // block_size")
    assert normalise("fig = viz.draw(table)") is not None  # has an attribute: kept
    assert normalise("x = f(y)") is None and normalise("return out") is None


def test_copied_share_counts_a_renamed_copy():
    library = "if self.num_tokens % self.block_size == 0:\n" \
              "    self.blocks.append(self.allocator.allocate())\n" \
              "return Slot(self.blocks[-1], self.num_tokens % self.block_size)"
    learner = ["if num_tokens % block_size == 0:",
               "    table.append(alloc.allocate())",
               "return Slot(table[-1], num_tokens % block_size)"]
    shown = {n for line in library.split("\n") if (n := normalise(line))}
    assert copied_share(learner, shown)[0] == 1.0
    assert copied_share(learner, set())[0] == 0.0


if __name__ == "__main__":
    for share, name, ex_id, hits in shares():
        print(f"{share:5.0%}  {name:32} [{ex_id}]  " + " | ".join(hits[:2]))
    sys.exit(0)
