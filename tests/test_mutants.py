"""Graders catch small bugs: mutants of every solution must get ❌ (tools/mutants.py).

The slow part (every solution notebook, about two and a half minutes on 2 cores) runs once
per module; the same run records what the leak test at the end of this file reads.
The small tests first check the mutation machinery itself on a made-up notebook, so a
kill rate of 100% cannot come from a tool that never plants a bug.
"""

from __future__ import annotations

import numbers
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import mutants  # noqa: E402

SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
MIN_KILL_RATE = 0.95

STRONG = """from paged_lib.course import grading
def check(f):
    with grading.exercise("99.1", "Last block"):
        for n, b, want in [(0, 4, 0), (1, 4, 1), (4, 4, 4), (5, 4, 1), (8, 4, 4), (3, 1, 1)]:
            grading.expect_equal(f(n, b), want, f"last_block({n}, {b})")
"""
WEAK = STRONG.replace("[(0, 4, 0), (1, 4, 1), (4, 4, 4), (5, 4, 1), (8, 4, 4), (3, 1, 1)]",
                      "[(5, 4, 1)]")
SOLUTION = """def last_block(n: int, b: int) -> int:
    \"\"\"Tokens in the last block of n tokens, blocks of b (0 for none).\"\"\"
    ### BEGIN SOLUTION
    if n == 0:
        return 0
    blocks = (n + b - 1) // b
    return n - (blocks - 1) * b
    ### END SOLUTION
"""
LOOPING = SOLUTION.replace("""    if n == 0:
        return 0
    blocks = (n + b - 1) // b
    return n - (blocks - 1) * b
""", """    while n > b:
        n -= b
    return n
""")


def _toy(tmp_path: Path, grader: str, solution: str = SOLUTION) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(grader),
                nbformat.v4.new_markdown_cell("### Exercise 99.1: Last block"),
                nbformat.v4.new_code_cell(solution),
                nbformat.v4.new_code_cell("check(last_block)")]
    path = tmp_path / "99_toy.ipynb"
    nbformat.write(nb, path)
    return path


def test_mutants_cover_every_kind_and_stay_inside_the_solution_region():
    source = "LIMIT = 10\n" + SOLUTION
    labels = [label for label, _ in mutants.mutants(source, "99.1", cap=100)]
    assert {label.split(":")[0] for label in labels} == set(mutants.KINDS)
    assert not any("LIMIT" in label for label in labels), "mutated code outside the markers"
    assert "compare: `n == 0` -> `n != 0` in `if n == 0:`" in labels
    assert "off-by-one: `n + b - 1` -> `n + b` in `blocks = (n + b - 1) // b`" in labels
    assert "drop: `if n == 0:` -> `pass`" in labels
    assert len(mutants.mutants(source, "99.1", cap=4)) == 4
    assert mutants.mutants(source, "99.1", cap=6) == mutants.mutants(source, "99.1", cap=6)


def _run(tmp_path: Path, grader: str, solution: str = SOLUTION, **kw) -> mutants.Report:
    (report,) = mutants.run_notebook(_toy(tmp_path, grader, solution), log=lambda *_: None,
                                     **{"cap": 100, **kw})
    return report


def test_a_strong_grader_kills_every_mutant(tmp_path):
    report = _run(tmp_path, STRONG)
    assert not report.error
    assert report.counted >= 12 and report.count("killed") == report.counted


def test_a_weak_grader_lets_mutants_survive(tmp_path):
    report = _run(tmp_path, WEAK)
    survivors = [o.label for o in report.outcomes if o.status == "survived"]
    assert "drop: `if n == 0:` -> `pass`" in survivors
    assert "constant: `0` -> `1` in `if n == 0:`" in survivors
    assert report.count("killed") >= 1  # `n == 0` -> `n != 0` still fails on (5, 4)


def test_declared_equivalent_mutants_are_not_counted(tmp_path):
    label = "drop: `if n == 0:` -> `pass`"
    report = _run(tmp_path, WEAK, equivalent={label: "the weak grader never asks for 0"})
    assert [o.label for o in report.outcomes if o.status == "equivalent"] == [label]


def test_a_solution_that_fails_its_own_check_is_reported(tmp_path):
    report = _run(tmp_path, STRONG, SOLUTION.replace("return 0", "return 1"))
    assert "does not pass" in report.error and not report.outcomes


def test_a_mutant_that_hangs_is_stopped_and_not_counted(tmp_path):
    report = _run(tmp_path, STRONG, LOOPING, timeout=0.5)
    hung = [o.label for o in report.outcomes if o.status == "hung"]
    assert "drop: `n -= b` -> `pass`" in hung  # the loop never ends for n = 5
    assert report.counted == len(report.outcomes) - len(hung) > 0


def test_a_mutant_that_kills_the_process_is_isolated_and_not_counted(tmp_path):
    grader = "import os\n" + STRONG
    crashing = SOLUTION.replace("    if n == 0:\n", "    if n < 0:\n        os.abort()\n"
                                "    if n == 0:\n")
    report = _run(tmp_path, grader, crashing)
    crashed = {o.label: o.detail for o in report.outcomes if o.status == "crashed"}
    assert crashed.get("compare: `n < 0` -> `n <= 0` in `if n < 0:`") == "died of SIGABRT"
    assert report.count("killed") >= 12  # the mutants after it still ran


@pytest.fixture(scope="module")
def reports() -> list[tuple[str, mutants.Report]]:
    out = []
    for path in SOLUTIONS:
        out += [(path.name, r) for r in mutants.run_notebook(path, log=print,
                                                             numbers=_numbers)]
    return out


