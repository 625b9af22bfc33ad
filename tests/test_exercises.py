"""The exercise loop: generation from solutions, shipped stubs, and the scoreboard."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest

from paged_lib.course.grading import scoreboard

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import make_exercises  # noqa: E402

SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))


def test_every_solution_has_an_exercise_in_sync():
    assert [p.name for p in SOLUTIONS] == [p.name for p in EXERCISES]
    for sol in SOLUTIONS:
        assert make_exercises.render(sol) == (ROOT / "exercises" / sol.name).read_text(), \
            f"exercises/{sol.name} is out of sync: run `make exercises`"


def test_exercises_hold_no_solutions_or_outputs():
    for path in EXERCISES:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            assert "### BEGIN SOLUTION" not in cell.source
            assert "HIDDEN TESTS" not in cell.source
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_stored_outputs_pass_every_exercise(path):
    """nbval (strict) proves the stored outputs reproduce; here they must all be ✅."""
    result = scoreboard.collect(nbformat.read(path, as_version=4), path)
    assert result.exercises, f"{path.name} declares no '### Exercise NN.k: title' heading"
    for ex in result.exercises:
        assert ex.mark == "✅", f"{path.name} exercise {ex.ex_id}: {ex.message}"
    assert not result.errors


@pytest.fixture(scope="module")
def shipped():
    """Run every shipped exercise notebook once (the slow part of this file)."""
    return scoreboard.grade(EXERCISES)


def test_shipped_exercises_fail_only_with_not_implemented(shipped):
    for result in shipped:
        for err in result.errors:
            assert err.ename == "NotImplementedError" and err.learner_cell, (
                f"{result.path.name} cell {err.index} raised {err.ename}: {err.evalue} "
                "(a shipped exercise may only stop in a learner's `# YOUR CODE HERE` cell)")


def test_shipped_exercises_are_all_not_attempted(shipped):
    for result in shipped:
        assert result.exercises
        for ex in result.exercises:
            assert ex.mark == "⏳", f"{result.path.name} {ex.ex_id}: {ex.mark} {ex.message}"
    text, counts = scoreboard.render(shipped)
    assert counts["passed"] == counts["failed"] == 0
    assert f"{counts['not attempted']} not attempted" in text


def _paste_solutions(exercise: Path, solution: Path, out: Path) -> None:
    """What a learner does: put working code where the stubs are."""
    ex_nb = nbformat.read(exercise, as_version=4)
    sol_nb = nbformat.read(solution, as_version=4)
    for ex_cell, sol_cell in zip(ex_nb.cells, sol_nb.cells, strict=True):
        if "# YOUR CODE HERE" in ex_cell.source:
            ex_cell.source = "\n".join(
                line for line in sol_cell.source.split("\n")
                if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))
    nbformat.write(ex_nb, out)


def _code_cells(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def test_pasting_the_solutions_into_the_exercises_gives_the_solutions_code(tmp_path):
    """A learner who pastes the solutions runs exactly the code cells of solutions/ (the
    markers aside), so the ✅ that nbval reproduces there (see
    test_solution_stored_outputs_pass_every_exercise) is that learner's too."""
    for sol in SOLUTIONS:
        _paste_solutions(ROOT / "exercises" / sol.name, sol, tmp_path / sol.name)
        pasted = _code_cells(nbformat.read(tmp_path / sol.name, as_version=4))
        solved = ["\n".join(line for line in src.split("\n")
                            if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))
                  for src in _code_cells(nbformat.read(sol, as_version=4))]
        assert pasted == solved, f"exercises/{sol.name} with the solutions pasted in " \
            f"is not solutions/{sol.name}'s code"


def test_grade_passes_with_solution_code_pasted_in(tmp_path, capsys):
    """The scoreboard end to end on two chapters (every other chapter's pasted code is
    its solution's: the test above; running them all here again took 170 s)."""
    work = tmp_path / "exercises"
    work.mkdir()
    chosen = SOLUTIONS[:2]
    for sol in chosen:
        _paste_solutions(ROOT / "exercises" / sol.name, sol, work / sol.name)
    assert scoreboard.main([str(work)]) == 0
    out = capsys.readouterr().out
    total = sum(len(scoreboard.collect(nbformat.read(s, as_version=4), s).exercises)
                for s in chosen)
    assert f"{total} passed, 0 failed, 0 not attempted (of {total} exercises)" in out


