"""The exercise registry (:mod:`paged_lib.course.exercises`) is the one list of exercises.

Its ids and titles are the ``### Exercise NN.k: Title`` headings of the solution notebooks,
each exercise once; every twin names a real library object; every hook is an
``EngineHooks`` field; every grader module's check functions only grade registered ids;
and no old table of its own (``TWINS``, ``PIECES``, ``HOOKS``, ``REPLAYED``) is left in a
grader or in chapter 13's modules.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import paged_lib  # noqa: F401  # isort: split
from paged_lib.course import exercises, grading
from paged_lib.course.exercises import EXERCISES, HOOKS, SAVED
from paged_lib.engine import EngineHooks

ROOT = Path(__file__).resolve().parents[1]
HEADING = re.compile(r"^###\s+Exercise\s+(\d\d\.\d+):\s*(.+?)\s*$", re.M)


def headings() -> list[tuple[str, str]]:
    import nbformat

    found = []
    for path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "markdown":
                found += HEADING.findall(cell.source)
    return found


def test_ids_and_titles_are_the_solution_notebooks_headings():
    found = headings()
    assert len({ex_id for ex_id, _ in found}) == len(found), "an exercise heading twice"
    assert [(e.id, e.title) for e in EXERCISES.values()] == found


def test_every_twin_names_a_real_library_object():
    for ex in EXERCISES.values():
        assert len(set(ex.twins)) == len(ex.twins), ex.id
        for dotted in ex.twins:
            assert callable(grading._resolve(dotted)[2]), (ex.id, dotted)


def test_engine_pieces_are_saved_and_hooked_consistently():
    fields = {f.name for f in dataclasses.fields(EngineHooks)}
    assert set(HOOKS.values()) <= fields
    assert set(HOOKS) <= set(SAVED)  # a hook is a saved piece
    assert all(e.role and e.name for e in SAVED.values())
    assert all(not e.role and not e.hook for e in EXERCISES.values() if not e.saved)
    assert exercises.title_text("03.1") == "append_token, with copy-on-write"


def test_a_verdict_line_prints_the_registered_title(capsys):
    with grading.exercise("06.3"):
        pass
    assert capsys.readouterr().out == "✅ [06.3] The admission check: correct\n"


@pytest.mark.parametrize("path", sorted((ROOT / "paged_lib" / "course").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_keeps_a_table_of_its_own(path):
    if path.name == "exercises.py":
        return
    source = path.read_text()
    assert not re.search(r"^(TWINS|PIECES|HOOKS|REPLAYED)\b.*=", source, re.M), path
    # graders name their exercise by id only: the title comes from the registry
    assert not re.search(r'grading\.exercise\("\d\d\.\d+", ', source), path


GRADING = ROOT / "paged_lib" / "course" / "grading"


@pytest.mark.parametrize("path", sorted(GRADING.glob("ch[0-9][0-9]*.py")), ids=lambda p: p.stem)
def test_no_grader_imports_another_chapters_grader(path):
    """What chapters share lives in a shared module of the grading package."""
    own = path.stem[:4]
    named = re.findall(r"paged_lib\.course\.grading(?:\.|\s+import\s+)(ch\d\d)", path.read_text())
    assert all(ch == own for ch in named), (path.name, named)


@pytest.mark.parametrize("path", sorted(GRADING.rglob("*.py")), ids=lambda p: p.stem)
def test_no_grader_reads_the_engines_private_state(path):
    """Graders read the step through its public surface (``step.admitted``, ...)."""
    assert not re.search(r"\.(_out|_sched|_blocks|_ran|_reads)\b", path.read_text()), path