@pytest.mark.slow
def test_every_solution_passes_its_own_check_in_process(reports):
    broken = [f"{name} [{r.ex_id}]: {r.error}" for name, r in reports if r.error]
    assert not broken, "\n".join(broken)


@pytest.mark.slow
def test_graders_kill_at_least_95_percent_of_mutants(reports):
    lines = [f"{name} {r.line()}" for name, r in reports]
    lines += [f"  survived [{r.ex_id}] {o.label}" for _, r in reports for o in r.outcomes
              if o.status == "survived"]
    print("\n".join(lines))
    killed = sum(r.count("killed") for _, r in reports)
    counted = sum(r.counted for _, r in reports)
    assert counted >= 3 * len(reports), "too few mutants to measure anything"
    assert killed >= MIN_KILL_RATE * counted, (
        f"graders killed {killed} of {counted} mutants ({killed / counted:.1%}), "
        f"below {MIN_KILL_RATE:.0%}:\n" + "\n".join(lines))


# ------------------------------------------- no exercise notebook prints a checked value

_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,_]*(?:\.\d+)?(?:e-?\d+)?%?(?![\w])")


def _numbers(value) -> list[float]:
    """The numbers in an expected value (ints, floats, and those inside tuples, dicts...)."""
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, numbers.Number):
        return [float(value)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, list | tuple | set | frozenset):
        return [x for v in value for x in _numbers(v)]
    return []  # tensors: too many numbers to be a giveaway one by one


def _distinctive(x: float) -> bool:
    """Worth keeping secret: not a small count (0-9) that any output contains anyway."""
    if x != x or x in (float("inf"), float("-inf")):
        return False
    if float(x).is_integer():  # powers of two are block sizes and dimensions everywhere
        n = abs(int(x))
        return n >= 10 and n & (n - 1) != 0
    return abs(x) >= 1e-3


def _printed(text: str) -> list[tuple[str, float]]:
    out = []
    for token in _NUMBER.findall(text):
        raw = token.rstrip("%").replace(",", "").replace("_", "")
        try:
            out.append((token, float(raw)))
        except ValueError:
            continue
    return out


def _gives_away(printed: str, secrets: list[float], least: int = 10) -> list[str]:
    secrets = [s for s in secrets if _distinctive(s)
               and (abs(s) >= least or not float(s).is_integer())]
    found = []
    for token, x in _printed(printed):
        digits = len(token.replace("-", "").replace(".", "").replace(",", "").lstrip("0"))
        for s in secrets:
            if float(s).is_integer() and x == s:
                found.append(token)
            elif not float(s).is_integer() and digits >= 3 and \
                    abs(x - s) <= 5e-4 * abs(s):
                found.append(token)
    return sorted(set(found))


def _prose_after(nb, ex, exercises) -> str:
    """The exercise notebook's Markdown from ``ex``'s check to the end, other exercises'
    specs (heading to first solution cell) aside: what a learner reads ahead of time."""
    from make_exercises import strip_regions  # tools/, on sys.path since the top

    specs = set()
    for other in exercises:
        heading = max(i for i in range(other.solution_cells[0])
                      if nb.cells[i].cell_type == "markdown"
                      and "### Exercise" in nb.cells[i].source)
        specs.update(range(heading, other.solution_cells[0]))
    return "\n".join(strip_regions(c.source, code=False, where="")
                     for i, c in enumerate(nb.cells)
                     if i > ex.check_cell and c.cell_type == "markdown" and i not in specs)


@pytest.mark.slow
def test_no_exercise_notebook_prints_a_checked_value_before_the_learners_cell(reports):
    """What the cells above an exercise print (in the solution, a superset of what the
    exercise notebook prints) holds none of the numbers its check compares, and neither
    does the Markdown a learner can read ahead (after the check, solution regions
    removed as in exercises/): a learner must not be able to copy an answer. (The run
    that mutation-tests the solutions records both, in-process as a kernel would.)"""
    assert sum(bool(r.compared) for _, r in reports) > len(SOLUTIONS), "checks recorded"
    leaks = []
    for path in SOLUTIONS:
        nb = mutants.notebooks.read(path)
        exercises = mutants.find_exercises(nb)
        got = {r.ex_id: r for name, r in reports if name == path.name}
        for ex in exercises:
            secrets = [s for s in got[ex.ex_id].compared if _distinctive(s)]
            if leaked := _gives_away(got[ex.ex_id].printed_before, secrets):
                leaks.append(f"{path.name}: before exercise {ex.ex_id}, a cell prints {leaked}")
            if told := _gives_away(_prose_after(nb, ex, exercises), secrets, least=100):
                leaks.append(f"{path.name}: the text after exercise {ex.ex_id} tells its "
                             f"answer {told}")  # prose: years, GB, small counts
    assert not leaks, "\n".join(leaks)


def test_a_cells_last_expression_is_printed_as_a_notebook_shows_it(capsys):
    ns: dict = {}
    for cell in ("x = 3\nx * 41", "x * 2;", "print('hi')", "%time y = 5\ny + 1"):
        mutants.run_cell(cell, ns)
    assert capsys.readouterr().out == "123\nhi\n6\n"  # `;` hides it, None is not shown


def test_the_leak_detector_sees_numbers_however_they_are_printed():
    assert _gives_away("26 free blocks, 1,000 slots, 0.3668 of it", [26.0, 1000.0, 0.36683])\
        == ["0.3668", "1,000", "26"]
    assert _gives_away("step 5 of 7: 3.1", [5.0, 3.14159]) == []  # small counts, 2 digits
