"""Self-grading for the exercise notebooks.

A check cell in an exercise notebook looks like this::

    with grading.exercise("01.1"):
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
import functools
import importlib
import math
import numbers
import os
import signal
import sys
import threading
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from paged_lib.course.exercises import EXERCISES, title_text
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


def expect_dict(got: Any, keys: Any, hint: str, what: str = "") -> None:
    """``got`` is a dict with an answer for each of ``keys`` (``what`` prefixes the line)."""
    expect_true(isinstance(got, dict), f"{what}expected a dict, got {type(got).__name__}", hint)
    missing = [k for k in keys if k not in got]
    expect_true(not missing, f"{what}no answer for {missing}", hint)


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


def expect_value_error(fn: Callable[..., Any], args: tuple, what: str, hint: str) -> None:
    """``fn(*args)`` must raise ``ValueError`` (the course's rule for bad input); another
    exception, or none, fails with ``hint``."""
    try:
        fn(*args)
    except ValueError:
        return
    except NotImplementedError:  # a stub not written yet: ⏳, not ❌
        raise
    except Exception as err:  # noqa: BLE001 - name what came instead
        fail(f"{what}: expected a ValueError, got {type(err).__name__}", hint)
    fail(f"{what}: expected a ValueError, nothing was raised", hint)


def expect_close(got: float, expected: float, what: str, rel: float = 1e-6, abs_: float = 0.0,
                 hint: str | None = None) -> None:
    """Floating-point equality within a relative (and optional absolute) tolerance."""
    try:
        ok = math.isclose(float(got), float(expected), rel_tol=rel, abs_tol=abs_)
    except (TypeError, ValueError):
        fail(f"{what}: expected a number close to {expected:.6g}, got {got!r}", hint)
    if not ok:
        tol = max(abs_, rel * abs(float(expected)))
        fail(f"{what}: expected {_shown(expected, tol)}, got {_shown(got, tol)}"
             f"{_tolerance(tol)}", hint)


def _shown(value: Any, tol: float) -> str:
    """``value`` with the digits that decide against a tolerance ``tol`` (two beyond it)."""
    v = float(value)
    if not math.isfinite(v):
        return repr(v)
    if tol <= 0:
        return repr(v)
    sig = math.ceil(math.log10(max(abs(v), tol) / tol)) + 2
    return f"{v:.{min(max(sig, 6), 17)}g}"


def _tolerance(tol: float) -> str:
    return f" (tolerance {tol:.1g})" if 0 < tol else ""


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
        tol = atol + rtol * abs(ev) if math.isfinite(ev) else 0.0
        fail(f"{what}: {n_bad} of {bad.numel()} elements differ; first at [{idx}]: "
             f"expected {_shown(ev, tol)}, got {_shown(gv, tol)}{_tolerance(tol)}{nan_note}",
             hint)


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


_LIBRARY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class TwinCalled(CheckFailed):
    """The learner's code called (or was) the library object the exercise re-implements."""


def _resolve(dotted: str) -> tuple[Any, str, Any]:
    """(owner: module or class, attribute name, raw attribute) of a dotted name."""
    parts = dotted.split(".")
    for k in range(len(parts) - 1, 0, -1):  # the longest importable prefix
        try:
            owner = importlib.import_module(".".join(parts[:k]))
            break
        except ImportError:
            continue
    for part in parts[k:-1]:
        owner = getattr(owner, part)
    raw = owner.__dict__[parts[-1]] if isinstance(owner, type) else getattr(owner, parts[-1])
    return owner, parts[-1], raw


def _twin_of(ex_id: str) -> tuple[str, ...]:
    """The dotted twins of ``ex_id`` (:mod:`paged_lib.course.exercises`; none for an id
    the course does not have)."""
    known = EXERCISES.get(ex_id)
    return () if known is None else known.twins


def _twin_message(dotted: str) -> str:
    name = ".".join(dotted.split(".")[-2:]) if dotted.split(".")[-2][:1].isupper() \
        else dotted.split(".")[-1]
    return (f"your function called the library's {name} ({dotted}), which is what you are "
            "asked to write")


def _unwrap(obj: Any) -> Any:
    for attr in ("__func__", "func", "fn"):  # bound method, functools.partial, JITFunction
        inner = getattr(obj, attr, None)
        if inner is not None and inner is not obj:
            return _unwrap(inner)
    return obj


def _learner_arguments() -> list[Any]:
    """The arguments of the check function that opened ``exercise`` (the learner's code)."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == contextlib.__file__
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return []
    code = frame.f_code
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return [frame.f_locals[n] for n in names if n in frame.f_locals]


@contextlib.contextmanager
def _refusing_twin(dotted: str | None, calls: list[str]) -> Iterator[None]:
    """While the block runs, the twin refuses calls from outside ``paged_lib``.

    The twin function gets a guard's code (:func:`_swap_in_guard`; for a closure, the
    names the learner can reach are rebound instead) that runs the original for callers
    inside ``paged_lib`` (the grader's own reference) and raises :class:`TwinCalled`
    for anyone else. Everything is put back on the way out, errors included.
    """
    if dotted is None:
        yield
        return
    owner, name, raw = _resolve(dotted)
    original = _unwrap(raw)
    for arg in _learner_arguments():
        if _unwrap(arg) is original:
            calls.append(f"you passed the library's {name} ({dotted}) itself, which "
                         "is what you are asked to write")
    patched: list[tuple[dict, str, Any]] = []
    undo = _swap_in_guard(original, dotted, calls) \
        if isinstance(original, types.FunctionType) else None
    if undo is None and isinstance(original, types.FunctionType):  # a closure: rebind names
        @functools.wraps(original)
        def guard(*args: Any, **kwargs: Any) -> Any:
            if sys._getframe(1).f_code.co_filename.startswith(_LIBRARY):
                return original(*args, **kwargs)
            calls.append(_twin_message(dotted))
            raise TwinCalled(_twin_message(dotted))

        replacement = type(raw)(guard) if isinstance(raw, staticmethod | classmethod) \
            else guard
        if isinstance(owner, type):
            setattr(owner, name, replacement)
            patched.append((owner, name, raw))
        spaces = [vars(owner)] if not isinstance(owner, type) else []
        spaces.append(getattr(sys.modules.get(original.__module__), "__dict__", None))
        spaces += [getattr(_unwrap(a), "__globals__", None) for a in _learner_arguments()]
        spaces.append(getattr(sys.modules.get("__main__"), "__dict__", None))
        seen: set[int] = set()
        for space in spaces:
            if space is None or id(space) in seen:
                continue
            seen.add(id(space))
            for key, value in list(space.items()):
                if value is raw or value is original:
                    space[key] = guard
                    patched.append((space, key, value))
    try:
        yield
    finally:
        if undo is not None:
            undo()
        for where, key, value in reversed(patched):
            if isinstance(where, type):
                setattr(where, key, value)
            else:
                where[key] = value


#: id(twin) -> its dispatcher while a check runs (the guard's code looks itself up here).
_GUARDS: dict[int, Callable[..., Any]] = {}


def _swap_in_guard(original: types.FunctionType, dotted: str, calls: list[str]
                   ) -> Callable[[], None] | None:
    """Give the twin itself a guard's code, so every reference to it refuses (an alias,
    a default argument, a partial made before the check); return what undoes it.

    The guard runs a copy of the original for callers inside ``paged_lib``. A function
    with a closure cannot take code without one: None, and the caller rebinds names.
    """
    if original.__closure__:
        return None
    clone = types.FunctionType(original.__code__, original.__globals__, original.__name__,
                               original.__defaults__, original.__closure__)
    clone.__kwdefaults__ = original.__kwdefaults__
    key = id(original)

    def dispatch(args: tuple, kwargs: dict, caller: str) -> Any:
        if caller.startswith(_LIBRARY):
            return clone(*args, **kwargs)
        calls.append(_twin_message(dotted))
        raise TwinCalled(_twin_message(dotted))

    source = ("def guard(*args, **kwargs):\n    import sys\n"
              f"    return sys.modules[{__name__!r}]._GUARDS[{key}](args, kwargs, "
              "sys._getframe(1).f_code.co_filename)\n")
    space: dict[str, Any] = {}
    exec(compile(source, f"<guard of {dotted}>", "exec"), space)
    saved = original.__code__
    _GUARDS[key] = dispatch
    original.__code__ = space["guard"].__code__

    def undo() -> None:
        original.__code__ = saved
        _GUARDS.pop(key, None)

    return undo


@contextlib.contextmanager
def exercise(ex_id: str, title: str | None = None) -> Iterator[None]:
    """Run one exercise's checks and print a single verdict line (see module docstring).

    The line names the exercise by its title in :mod:`paged_lib.course.exercises` (``title``
    only for an id the course does not have). While the checks run, the library's twins of
    the exercise (its ``twins`` there) refuse to be called by the learner's code: a
    function that delegates to one
    fails, whatever else it gets right. After the verdict, an engine piece that passed is
    saved to ``mine/`` (:mod:`paged_lib.course.mine`; the verdict never depends on it).
    """
    calls: list[str] = []
    hint: str | None = None
    learner = _learner_arguments()
    try:
        with contextlib.ExitStack() as refusing:
            for dotted in _twin_of(ex_id):
                refusing.enter_context(_refusing_twin(dotted, calls))
            yield
    except NotImplementedError:
        mark, message = TODO, ("not attempted yet: fill in the `# YOUR CODE HERE` parts "
                               "above, run them, then run this cell again.")
    except CheckFailed as err:
        mark, message, hint = FAIL, err.message, err.hint
    except Exception as err:  # a bug in the learner's code: short report, no traceback
        where = _learner_frame(sys.exc_info()[2])
        mark, message = FAIL, f"your code raised {type(err).__name__}: {err}{where}"
        hint = raised_hint(err)
    else:
        mark, message = PASS, "correct"
    if calls:  # whatever happened after (caught, wrapped by Triton, or a pass)
        mark, message = FAIL, calls[0]
        hint = ("write it yourself from the spec: the check compares your code with the "
                "library's, so delegating to the library proves nothing")
    _say(mark, ex_id, title or title_text(ex_id), message, hint)
    if mark != TODO:  # an engine piece that passed goes to mine/ (paged_lib.course.mine)
        from paged_lib.course import mine

        mine.after_verdict(ex_id, mark == PASS, learner)


@contextlib.contextmanager
def time_limit(seconds: float, stop: Callable[[], Any]) -> Iterator[None]:
    """Run the block; if it is still running after ``seconds``, ``stop()`` is called inside
    it and raises there (a learner's loop that never ends gets a verdict, not a cell that
    hangs). Main thread on Unix only (a signal timer); elsewhere, no limit."""
    if not hasattr(signal, "setitimer") or \
            threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, lambda *_: stop())
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def raised_hint(err: BaseException) -> str | None:
    """A hint for an error the learner's code met that is not the learner's mistake."""
    if "mask has unsupported dtype" in str(err):  # Triton 3.9's interpreter; a GPU takes it
        return ("Triton's interpreter takes no mask that mixes a scalar condition with a "
                "vector, as (pid < M) & (cols < N): make the scalar a vector first, "
                "(pid + tl.zeros_like(cols) < M) & (cols < N)")
    return None


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
