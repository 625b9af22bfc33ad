"""Chapter 13: each saved piece on random workloads, after its scenarios.

Scenarios are chosen by hand; a rule can be wrong only where none of them goes (requests
whose ids do not follow their arrival, a victim whose blocks a prefix hit shares, a block
size that is not a power of two). So a piece that serves its scenarios as the library
does (:mod:`~paged_lib.course.demos.your_engine_scenarios`) then serves the random
workloads its exercise's check serves (:mod:`paged_lib.course.grading.generated`: every
option of the engine and their combinations), in an engine of the library's pieces with
it in its place, next to the library's engine; the first difference is shrunk to the
smallest workload that still shows it and told in one line.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from paged_lib.course import mine
from paged_lib.course.demos import your_engine
from paged_lib.course.exercises import HOOKS, SAVED

#: pieces the random workloads do not serve here: the Triton kernel (the interpreter
#: takes seconds a step; chapter 05's check draws its shapes) and one rank's attention
#: (two processes a run; chapter 12's check serves it on both ranks)
NOT_GENERATED = ("05.5", "12.3")
#: (exercise id, the saved code the piece was loaded from, workloads) -> verdict: the same saved
#: code gets the same verdict without serving it again
_GENERATED: dict[tuple[str, str, int], str | None] = {}


def _saved_text(ex_id: str, obj: Any) -> str | None:
    """The section of ``mine/`` that ``obj`` was loaded from (the whole file if it has
    none); ``None`` for a piece defined in a notebook cell (checked each time)."""
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:
        return None
    if path is None or not Path(path).is_file():
        return None
    return mine.sections(Path(path)).get(ex_id) or Path(path).read_text()


def _clip(text: str, n: int) -> str:
    """``text`` on one line (a learner's message may span several), cut after its last
    whole "; "-separated part within ``n`` characters."""
    text = " ".join(text.split())
    if len(text) <= n:
        return text
    cut = text.rfind("; ", 0, n)
    return (text[:cut] if cut > 0 else text[:n]) + "; ..."


def generated_verdict(ex_id: str, obj: Any, served: Any,
                      count: int | None = None) -> str | None:
    """After the scenarios: ``count`` random workloads (by default those its exercise's
    check serves, drawn for the piece's hook by :mod:`paged_lib.course.grading.generated`)
    served by an engine with ``served`` in place of the library's piece and by the
    library's; the first difference, shrunk, in one line, or ``None``."""
    from paged_lib.course.grading import generated

    count = count or generated.NUM_WORKLOADS
    text = _saved_text(ex_id, obj)
    key = (ex_id, text, count) if text is not None else None
    if key in _GENERATED:
        return _GENERATED[key]

    def build(model, num_blocks, block_size, **options):
        return your_engine.build(model, num_blocks, block_size, {ex_id: served}, **options)

    hook = HOOKS.get(ex_id) or SAVED[ex_id].name
    try:
        found = generated.find(hook, build, count)
        verdict = None if found is None else (
            f"on random workload {found[0].seed} drawn for {hook}: {_clip(found[2], 320)} "
            f"(the workload, shrunk: {_clip(found[1].describe(tokens=False), 400)})")
    except Exception as caught:  # noqa: BLE001 - a learner's bug: a line, no traceback
        verdict = f"on random workloads drawn for {hook}: raised {type(caught).__name__}: " \
                  f"{_clip(str(caught), 300)}"
    if key is not None:
        _GENERATED[key] = verdict
    return verdict
