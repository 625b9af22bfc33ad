#!/usr/bin/env python
"""Mutation testing of the graders: plant small bugs in each solution, count the ❌.

    python tools/mutants.py solutions/03_block_tables.ipynb      # one chapter
    python tools/mutants.py solutions/*.ipynb --cap 20 -v         # more mutants, show all

For every exercise (a ``### Exercise NN.k`` heading, its ``### BEGIN SOLUTION`` regions
and the check cell that prints its verdict) this makes small mutants of the code inside
the solution regions with :mod:`ast`: an integer constant off by one, a ``+ 1``/``- 1``
dropped, ``+``/``-`` and ``*``/``//``/``%`` swapped, a comparison flipped (``<`` vs
``<=``, ``==`` vs ``!=`` ...), a statement dropped. Each mutant replaces the solution
cell; the cells above run once, and each mutant runs in a forked child of that process
(the solution cells, the cells up to the check, the check), where
``paged_lib.course.grading.record_verdicts`` reads the verdict. A grader that answers ✅ to a
mutant lets that bug through.

Mutants that fail to define (they raise while the solution cell runs) are *invalid*,
mutants that run past ``--timeout`` are *hung*, and mutants that kill the process (a
Triton kernel reading wild memory in the interpreter segfaults) are *crashed*; none of
them counts. A grader module may
declare ``EQUIVALENT_MUTANTS = {"NN.k": {"<mutant label>": "why it changes nothing"}}``
for mutants that compute the same thing; those do not count either.

Exercises, solution regions and code cells are read as everywhere else
(:mod:`paged_lib.course.notebooks`), and the cells run in the notebook's folder, but not
in a Jupyter kernel (:func:`paged_lib.course.notebooks.execute`): each mutant needs the
state the cells above left, and a forked child of this process gets it for free in
milliseconds, where a kernel would re-run every cell above for every mutant.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import faulthandler
import functools
import importlib
import io
import json
import linecache
import os
import random
import re
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")
import paged_lib  # noqa: E402,F401,I001  (before anything imports triton)
# isort: split
import nbformat  # noqa: E402

from paged_lib.course import grading, notebooks  # noqa: E402
from paged_lib.course.notebooks import BEGIN_SOLUTION, code_cells, solution_spans  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHECK = re.compile(r"\bcheck\w*\(|\bgrading\.")
SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
         ast.Mod: ast.FloorDiv}
FLIPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
         ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot,
         ast.IsNot: ast.Is}
KINDS = ("constant", "off-by-one", "operator", "compare", "drop")


@dataclass
class Exercise:
    ex_id: str
    solution_cells: list[int]
    check_cell: int


@dataclass
class Outcome:
    label: str
    status: str  # killed, survived, invalid, hung, equivalent
    detail: str = ""


@dataclass
class Report:
    ex_id: str
    outcomes: list[Outcome] = field(default_factory=list)
    error: str = ""  # set when the unmutated solution does not get ✅
    printed_before: str = ""  # what the cells above the first solution cell printed
    compared: list = field(default_factory=list)  # numbers(expected) of the check's expect_*

    def count(self, *statuses: str) -> int:
        return sum(o.status in statuses for o in self.outcomes)

    @property
    def counted(self) -> int:
        return self.count("killed", "survived")

    def line(self) -> str:
        rate = f"{self.count('killed') / self.counted:.0%}" if self.counted else "n/a"
        extra = ", ".join(f"{self.count(s)} {s}" for s in ("invalid", "hung", "crashed",
                                                             "equivalent")
                          if self.count(s))
        return (f"[{self.ex_id}] killed {self.count('killed')}/{self.counted} ({rate})"
                + (f"; {extra}" if extra else ""))


def find_exercises(nb: nbformat.NotebookNode) -> list[Exercise]:
    """Each heading's solution cells and its check cell: the first later code cell that
    calls a ``check...`` or ``grading`` function (else the first later code cell)."""
    found: list[Exercise] = []
    candidates: list[int] = []
    end = nbformat.v4.new_markdown_cell("### Exercise 0.0: end of the notebook")
    for i, cell in enumerate(nb.cells + [end]):
        heading = notebooks.exercise_headings(cell)
        if heading and found and found[-1].solution_cells and candidates:
            checks = [k for k in candidates if CHECK.search(nb.cells[k].source)]
            found[-1].check_cell = (checks or candidates)[0]
        if heading:
            found.append(Exercise(heading[0][0], [], -1))
            candidates = []
        elif cell.cell_type == "code" and found:
            if BEGIN_SOLUTION in cell.source and not candidates:
                found[-1].solution_cells.append(i)
            elif found[-1].solution_cells:
                candidates.append(i)
    return [ex for ex in found if ex.solution_cells and ex.check_cell >= 0]


def _droppable(stmt: ast.stmt, tree: ast.AST) -> bool:
    """Dropping it is a plausible slip, not an instant NameError or a missing return."""
    if isinstance(stmt, ast.Return | ast.FunctionDef | ast.ClassDef | ast.Pass):
        return False
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return False  # a docstring
    if isinstance(stmt, ast.Assign | ast.AnnAssign):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        if names:  # only a re-binding (x = x.clamp(...)) may be dropped
            earlier = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign | ast.AnnAssign)
                       and n.lineno < stmt.lineno
                       for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                       if isinstance(t, ast.Name)}
            args = {a.arg for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                    for a in n.args.args + n.args.kwonlyargs}
            return names <= earlier | args
    return True


def _candidates(tree: ast.AST, spans: list[tuple[int, int]]) -> list[tuple[int, str, object]]:
    """(index in ast.walk order, kind, argument) for every mutation inside the spans."""
    skip: set[int] = set()
    only_up: set[int] = set()  # axis=0 -> axis=-1 is the same axis of a 1-D tensor
    for node in ast.walk(tree):  # messages: mutating them is not a bug in the answer
        if isinstance(node, ast.Raise | ast.JoinedStr):
            skip |= {id(n) for n in ast.walk(node) if n is not node}
        if isinstance(node, ast.keyword) and node.arg in ("axis", "dim"):
            only_up.add(id(node.value))
    out: list[tuple[int, str, object]] = []
    for i, node in enumerate(ast.walk(tree)):
        end = getattr(node, "end_lineno", None)
        if end is None or id(node) in skip or not any(
                a < node.lineno and end < b for a, b in spans):
            continue
        if isinstance(node, ast.Constant) and type(node.value) is int:
            out += [(i, "constant", d) for d in (+1, -1) if d > 0 or id(node) not in only_up]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub) \
                and isinstance(node.right, ast.Constant) and node.right.value == 1:
            out.append((i, "off-by-one", None))
        if isinstance(node, ast.BinOp | ast.AugAssign) and type(node.op) in SWAPS:
            out.append((i, "operator", None))
        if isinstance(node, ast.Compare):
            out += [(i, "compare", k) for k, op in enumerate(node.ops) if type(op) in FLIPS]
        if isinstance(node, ast.stmt) and _droppable(node, tree):
            out.append((i, "drop", None))
    return out


def _apply(source: str, tree: ast.AST, index: int, kind: str, arg: object
           ) -> tuple[ast.AST, str]:
    """A mutated copy of ``tree`` and a label that names the change and its line."""
    line = source.split("\n")[list(ast.walk(tree))[index].lineno - 1].strip()
    new = copy.deepcopy(tree)
    parents = {id(c): p for p in ast.walk(new) for c in ast.iter_child_nodes(p)}
    node = list(ast.walk(new))[index]
    before = ast.unparse(node).split("\n")[0]
    replacement: ast.AST = node
    if kind == "constant":
        node.value += arg
    elif kind == "off-by-one":
        replacement = node.left
    elif kind == "operator":
        node.op = SWAPS[type(node.op)]()
    elif kind == "compare":
        node.ops[arg] = FLIPS[type(node.ops[arg])]()
    elif kind == "drop":
        replacement = ast.Pass()
    if replacement is not node:
        _replace(parents[id(node)], node, replacement)
    after = ast.unparse(replacement).split("\n")[0]
    label = f"{kind}: `{before}` -> `{after}`"
    return ast.fix_missing_locations(new), label + (f" in `{line}`" if line != before else "")


def _replace(parent: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for name, value in ast.iter_fields(parent):
        if isinstance(value, list) and any(v is old for v in value):
            value[[v is old for v in value].index(True)] = new
        elif value is old:
            setattr(parent, name, new)


def mutants(source: str, ex_id: str, cap: int) -> list[tuple[str, str]]:
    """Up to ``cap`` (label, source) mutants, the kinds taking turns, chosen by a fixed seed."""
    code = _python(source)
    tree = ast.parse(code)
    by_kind: dict[str, list] = {k: [] for k in KINDS}
    for cand in _candidates(tree, solution_spans(source)):
        by_kind[cand[1]].append(cand)
    for kind, cands in by_kind.items():
        random.Random(f"{ex_id}:{kind}").shuffle(cands)
    chosen, seen = [], {ast.unparse(tree)}
    while len(chosen) < cap and any(by_kind.values()):
        for kind in KINDS:
            if by_kind[kind] and len(chosen) < cap:
                mutated, label = _apply(code, tree, *by_kind[kind].pop())
                text = ast.unparse(mutated)
                if text not in seen:
                    seen.add(text)
                    chosen.append((label, text))
    return chosen


def _python(source: str) -> str:
    """Cell source with IPython magics turned into plain Python."""
    from IPython.core.inputtransformer2 import TransformerManager
    return TransformerManager().transform_cell(source)


_counter = iter(range(10**9))


class _Shell:
    """Enough of ``get_ipython()`` for the magics course notebooks use, run as plain exec."""

    def __init__(self, ns: dict):
        self.ns = ns

    def run_line_magic(self, name: str, line: str) -> None:
        if name in ("time", "timeit"):
            exec(line.replace("-n1", "").replace("-r1", ""), self.ns)
        elif name not in ("matplotlib", "config", "load_ext", "autoreload"):
            raise NotImplementedError(f"tools/mutants.py cannot run %{name}")

    def run_cell_magic(self, name: str, line: str, cell: str) -> None:
        if name not in ("time", "timeit", "capture"):
            raise NotImplementedError(f"tools/mutants.py cannot run %%{name}")
        exec(cell, self.ns)


def run_cell(source: str, ns: dict) -> None:
    """Exec a cell with its source in linecache (``@triton.jit`` reads it back); a last
    expression is printed as a notebook shows it (its repr, unless the cell ends in ``;``)."""
    name = f"<mutant-cell-{next(_counter)}>"
    code = _python(source)
    ns.setdefault("get_ipython", lambda: _Shell(ns))
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    tree = ast.parse(code, name)
    shown = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) \
        and not code.rstrip().endswith(";") else None
    try:
        exec(compile(tree, name, "exec"), ns)
        if shown is not None and (value := eval(compile(ast.Expression(shown.value), name,
                                                        "eval"), ns)) is not None:
            print(repr(value))
    finally:
        import matplotlib.pyplot as plt
        plt.close("all")


def _equivalent(ex_id: str) -> dict[str, str]:
    module = f"paged_lib.course.grading.ch{ex_id.split('.')[0]}"
    with contextlib.suppress(ImportError):
        return getattr(importlib.import_module(module), "EQUIVALENT_MUTANTS", {}).get(ex_id, {})
    return {}


def _try(label: str, ex: Exercise, cells: list[str], ns: dict,
         record: tuple[list[str], list, Callable] | None = None) -> Outcome:
    """Run one mutant in ``ns``: solution cells, the cells up to the check, the check.
    ``record = (printed, compared, numbers)``: each cell but the check appends what it
    printed to ``printed``; each ``expect_*`` of the check, ``numbers(expected)`` to
    ``compared`` (what tests/test_mutants.py looks for in what a learner sees first)."""
    n = len(ex.solution_cells)
    try:
        for src in cells[:n]:
            _quietly(src, ns, record)
    except Exception as err:
        return Outcome(label, "invalid", f"{type(err).__name__}: {err}")
    try:
        *middle, check = cells[n:]
        with grading.record_verdicts() as seen:
            for src in middle:
                _quietly(src, ns, record)
            with _comparing(record):
                _quietly(check, ns, None)
    except Exception as err:
        return Outcome(label, "killed", f"raised outside the grader: {type(err).__name__}")
    marks = [m for m, i, _ in seen if i == ex.ex_id]
    if marks and all(m == grading.PASS for m in marks):
        return Outcome(label, "survived")
    others = ", ".join(f"{m} [{i}]" for m, i, _ in seen)
    msg = next((t for m, i, t in seen if i == ex.ex_id and m != grading.PASS),
               f"no verdict for {ex.ex_id} (the check cell said: {others or 'nothing'})")
    return Outcome(label, "killed", msg)


def _quietly(source: str, ns: dict, record: tuple | None) -> None:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            run_cell(source, ns)
    finally:
        if record is not None:
            record[0].append(out.getvalue())


@contextlib.contextmanager
def _comparing(record: tuple | None):
    names = ("expect_equal", "expect_close", "expect_tensor_close") if record else ()
    originals = {name: getattr(grading, name) for name in names}

    def recorder(name):
        def call(got, expected, *args, **kwargs):
            record[1].extend(record[2](expected))
            return originals[name](got, expected, *args, **kwargs)
        return call

    try:
        for name in names:
            setattr(grading, name, recorder(name))
        yield
    finally:
        for name, fn in originals.items():
            setattr(grading, name, fn)


def _in_child(run: Callable[[], object], timeout: float, quiet: bool) -> tuple[str, object]:
    """``run()`` in a forked child: ``("ok", its result through JSON)``, ``("hung", "")``
    or ``("crashed", why)``. A kernel that reads wild memory in Triton's interpreter
    segfaults, a mutant may loop forever, a notebook may change global state: none of it
    reaches this process. ``quiet`` silences the child's stderr (glibc's "double free").
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, report as JSON, leave without any clean-up
        os.close(read_end)
        if quiet:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            faulthandler.disable()  # pytest's would print every crash's stack
        try:
            data = json.dumps(["ok", run()], default=dataclasses.asdict)
        except BaseException as err:  # noqa: BLE001 (anything at all: report it)
            data = json.dumps(["crashed", f"{type(err).__name__}: {err}"])
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(data.encode())
        os._exit(0)
    os.close(write_end)
    chunks, deadline = [], time.monotonic() + timeout
    with os.fdopen(read_end, "rb") as pipe:
        while select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))[0]:
            if not (chunk := os.read(pipe.fileno(), 1 << 16)):
                break
            chunks.append(chunk)
        else:
            os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        return ("hung", "") if sig == "SIGKILL" and time.monotonic() >= deadline \
            else ("crashed", f"died of {sig}")
    if not chunks:
        return "crashed", f"exited with status {os.waitstatus_to_exitcode(status)}"
    status_word, result = json.loads(b"".join(chunks))
    return status_word, result


