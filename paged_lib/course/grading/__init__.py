"""Self-grading for the exercise notebooks.

A check cell in an exercise notebook looks like this::

    with grading.exercise("01.1", "KV bytes per token"):
        grading.expect_equal(my_kv_bytes_per_token(SPECS["llama-2-70b"]), 327_680,
                             what="bytes per token of LLaMA-2-70B",
                             hint="2 (K and V) x layers x KV heads x head_dim x bytes")

``exercise`` runs the block and prints exactly one verdict line, never a traceback:

* ``✅ [01.1] KV bytes per token: correct``
* ``❌ [01.1] KV bytes per token: bytes per token of LLaMA-2-70B: expected 327680, got 655360``
  followed by an indented hint;
* ``⏳ [01.1] KV bytes per token: not attempted yet ...`` when the learner's code still
  raises ``NotImplementedError``.

``make grade`` (:mod:`paged_lib.course.grading.scoreboard`) executes the exercise notebooks and
collects these lines into a scoreboard. Chapter-specific checks live in
``paged_lib/course/grading/chNN.py`` and are built from the ``expect_*`` helpers below.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from paged_lib.util import CheckFailed

T = TypeVar("T")
PASS, FAIL, TODO = "✅", "❌", "⏳"
VERDICT_RE = r"^(✅|❌|⏳) \[([\w.\-]+)\] "
# Lists that ``record_verdicts`` hands out; every verdict is appended to each of them.
_recorders: list[list[tuple[str, str, str]]] = []


def fail(message: str, hint: str | None = None) -> None:
    raise CheckFailed(message, hint)


def expect_true(condition: bool, message: str, hint: str | None = None) -> None:
    """Fail with ``message`` unless ``condition`` holds."""
    if not condition:
        fail(message, hint)


def expect_equal(got: Any, expected: Any, what: str, hint: str | None = None) -> None:
    """Exact equality (ints, strings, tuples, lists ...), reporting expected vs got."""
    if type(got).__name__ == "Tensor":
        got = got.tolist()
    if got != expected:
        detail = _first_difference(got, expected)
        fail(f"{what}: expected {expected!r}, got {got!r}{detail}", hint)


def expect_int(got: Any, what: str, hint: str | None = None) -> None:
    """The spec asks for an int (numpy's count too): a float, even 3.0, means a ``/`` or
    a ``math.ceil`` of a float slipped in."""
    if isinstance(got, bool) or not isinstance(got, numbers.Integral):
        fail(f"{what}: expected an int, got {got!r} (a {type(got).__name__})",
             hint or "counts (bytes, slots, blocks, steps, requests) are whole numbers: stay "
             "in integers with // and cdiv, not / or math.ceil on a float")


def expect_close(got: float, expected: float, what: str, rel: float = 1e-6, abs_: float = 0.0,
                 hint: str | None = None) -> None:
    """Floating-point equality within a relative (and optional absolute) tolerance."""
    try:
        ok = math.isclose(float(got), float(expected), rel_tol=rel, abs_tol=abs_)
    except (TypeError, ValueError):
        fail(f"{what}: expected a number close to {expected:.6g}, got {got!r}", hint)
    if not ok:
        fail(f"{what}: expected {expected:.6g}, got {float(got):.6g}", hint)


def expect_tensor_close(got: Any, expected: Any, what: str, atol: float = 1e-5,
                        rtol: float = 1e-5, hint: str | None = None) -> None:
    """Compare tensors: shape first, then values; names the first wrong element.

    NaN in ``got`` where ``expected`` is finite counts as wrong, which is how the kernel
    checks catch reads of poisoned (never written) cache slots.
    """
    import torch

    if not isinstance(got, torch.Tensor):
        fail(f"{what}: expected a torch.Tensor, got {type(got).__name__}", hint)
    expected = torch.as_tensor(expected)
    if tuple(got.shape) != tuple(expected.shape):
        fail(f"{what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}", hint)
    g = got.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    bad = ~torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
    if bad.any():
        n_bad = int(bad.sum())
        first = tuple(int(i) for i in bad.nonzero()[0])
        idx = ", ".join(map(str, first))
        gv, ev = g[first].item(), e[first].item()
        nan_note = " (NaN: did you read a slot past the end of the sequence?)" \
            if math.isnan(gv) and not math.isnan(ev) else ""
        fail(f"{what}: {n_bad} of {bad.numel()} elements differ; first at [{idx}]: "
             f"expected {ev:.6g}, got {gv:.6g}{nan_note}", hint)


def _first_difference(got: Any, expected: Any) -> str:
    if isinstance(got, list | tuple) and isinstance(expected, list | tuple):
        if len(got) != len(expected):
            return f" (length {len(got)} instead of {len(expected)})"
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            if g != e:
                return f" (first difference at index {i}: expected {e!r}, got {g!r})"
    return ""


def _learner_frame(tb: Any) -> str:
    """Where in the learner's own code an exception came from (a notebook cell)."""
    frames = traceback.extract_tb(tb)
    for fr in reversed(frames):
        if fr.filename.startswith("<ipython-input") or "ipykernel" in fr.filename \
                or fr.filename.startswith("/tmp/ipykernel"):
            return f" (in your code: `{(fr.line or '').strip()}`, line {fr.lineno} of its cell)"
    return ""


@contextlib.contextmanager
def exercise(ex_id: str, title: str) -> Iterator[None]:
    """Run one exercise's checks and print a single verdict line (see module docstring)."""
    try:
        yield
    except NotImplementedError:
        _say(TODO, ex_id, title, "not attempted yet: fill in the `# YOUR CODE HERE` parts "
             "above, run them, then run this cell again.")
    except CheckFailed as err:
        _say(FAIL, ex_id, title, err.message, err.hint)
    except Exception as err:  # a bug in the learner's code: short report, no traceback
        where = _learner_frame(sys.exc_info()[2])
        _say(FAIL, ex_id, title, f"your code raised {type(err).__name__}: {err}{where}")
    else:
        _say(PASS, ex_id, title, "correct")


def on_learner_code(run: Callable[[], T], exercises: str, what: str) -> T | None:
    """Run a chapter demo (or one part of it) on the learner's functions.

    Returns what ``run()`` returns, or None after one line: ⏳ while ``exercises`` (e.g.
    ``"exercise 01.1"``) are unfinished, ❌ without a traceback when the learner's code
    raised. ``what`` names the demo in that line.
    """
    try:
        return run()
    except NotImplementedError:
        print(f"⏳ {what}: finish {exercises}, then run this cell again")
    except Exception as err:  # a learner's bug: one line, no traceback
        print(f"❌ {what}: your code raised {type(err).__name__}: {err}")
    return None


@contextlib.contextmanager
def record_verdicts() -> Iterator[list[tuple[str, str, str]]]:
    """Collect ``(mark, exercise id, message)`` of every verdict given inside the block.

    Tools that run graders in-process (``tools/mutants.py``) read verdicts here instead
    of parsing printed text.
    """
    seen: list[tuple[str, str, str]] = []
    _recorders.append(seen)
    try:
        yield seen
    finally:
        _recorders.remove(seen)


def _say(mark: str, ex_id: str, title: str, message: str, hint: str | None = None) -> None:
    for seen in _recorders:
        seen.append((mark, ex_id, message))
    print(f"{mark} [{ex_id}] {title}: {message}")
    if hint:
        print(f"   hint: {hint}")