def test_grade_reports_a_wrong_answer_and_exits_1(tmp_path, capsys):
    nb = nbformat.read(ROOT / "exercises" / "00_setup_and_tour.ipynb", as_version=4)
    for cell in nb.cells:
        if "# YOUR CODE HERE" in cell.source:
            cell.source = "def ceil_div(n, b):\n    return n // b\n"
    nbformat.write(nb, tmp_path / "00_setup_and_tour.ipynb")
    assert scoreboard.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "❌ 00.1" in out and "expected 1, got 0" in out
    assert "0 passed, 1 failed, 0 not attempted" in out


def _nb(*cells):
    nb = nbformat.v4.new_notebook()
    for kind, source, outputs in cells:
        if kind == "md":
            nb.cells.append(nbformat.v4.new_markdown_cell(source))
        else:
            cell = nbformat.v4.new_code_cell(source)
            cell.outputs = [nbformat.from_dict(o) for o in outputs]
            nb.cells.append(cell)
    return nb


def test_collect_reads_verdicts_and_explains_errors():
    nb = _nb(
        ("md", "### Exercise 09.1: First", []),
        ("code", "x", [{"output_type": "stream", "name": "stdout",
                        "text": "❌ [09.1] First: f(2): expected 4, got 5\n   hint: h\n"}]),
        ("md", "### Exercise 09.2: Second", []),
        ("code", "# YOUR CODE HERE\nraise NotImplementedError()",
         [{"output_type": "error", "ename": "NotImplementedError", "evalue": "",
           "traceback": []}]),
        ("md", "### Exercise 09.3: Third", []),
        ("code", "check(g)", [{"output_type": "error", "ename": "NameError",
                               "evalue": "name 'g' is not defined", "traceback": []}]),
    )
    result = scoreboard.collect(nb, Path("09_x.ipynb"))
    marks = {e.ex_id: (e.mark, e.message) for e in result.exercises}
    assert marks["09.1"] == ("❌", "f(2): expected 4, got 5")
    assert marks["09.2"] == ("⏳", "not attempted yet")
    assert marks["09.3"][0] == "❌" and "NameError" in marks["09.3"][1]


@pytest.mark.parametrize("source, message", [
    ("a\n### END SOLUTION\n", "END marker without BEGIN"),
    ("### BEGIN SOLUTION\nx = 1\n", "never closed"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "nested"),
])
def test_marker_errors_say_where(source, message):
    with pytest.raises(make_exercises.MarkerError, match=message):
        make_exercises.strip_regions(source, code=True, where="x.ipynb, cell 3")


def test_regions_keep_indentation_and_drop_hidden_tests():
    src = ("def f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n"
           "### BEGIN HIDDEN TESTS\nassert f(1) == 2\n### END HIDDEN TESTS\nprint(f)")
    assert make_exercises.strip_regions(src, code=True, where="t") == (
        "def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError()\nprint(f)")
    assert make_exercises.strip_regions("Answer:\n### BEGIN SOLUTION\nB\n### END SOLUTION",
                                        code=False, where="t") == "Answer:\nYOUR ANSWER HERE"


def test_grade_goes_on_after_a_dead_kernel_and_blames_its_cell(tmp_path):
    """A learner's kernel that crashes the process (a wild Triton read can) is a ❌ of
    its exercise, not the end of ``make grade``."""
    nb = _nb(("md", "### Exercise 09.1: Crash", []),
             ("code", "import os\nos.kill(os.getpid(), 9)", []),
             ("md", "### Exercise 09.2: After it", []),
             ("code", "print('never runs')", []))
    path = tmp_path / "09_crash.ipynb"
    nbformat.write(nb, path)
    [result] = scoreboard.grade([path], timeout=60)
    marks = {e.ex_id: (e.mark, e.message) for e in result.exercises}
    assert marks["09.1"][0] == "❌" and "DeadKernelError" in marks["09.1"][1]
    assert marks["09.2"] == ("⏳", "not run")


def test_execute_stores_a_run_of_prints_as_one_output():
    from paged_lib.course.notebooks import _coalesce_streams

    out = [nbformat.v4.new_output("stream", name="stdout", text="a\n"),
           nbformat.v4.new_output("stream", name="stdout", text="b\n"),
           nbformat.v4.new_output("stream", name="stderr", text="c\n"),
           nbformat.v4.new_output("stream", name="stdout", text="d\n")]
    assert [(o.name, o.text) for o in _coalesce_streams(out)] == [
        ("stdout", "a\nb\n"), ("stderr", "c\n"), ("stdout", "d\n")]