def _isolated(label: str, run: Callable[[], Outcome], timeout: float) -> Outcome:
    """One mutant in a forked child (see :func:`_in_child`); in-process without fork."""
    if not hasattr(os, "fork"):  # Windows: in the process itself, without a timeout
        return run()
    status, result = _in_child(run, timeout, quiet=True)
    return Outcome(**result) if status == "ok" else Outcome(label, status, result)


def run_notebook(path: Path, cap: int = 12, triton_cap: int = 8, timeout: float = 30.0,
                 log=print, equivalent: dict[str, str] | None = None,
                 budget: float = 20.0, numbers: Callable | None = None) -> list[Report]:
    """Mutation-test every exercise of one solution notebook (see module docstring).

    An exercise whose solution is a ``@triton.jit`` kernel gets ``triton_cap`` mutants:
    each one runs the kernel in the interpreter, about a second on a CPU. A check slower
    than a second gets about ``budget`` seconds of mutants, never fewer than 3 (always the
    first ones of the same fixed order). ``equivalent`` (label -> reason) replaces what
    the grader modules declare (for tests of this tool). The notebook itself runs in a
    forked child too, so its cells change nothing in the calling process (a test run).
    With ``numbers`` (an expected value -> a list of floats), each report also holds what
    the cells above its first solution cell printed and what its check compared.
    """
    path = Path(path).resolve()

    def run() -> list[Report]:
        import torch

        torch.set_num_threads(1)  # no OpenMP pool in this child: forking it stays safe
        with contextlib.chdir(path.parent):  # the notebook's folder, as its kernel has
            return _run_notebook(path, cap, triton_cap, timeout, log, equivalent, budget,
                                 numbers)

    if not hasattr(os, "fork"):
        return run()
    status, result = _in_child(run, 3600.0, quiet=False)
    if status != "ok":
        return [Report(path.name, error=f"the notebook run {status}: {result}")]
    return [Report(**{**r, "outcomes": [Outcome(**o) for o in r["outcomes"]]}) for r in result]


