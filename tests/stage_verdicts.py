"""What a grader says about a piece, with and without its generated stage: shared by the
tests of the generated stages (``tests/test_generated_*.py``)."""

from __future__ import annotations

import contextlib
import io

from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric


def verdict(check, fn, monkeypatch=None, stage=numeric):
    """(mark, message, hint) of the grader on ``fn``; with ``monkeypatch``, without the
    generated stage (``stage.check``, as the grader's module imported it)."""
    if monkeypatch is not None:
        monkeypatch.setattr(stage, "check", lambda *args, **kwargs: None)
    with grading.record_verdicts() as seen, contextlib.redirect_stdout(io.StringIO()) as out:
        check(fn)
    if monkeypatch is not None:
        monkeypatch.undo()
    mark, _, message = seen[-1]
    printed = out.getvalue()
    return mark, message, printed.split("hint: ", 1)[1] if "hint: " in printed else ""


def caught_only_by_the_stage(check, wrong, monkeypatch, *words):
    """``wrong`` passes the fixed cases, and the generated stage's story names ``words``;
    returns the hint."""
    assert verdict(check, wrong, monkeypatch)[0] == "✅"
    mark, message, hint = verdict(check, wrong)
    assert mark == "❌" and message.startswith("generated case"), message
    for w in words:
        assert w in message, message
    return hint
