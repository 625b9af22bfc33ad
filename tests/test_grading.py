"""The grading helpers print one short, useful verdict line, never a traceback."""

from __future__ import annotations

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