def _run_notebook(path: Path, cap: int, triton_cap: int, timeout: float, log,
                  equivalent: dict[str, str] | None, budget: float,
                  numbers: Callable | None = None) -> list[Report]:
    nb = notebooks.read(path)
    exercises = {ex.solution_cells[0]: ex for ex in find_exercises(nb)}
    ns: dict = {"__name__": "__main__"}
    reports: list[Report] = []
    done = set()
    printed: list[str] = []
    record = (printed, [], numbers) if numbers else None
    last = max((ex.check_cell for ex in exercises.values()), default=-1)
    for i, cell in code_cells(nb):
        if i > last:  # nothing after the last check is needed
            break
        if i in done:
            continue
        ex = exercises.get(i)
        if ex is None:
            try:
                _quietly(cell.source, ns, record)
            except Exception as err:  # e.g. a demo cell on code that changed: say, go on
                reports.append(Report(f"cell {i}", error=f"{type(err).__name__}: {err}"))
                log(f"{path.name} cell {i} raised {type(err).__name__}: {err}")
            continue
        snapshot = dict(ns)
        idx = list(range(ex.solution_cells[0], ex.check_cell + 1))
        code = [k for k, _ in code_cells(nb) if k in idx]
        sols = [nb.cells[k].source for k in code if k in ex.solution_cells]
        rest = [nb.cells[k].source for k in code if k not in ex.solution_cells]
        report = Report(ex.ex_id, printed_before="\n".join(printed))
        start = time.perf_counter()
        original = _try("original", ex, sols + rest, ns,  # builds ns for what follows
                        record and (printed, report.compared, numbers))
        took = time.perf_counter() - start
        done.update(code)
        reports.append(report)
        if original.status != "survived":
            report.error = f"the solution itself does not pass: {original.detail}"
            log(f"{path.name} [{ex.ex_id}] {report.error}")
            continue
        same = _equivalent(ex.ex_id) if equivalent is None else equivalent
        slow = any("@triton.jit" in s for s in sols)
        n = triton_cap if slow else cap
        if took > 1.0:
            n = max(3, min(n, int(budget / took)))
        for k, sol_cell in enumerate(ex.solution_cells):
            per_cell = n // len(ex.solution_cells) + (k < n % len(ex.solution_cells))
            for label, src in mutants(nb.cells[sol_cell].source, ex.ex_id, per_cell):
                if label in same:
                    report.outcomes.append(Outcome(label, "equivalent", same[label]))
                    continue
                mutated = list(sols)
                mutated[k] = src
                report.outcomes.append(_isolated(label, functools.partial(
                    _try, label, ex, mutated + rest, snapshot), timeout))
        log(f"{path.name} {report.line()} in {time.perf_counter() - start:.1f}s")
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--cap", type=int, default=12, help="mutants per exercise at most")
    parser.add_argument("--triton-cap", type=int, default=8,
                        help="mutants per exercise whose solution is a Triton kernel")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per mutant")
    parser.add_argument("-v", "--verbose", action="store_true", help="list killed ones too")
    args = parser.parse_args(argv)
    reports = []
    for path in args.notebooks:
        reports += run_notebook(path, args.cap, args.triton_cap, args.timeout)
    for rep in reports:
        for o in rep.outcomes:
            if o.status in ("survived", "hung", "crashed") or args.verbose:
                print(f"  {o.status:9} [{rep.ex_id}] {o.label}  {o.detail[:100]}")
    killed = sum(r.count("killed") for r in reports)
    counted = sum(r.counted for r in reports)
    print(f"kill rate {killed}/{counted} = {killed / max(counted, 1):.1%}")
    broken = [r.ex_id for r in reports if r.error]
    if broken:
        print(f"solutions that do not pass their own check: {', '.join(broken)}")
    return 0 if counted and killed >= 0.95 * counted and not broken else 1


if __name__ == "__main__":
    sys.exit(main())
