"""The grading helpers print one short, useful verdict line, never a traceback."""

from __future__ import annotations

import numbers
import re
from pathlib import Path

import pytest
import torch

from paged_lib.course import grading
from paged_lib.course.grading import ch00

ROOT = Path(__file__).resolve().parent.parent


def _verdict(capsys, body) -> str:
    with grading.exercise("99.1", "Thing"):
        body()
    return capsys.readouterr().out


def test_pass(capsys):
    assert _verdict(capsys, lambda: grading.expect_equal(3, 3, "x")) == \
        "✅ [99.1] Thing: correct\n"


def test_expected_vs_got_with_hint(capsys):
    out = _verdict(capsys, lambda: grading.expect_equal(2, 3, "blocks", hint="round up"))
    assert out == "❌ [99.1] Thing: blocks: expected 3, got 2\n   hint: round up\n"


def test_lists_name_first_difference(capsys):
    out = _verdict(capsys, lambda: grading.expect_equal([5, 2, 8], [5, 2, 9], "table"))
    assert "first difference at index 2: expected 9, got 8" in out


def test_not_implemented_is_not_attempted(capsys):
    def body():
        raise NotImplementedError()
    assert _verdict(capsys, body).startswith("⏳ [99.1] Thing: not attempted yet")


def test_other_exceptions_are_reported_short(capsys):
    out = _verdict(capsys, lambda: {}["missing"])
    assert out.startswith("❌ [99.1] Thing: your code raised KeyError") and "Traceback" not in out


def test_tensor_close_names_first_wrong_element_and_nan(capsys):
    expected = torch.zeros(2, 3)
    got = expected.clone()
    got[1, 2] = float("nan")
    out = _verdict(capsys, lambda: grading.expect_tensor_close(got, expected, "out"))
    assert "1 of 6 elements differ; first at [1, 2]" in out
    assert "past the end of the sequence" in out


def test_tensor_shape_mismatch(capsys):
    out = _verdict(capsys, lambda: grading.expect_tensor_close(torch.zeros(2), torch.zeros(3),
                                                               "out"))
    assert "expected shape (3,), got (2,)" in out


@pytest.mark.parametrize("fn, mark", [
    (lambda n, b: -(-n // b), "✅"),
    (lambda n, b: n // b, "❌"),
    (lambda n, b: __import__("math").ceil(n / b), "❌"),  # float division fails at 10**18 + 1
])
def test_ch00_ceil_div(capsys, fn, mark):
    ch00.check_ceil_div(fn)
    assert capsys.readouterr().out.startswith(f"{mark} [00.1]")


def test_record_verdicts_sees_every_verdict_in_its_block_only(capsys):
    with grading.exercise("09.0", "Before"):
        pass
    with grading.record_verdicts() as outer:
        ch00.check_ceil_div(lambda n, b: n // b)
        with grading.record_verdicts() as inner, grading.exercise("09.1", "Todo"):
            raise NotImplementedError
    with grading.exercise("09.2", "After"):
        pass
    assert [(m, i) for m, i, _ in outer] == [("❌", "00.1"), ("⏳", "09.1")]
    assert [(m, i) for m, i, _ in inner] == [("⏳", "09.1")]
    assert "expected 1, got 0" in outer[0][2]
    assert "❌ [00.1]" in capsys.readouterr().out  # still printed for the learner


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


def _run_recording(path):
    """Run a solution notebook's cells up to its last check, in-process (as
    ``tools/mutants.py`` does); return, per exercise, what the cells printed before its
    first solution cell and the numbers its check compared (``expected`` of every
    ``expect_*`` call while its check cell ran)."""
    import contextlib
    import io
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    import mutants

    nb = mutants.notebooks.read(path)
    exercises = mutants.find_exercises(nb)
    first = {ex.solution_cells[0]: ex for ex in exercises}
    checks = {ex.check_cell: ex for ex in exercises}
    printed, before, compared = [], {}, {ex.ex_id: [] for ex in exercises}
    recording: list | None = None
    originals = {name: getattr(grading, name) for name in
                 ("expect_equal", "expect_close", "expect_tensor_close")}

    def recorder(name):
        def call(got, expected, *args, **kwargs):
            if recording is not None:
                recording.extend(_numbers(expected))
            return originals[name](got, expected, *args, **kwargs)
        return call

    ns: dict = {"__name__": "__main__"}
    last = max(ex.check_cell for ex in exercises)
    with contextlib.chdir(path.parent), pytest.MonkeyPatch.context() as mp:
        for name in originals:
            mp.setattr(grading, name, recorder(name))
        for i, cell in mutants.code_cells(nb):
            if i > last:
                break
            if i in first:
                before[first[i].ex_id] = "\n".join(printed)
            recording = compared[checks[i].ex_id] if i in checks else None
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                mutants.run_cell(cell.source, ns)
            if i not in checks:
                printed.append(out.getvalue())
    return {ex.ex_id: (before[ex.ex_id], [s for s in compared[ex.ex_id] if _distinctive(s)],
                       _prose_after(nb, ex, exercises))
            for ex in exercises}


def _prose_after(nb, ex, exercises) -> str:
    """The exercise notebook's Markdown from ``ex``'s check to the end, other exercises'
    specs (heading to first solution cell) aside: what a learner reads ahead of time."""
    sys_path_tools = str(ROOT / "tools")
    import sys

    if sys_path_tools not in sys.path:
        sys.path.insert(0, sys_path_tools)
    from make_exercises import strip_regions

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
@pytest.mark.parametrize("path", sorted(ROOT.glob("solutions/[0-9][0-9]_*.ipynb")),
                         ids=lambda p: p.stem)
def test_no_exercise_notebook_prints_a_checked_value_before_the_learners_cell(path):
    """What the cells above an exercise print (in the solution, a superset of what the
    exercise notebook prints) holds none of the numbers its check compares, and neither
    does the Markdown a learner can read ahead (after the check, solution regions
    removed as in exercises/): a learner must not be able to copy an answer."""
    for ex_id, (printed, secrets, prose) in _run_recording(path).items():
        leaked = _gives_away(printed, secrets)
        assert not leaked, f"{path.name}: before exercise {ex_id}, a cell prints {leaked}"
        told = _gives_away(prose, secrets, least=100)  # prose: years, GB, small counts
        assert not told, f"{path.name}: the text after exercise {ex_id} tells its answer {told}"


def test_the_leak_detector_sees_numbers_however_they_are_printed():
    assert _gives_away("26 free blocks, 1,000 slots, 0.3668 of it", [26.0, 1000.0, 0.36683])\
        == ["0.3668", "1,000", "26"]
    assert _gives_away("step 5 of 7: 3.1", [5.0, 3.14159]) == []  # small counts, 2 digits


def test_a_twin_refuses_calls_only_inside_its_exercise_and_is_put_back_after_errors(capsys):
    import paged_lib.util as util
    from paged_lib.util import cdiv

    def body():
        util.cdiv(5, 2)  # refused: this frame is not in paged_lib

    with grading.exercise("00.1", "Ceil division"):
        body()
    out = capsys.readouterr().out
    assert out.startswith("❌ [00.1]") and "called the library's cdiv" in out, out
    with grading.exercise("00.1", "Ceil division"):
        raise RuntimeError("the learner's code crashed")
    assert "RuntimeError" in capsys.readouterr().out
    assert util.cdiv is cdiv and util.cdiv(5, 2) == 3  # put back, and callable again
    with grading.exercise("99.3", "No twin"):  # an exercise without a twin refuses nothing
        assert util.cdiv(5, 2) == 3
    assert capsys.readouterr().out.startswith("✅ [99.3]")
