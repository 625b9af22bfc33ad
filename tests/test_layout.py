"""The house rules of the package: the system never imports the course, modules stay short.

``paged_lib`` has two parts. The system (accounting, workloads, fragmentation, blocks,
attention, kernels, model, engine, and the instruments and benchmarks beside them) must
run without :mod:`paged_lib.course` (graders, pictures, widgets, chapter demos), so a
reader can take the engine or the kernels alone. These tests read the source, so they
need no import of the modules they check.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "paged_lib"
COURSE = PACKAGE / "course"
MAX_LINES = 400


def system_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if COURSE not in p.parents)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) for every import in a file, including ones inside functions."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant):
                found.append((node.lineno, str(node.args[0].value)))
    return found


def course_imports(path: Path) -> list[str]:
    return [f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
            for line, name in imported_modules(path)
            if name == "paged_lib.course" or name.startswith("paged_lib.course.")]


def test_the_system_never_imports_the_course():
    offenders = [hit for path in system_modules() for hit in course_imports(path)]
    assert not offenders, "system modules must not import paged_lib.course:\n" + "\n".join(
        offenders)


def test_the_import_check_sees_every_form(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import paged_lib.course.viz\n"
                   "def f():\n    from paged_lib.course.grading import ch03\n"
                   "from paged_lib import course\n"
                   "import importlib\nimportlib.import_module('paged_lib.course.demos.tour')\n")
    hits = {name for _, name in imported_modules(bad) if name.startswith("paged_lib.course")}
    assert hits == {"paged_lib.course.viz", "paged_lib.course.grading",
                    "paged_lib.course.grading.ch03", "paged_lib.course",
                    "paged_lib.course.demos.tour"}


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_over_400_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, (
        f"{path.relative_to(PACKAGE.parent)} has {lines} lines (at most {MAX_LINES}): split it "
        "by what its parts do")
