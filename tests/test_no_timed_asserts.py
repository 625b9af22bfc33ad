"""No test asserts a duration, checked by reading the tests' source (nothing is run).

A test that compares a wall-clock time with a number, or with another measured time,
passes on the machine that wrote it and fails on a busier or slower one: the suite must
pass on any machine, quiet or loaded. Speed goals live in benchmarks that print their
figure beside its goal (``python -m paged_lib.bench ...``), not in ``tests/``. A test that
guards a complexity counts the operations instead (``test_prefix_cache``); one that guards
"nothing was redone" checks that the redoing function was not called.

The rule, per test file: no ``assert`` holds an ordering comparison (``<``, ``<=``, ``>``,
``>=``) one of whose sides is a duration, that is

* a clock read (``time.perf_counter()``, ``time.time()``, ``time.monotonic()``,
  ``time.thread_time()``, ``time.process_time()`` and their ``_ns`` forms), or
* a name, attribute or constant dictionary key that the file assigns from a clock read
  (followed through further assignments: ``seconds = time.perf_counter() - t0`` taints
  ``seconds``; ``out["elapsed"] = ...`` taints ``["elapsed"]``), or
* a name (or a call of one) spelled ``wall``, ``elapsed``, ``seconds`` or ``duration``,

unless the other side is the constant 0 (a sign, not a bound). Waiting for an event is
not a duration: poll a bounded number of times, then fail saying what never happened.
The rule is run on planted files too, to show that it fires.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CLOCKS = {"perf_counter", "perf_counter_ns", "time", "time_ns", "monotonic", "monotonic_ns",
          "thread_time", "thread_time_ns", "process_time", "process_time_ns"}
DURATION_NAMES = {"wall", "elapsed", "seconds", "duration"}
ORDERINGS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _is_clock_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute):  # time.perf_counter(), time.time()
        return f.attr in CLOCKS and isinstance(f.value, ast.Name) and f.value.id == "time"
    return isinstance(f, ast.Name) and f.id in CLOCKS - {"time"}  # from time import ...


def _labels(target: ast.AST) -> set[str]:
    """What an assignment target names: ``x``, ``.x`` or ``["x"]`` (tuples unpacked)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Attribute):
        return {"." + target.attr}
    if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
        return {f"[{target.slice.value!r}]"}
    if isinstance(target, ast.Tuple | ast.List):
        return set().union(*(_labels(t) for t in target.elts)) if target.elts else set()
    if isinstance(target, ast.Starred):
        return _labels(target.value)
    return set()


def _uses(node: ast.AST, tainted: set[str]) -> bool:
    """Does ``node`` read a clock, a tainted label, or a duration-named name?"""
    for sub in ast.walk(node):
        if _is_clock_call(sub):
            return True
        if isinstance(sub, ast.Name) and (sub.id in tainted or sub.id in DURATION_NAMES):
            return True
        if isinstance(sub, ast.Attribute) and "." + sub.attr in tainted:
            return True
        if (isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant)
                and f"[{sub.slice.value!r}]" in tainted):
            return True
    return False


def _tainted(tree: ast.AST) -> set[str]:
    """Labels assigned, anywhere in the file, from clock reads (to a fixed point); keys of
    dictionary literals whose value is one count too (``{"first_s": first}``)."""
    tainted: set[str] = set()
    while True:
        before = len(tainted)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.NamedExpr):
                value = node.value
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if value is not None and _uses(value, tainted):
                    for t in targets:
                        tainted |= _labels(t)
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if isinstance(key, ast.Constant) and _uses(value, tainted):
                        tainted.add(f"[{key.value!r}]")
        if len(tainted) == before:
            return tainted


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0 and not isinstance(
        node.value, bool)


def timed_asserts(source: str) -> list[int]:
    """Line numbers of the asserts in ``source`` that compare a duration (see above)."""
    tree = ast.parse(source)
    tainted = _tainted(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            sides = [cmp.left, *cmp.comparators]
            for op, a, b in zip(cmp.ops, sides[:-1], sides[1:], strict=True):
                if not isinstance(op, ORDERINGS) or _is_zero(a) or _is_zero(b):
                    continue
                if _uses(a, tainted) or _uses(b, tainted):
                    found.append(node.lineno)
    return sorted(set(found))


@pytest.mark.parametrize("path", sorted(TESTS.glob("test_*.py")), ids=lambda p: p.name)
def test_no_test_asserts_a_duration(path):
    lines = timed_asserts(path.read_text())
    assert not lines, (f"{path.name} asserts a duration at line(s) {lines}: a busy or slow "
                       "machine fails it. Count operations, check what was (not) called, or "
                       "move the speed goal to a benchmark that prints it")


PLANTED = {
    "a clock against a number": """
import time
def test_x():
    start = time.perf_counter()
    work()
    assert time.perf_counter() - start < 5
""",
    "a clock kept in a name": """
import time
def test_x():
    t0 = time.monotonic()
    work()
    took = time.monotonic() - t0
    assert took < 1.0, took
""",
    "a fixture's dictionary key": """
import time
def fig():
    out = {}
    start = time.perf_counter()
    out["elapsed"] = time.perf_counter() - start
    return out
def test_x(fig):
    assert fig["elapsed"] < 10.0
""",
    "a clock in a dictionary literal": """
from time import perf_counter
def loads():
    a = perf_counter()
    yield {"first_s": perf_counter() - a}
def test_x(loads):
    assert loads["first_s"] > 2
""",
    "two durations compared": """
def test_x(rows):
    assert wall("model forward") >= wall("linear maps") + wall("LM head")
""",
    "a tuple unpacked from a clock": """
import time
def test_x():
    seconds, n = time.process_time(), 3
    assert 1 <= seconds
""",
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_the_rule_fires_on_a_planted_timed_assert(name):
    assert timed_asserts(PLANTED[name]), name


def test_counts_signs_and_identities_pass():
    source = """
import time
def test_x(stats, q):
    start = time.perf_counter()
    assert all(t >= 0 for t in stats.step_seconds)
    assert stats.ttft_seconds[0] == sum(stats.step_seconds[:2])
    assert time.perf_counter() - start > 0
    assert len(q) < 10 and q.touched <= 8
"""
    assert timed_asserts(source) == []
