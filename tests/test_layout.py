"""The house rules of the package, checked by reading the source (nothing is imported).

``paged_lib`` has three parts:

* the **system**: everything outside ``studies/`` and ``course/`` (accounting, workloads,
  fragmentation, blocks, attention, kernels, model, engine, tokenizer, util, device, data,
  instruments, bench): what a reader can take and run alone;
* the **studies**, :mod:`paged_lib.studies`: the chapters' measurements and comparisons,
  built on the system;
* the **course**, :mod:`paged_lib.course`: graders, pictures, widgets, chapter demos.

The rules:

1. the system never imports the studies or the course;
2. the studies never import the course;
3. no import cycle among the modules of ``paged_lib``;
4. no module is over 400 lines.

What counts as an import: every ``import`` and ``from ... import`` anywhere in a file (at
the top, inside functions, under ``if``), relative ones resolved, and
``importlib.import_module("...")`` with a constant name. The import graph has an edge
from a module to the module it names: ``import paged_lib.x.y`` -> ``paged_lib.x.y``;
``from paged_lib.x import y`` -> ``paged_lib.x.y`` when that is a module, else
``paged_lib.x`` (its ``__init__.py``); a name that is not a module resolves to its longest
prefix that is. No edge the source writes is left out: a package's ``__init__.py`` that
re-exports its submodules has its edges to them, and a submodule that imports from its
package's ``__init__.py`` has that edge, so the two together are a cycle. The one edge
not drawn is the one Python adds by itself (importing ``paged_lib.x.y`` first runs
``paged_lib/x/__init__.py``): with it every package whose ``__init__.py`` re-exports a
submodule would be a cycle.

Each rule is also run on a small planted tree (``test_each_rule_fires_on_a_planted_...``)
to show that it fires.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "paged_lib"
MAX_LINES = 400
PARTS = ("studies", "course")  # subpackages that are not the system
SYSTEM_RULE = "the system imports the studies or the course"
STUDIES_RULE = "the studies import the course"
CYCLE_RULE = "import cycle"
LENGTH_RULE = f"module over {MAX_LINES} lines"
#: modules of one concept allowed past MAX_LINES (splitting them only repeated imports)
ONE_CONCEPT = {"course/grading/ch05.py", "course/grading/generated/small_attention.py"}


# ------------------------------------------------------------------------------ reading


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package`` (a package's name
    is its ``__init__.py``'s)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = [package.name, *path.relative_to(package).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(path: Path, module: str = "") -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` for every import in a file, including ones inside
    functions: ``import a.b`` is ``(n, "a.b", None)``, ``from a import b`` is
    ``(n, "a", "b")`` (``b`` a module or any other name). Relative imports are resolved
    against ``module``, the file's dotted name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here[:len(here) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, base, alias.name) for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant):
                found.append((node.lineno, str(node.args[0].value), None))
    return found


def imported_modules(path: Path, module: str = "") -> list[tuple[int, str]]:
    """(line, dotted name) for every name a file imports: ``from a import b`` gives both
    ``a`` and ``a.b``."""
    return [(line, name) for line, mod, what in imports(path, module)
            for name in ([mod] if what is None else [mod, f"{mod}.{what}"])]


def part_of(name: str) -> str:
    """``"studies"``, ``"course"`` or ``"system"`` for a dotted name inside the package."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PARTS else "system"


def import_graph(package: Path) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: first line that does}, inside ``package`` only."""
    files = module_files(package)

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        edges = graph.setdefault(module, {})
        for line, mod, what in imports(path, module):
            if mod != package.name and not mod.startswith(package.name + "."):
                continue
            target = f"{mod}.{what}" if what and f"{mod}.{what}" in files else resolve(mod)
            if target and target != module:
                edges.setdefault(target, line)
    return graph


# ------------------------------------------------------------------------------ the rules


def layering_violations(package: Path) -> dict[str, list[str]]:
    """Imports that cross the parts the wrong way, as ``file:line imports name``."""
    found: dict[str, list[str]] = {SYSTEM_RULE: [], STUDIES_RULE: []}
    forbidden = {"system": {"studies": SYSTEM_RULE, "course": SYSTEM_RULE},
                 "studies": {"course": STUDIES_RULE}}
    for module, path in module_files(package).items():
        rules = forbidden.get(part_of(module), {})
        for line, name in imported_modules(path, module):
            if name.startswith(package.name + ".") and part_of(name) in rules:
                found[rules[part_of(name)]].append(
                    f"{path.relative_to(package.parent)}:{line} imports {name}")
    return found


def import_cycles(package: Path) -> list[str]:
    """Each set of modules that import one another (a strongly connected component of the
    import graph), with the imports that close it."""
    graph = import_graph(package)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while not members or members[-1] != v:
                members.append(stack.pop())
            if len(members) > 1:
                cycles.append(", ".join(
                    f"{a} imports {b} (line {graph[a][b]})"
                    for a in sorted(members) for b in sorted(graph[a]) if b in members))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def long_modules(package: Path) -> list[str]:
    return [f"{path.relative_to(package.parent)} has {n} lines" for path in
            sorted(package.rglob("*.py")) if (n := len(path.read_text().splitlines())) > MAX_LINES]


def violations(package: Path) -> dict[str, list[str]]:
    return {**layering_violations(package), CYCLE_RULE: import_cycles(package),
            LENGTH_RULE: long_modules(package)}


# ------------------------------------------------------------------------------ paged_lib


def test_the_system_never_imports_the_studies_or_the_course():
    hits = layering_violations(PACKAGE)[SYSTEM_RULE]
    assert not hits, ("the system must run without paged_lib.studies and paged_lib.course "
                      "(move the piece it needs into the system):\n" + "\n".join(hits))


def test_the_studies_never_import_the_course():
    hits = layering_violations(PACKAGE)[STUDIES_RULE]
    assert not hits, "paged_lib.studies must not import paged_lib.course:\n" + "\n".join(hits)


def test_no_import_cycle():
    cycles = import_cycles(PACKAGE)
    assert not cycles, "modules that import one another:\n" + "\n".join(cycles)


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_over_400_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES or str(path.relative_to(PACKAGE)) in ONE_CONCEPT, (
        f"{path.relative_to(PACKAGE.parent)} has {lines} lines (at most {MAX_LINES}): split it "
        "by what its parts do")


def test_the_three_parts_are_where_the_rules_say():
    parts = {part_of(m) for m in module_files(PACKAGE)}
    assert parts == {"system", "studies", "course"}
    assert part_of("paged_lib.studies.sharing") == "studies"
    assert part_of("paged_lib.course.viz.blocks") == "course"
    assert part_of("paged_lib.engine.scheduler") == part_of("paged_lib") == "system"


# ------------------------------------------------------------------------------ the checker


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


def test_relative_imports_are_resolved(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from . import a\nfrom .b import c\n")
    (tmp_path / "pkg" / "a.py").write_text("from .. import course\nfrom .sub import x\n")
    assert {n for _, n in imported_modules(tmp_path / "pkg" / "__init__.py", "paged_lib.pkg")} \
        == {"paged_lib.pkg", "paged_lib.pkg.a", "paged_lib.pkg.b", "paged_lib.pkg.b.c"}
    assert {n for _, n in imported_modules(tmp_path / "pkg" / "a.py", "paged_lib.pkg.a")} == {
        "paged_lib", "paged_lib.course", "paged_lib.pkg.sub", "paged_lib.pkg.sub.x"}


#: A small package that keeps every rule: a package __init__ re-exporting its submodule,
#: studies and course importing the system, the course importing a study. The leaves
#: import nothing, so importing one adds no cycle to a planted violation.
CLEAN = {
    "__init__.py": '"""The package."""\n',
    "util.py": "def cdiv(a, b):\n    return -(-a // b)\n",
    "kernels/__init__.py": "from paged_lib.kernels.copy import copy\n",
    "kernels/copy.py": "import torch\n\nfrom paged_lib.util import cdiv\n",
    "engine.py": "from paged_lib.kernels import copy\n\ndef run():\n    import paged_lib.util\n",
    "studies/__init__.py": "",
    "studies/sharing.py": "from paged_lib.engine import run\nfrom . import other\n",
    "studies/other.py": "from paged_lib import util\n",
    "studies/leaf.py": "SAVING = 0.5\n",
    "course/__init__.py": "from paged_lib.course.viz import draw\n",
    "course/viz.py": "from paged_lib.studies import sharing\nfrom paged_lib import engine\n",
    "course/leaf.py": "def draw():\n    pass\n",
}

#: One violation each: (the rule that must fire, files that replace or join CLEAN's).
PLANTED = {
    "system imports a study": (SYSTEM_RULE, {
        "engine.py": "from paged_lib.studies.leaf import SAVING\n"}),
    "system imports the course in a function": (SYSTEM_RULE, {
        "util.py": "def show():\n    from paged_lib.course import leaf\n"}),
    "system imports the course by import_module": (SYSTEM_RULE, {
        "kernels/copy.py": "import importlib\nimportlib.import_module('paged_lib.course.leaf')\n"}),
    "a study imports the course, relatively": (STUDIES_RULE, {
        "studies/other.py": "from ..course import leaf\n"}),
    "two modules import each other": (CYCLE_RULE, {
        "blocks.py": "import paged_lib.allocator\n",
        "allocator.py": "def f():\n    from paged_lib import blocks\n"}),
    "a submodule imports its package's __init__": (CYCLE_RULE, {
        "kernels/copy.py": "from paged_lib.kernels import BACKENDS\n"}),
    "a cycle of three studies": (CYCLE_RULE, {
        "studies/a.py": "import paged_lib.studies.b\n",
        "studies/b.py": "from paged_lib.studies import c\n",
        "studies/c.py": "from paged_lib.studies.a import f\n"}),
    "a long module": (LENGTH_RULE, {
        "blocks.py": "x = 0\n" * (MAX_LINES + 1)}),
}


def plant(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "paged_lib"
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


def test_a_tree_that_keeps_the_rules_passes(tmp_path):
    assert violations(plant(tmp_path, CLEAN)) == {
        SYSTEM_RULE: [], STUDIES_RULE: [], CYCLE_RULE: [], LENGTH_RULE: []}


@pytest.mark.parametrize("case", PLANTED)
def test_each_rule_fires_on_a_planted_violation(tmp_path, case):
    rule, files = PLANTED[case]
    found = violations(plant(tmp_path, {**CLEAN, **files}))
    assert {r for r, hits in found.items() if hits} == {rule}, found


def test_a_violation_names_the_file_and_the_line(tmp_path):
    package = plant(tmp_path, {**CLEAN, "util.py": "import os\n\ndef f():\n"
                                                   "    from paged_lib.course import leaf\n"})
    assert layering_violations(package)[SYSTEM_RULE] == [
        "paged_lib/util.py:4 imports paged_lib.course", "paged_lib/util.py:4 imports "
        "paged_lib.course.leaf"]
    package = plant(tmp_path / "cycle", {**CLEAN, **PLANTED["two modules import each other"][1]})
    assert import_cycles(package) == [
        "paged_lib.allocator imports paged_lib.blocks (line 2), "
        "paged_lib.blocks imports paged_lib.allocator (line 1)"]
