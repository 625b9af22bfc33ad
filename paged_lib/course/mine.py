"""Your pieces, saved: the code of each engine exercise, written to ``mine/`` when it passes.

An exercise whose function has a place in the engine (chapter 03's block table and
allocator, 05's decode kernel and slot mapping, 06's metadata and admission, 07's victim
and swap mapping, 08's beam step, 10's block hashes, cache hit and free queue:
:data:`paged_lib.course.exercises.SAVED`) is saved by its check cell once it passes, as
d2l saves its code into its package: ``mine/chNN.py`` at the root of the checkout
(beside ``exercises/``, git-ignored), one section per exercise, with the imports and
notebook helpers it uses. Later notebooks import it (``from mine.ch06 import
build_metadata``, from the checkout's root, or :func:`load` from anywhere); chapter 13
builds an engine out of it.

Rules:

* only a passing check writes; code that fails or is unfinished writes nothing, and a
  later failing attempt *leaves* the version that passed (the note under the ❌ says so):
  the saved file always holds code that passed its check;
* only notebooks run from an ``exercises/`` folder save (not the solutions, not the
  chapters, not the tests); ``PAGED_LIB_MINE=<folder>`` saves (and loads) elsewhere,
  ``PAGED_LIB_MINE=off`` turns saving off;
* the source is read from the notebook cell itself (IPython keeps each cell's text in
  :mod:`linecache`, which is also what :func:`inspect.getsource` reads).
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import linecache
import os
import re
import sys
import types
from pathlib import Path
from typing import Any

from paged_lib.course.chapters import REPO
from paged_lib.course.exercises import SAVED

ENV = "PAGED_LIB_MINE"
_CELL = re.compile(r"(ipykernel_\d+[/\\]\d+\.py$)|(^<ipython-input-)")
_BEGIN, _END = "# >>> ", "# <<< "


class CannotSave(ValueError):
    """The piece's source or one of the names it uses cannot be written to a file."""


# ------------------------------------------------------------------ where

def save_folder() -> Path | None:
    """Where a passing check saves from here: ``$PAGED_LIB_MINE``, else ``../mine`` when
    the notebook runs in an ``exercises/`` folder, else nowhere (``None``)."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "no") else Path(env)
    cwd = Path.cwd()
    return cwd.parent / "mine" if cwd.name == "exercises" else None


def save_folder_for(notebook_folder: Path) -> Path:
    """Where checks run in ``notebook_folder`` save: ``$PAGED_LIB_MINE`` or its
    sibling ``mine/`` (what :func:`save_folder` answers inside an ``exercises/`` folder)."""
    env = os.environ.get(ENV, "").strip()
    if env and env.lower() not in ("0", "off", "no"):
        return Path(env)
    return Path(notebook_folder).resolve().parent / "mine"


def load_folder() -> Path:
    """Where saved pieces are read from: ``$PAGED_LIB_MINE``, else the checkout's ``mine/``."""
    env = os.environ.get(ENV, "").strip()
    return Path(env) if env and env.lower() not in ("0", "off", "no") else REPO / "mine"


def _file(folder: Path, chapter: str) -> Path:
    return Path(folder) / f"ch{chapter}.py"


# ------------------------------------------------------------------ reading a definition

def _target(obj: Any) -> Any:
    """The Python function or class behind ``obj`` (a ``@triton.jit`` kernel's ``fn``)."""
    while not isinstance(obj, type | types.FunctionType) and hasattr(obj, "fn"):
        obj = obj.fn
    return obj


def _functions(obj: Any) -> list[types.FunctionType]:
    if isinstance(obj, types.FunctionType):
        return [obj]
    found = []
    for value in vars(obj).values():
        value = getattr(value, "__func__", getattr(value, "fget", value))
        if isinstance(value, types.FunctionType):
            found.append(value)
    return found


def _definition(obj: Any) -> tuple[str, ast.AST, dict]:
    """(source, ast node, globals) of a top-level ``def`` or ``class`` from its cell."""
    target = _target(obj)
    funcs = _functions(target) if isinstance(target, type | types.FunctionType) else []
    name = getattr(target, "__name__", "?")
    if not funcs or name == "<lambda>":
        raise CannotSave(f"{name} is not a def or a class with methods")
    filename = funcs[0].__code__.co_filename
    lines = linecache.getlines(filename)
    if not lines:
        raise CannotSave(f"the source of {name} is not available")
    tree = ast.parse("".join(lines))
    kinds = (ast.ClassDef,) if isinstance(target, type) else (ast.FunctionDef,
                                                              ast.AsyncFunctionDef)
    nodes = [n for n in tree.body if isinstance(n, kinds) and n.name == name]
    if not nodes:
        raise CannotSave(f"{name} is not defined at the top level of its cell")
    first = funcs[0].__code__.co_firstlineno
    node = next((n for n in nodes if _start(n) <= first <= n.end_lineno), nodes[-1])
    source = "".join(lines[_start(node) - 1:node.end_lineno])
    return source, node, funcs[0].__globals__


def _start(node: ast.AST) -> int:
    return min([node.lineno] + [d.lineno for d in node.decorator_list])


def _free_names(node: ast.AST) -> list[str]:
    """Names the definition reads that it does not bind itself (globals, in practice)."""
    loads, bound = set(), {node.name}
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            (loads if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(n.name)
        elif isinstance(n, ast.alias):
            bound.add((n.asname or n.name).split(".")[0])
    return sorted(loads - bound)


def _import_line(name: str, value: Any) -> str | None:
    """An import that binds ``name`` to ``value``, or None if there is none."""
    if isinstance(value, types.ModuleType):
        return f"import {value.__name__}" + ("" if name == value.__name__ else f" as {name}")
    module, qual = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if module in (None, "__main__", "builtins") or not isinstance(qual, str) or "." in qual:
        return None
    if getattr(sys.modules.get(module), qual, None) is not value:
        return None
    return f"from {module} import {qual}" + ("" if name == qual else f" as {name}")


def _literal(value: Any) -> bool:
    if isinstance(value, tuple | frozenset):
        return all(_literal(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str | bytes)


def section_text(obj: Any, export: str) -> str:
    """The code that defines ``obj`` in a file of its own: its imports, the notebook's
    helpers and constants it uses (recursively), then its definition, and ``export = name``
    if the notebook named it differently."""
    imports: list[str] = []
    bodies: list[str] = []
    seen: set[str] = set()

    def add(o: Any) -> None:
        source, node, space = _definition(o)
        seen.add(node.name)
        for name in _free_names(node):
            if name in seen or name not in space:
                continue
            value = space[name]
            if (line := _import_line(name, value)) is not None:
                imports.append(line)
            elif _literal(value):
                bodies.append(f"{name} = {value!r}\n")
                seen.add(name)
            elif getattr(_target(value), "__module__", None) == "__main__":
                add(value)  # a helper from the notebook: its source goes first
            elif not hasattr(builtins, name):
                raise CannotSave(f"it uses `{name}`, a {type(value).__name__} made in the "
                                 "notebook that cannot be written to a file")
        bodies.append(source if source.endswith("\n") else source + "\n")

    add(obj)
    name = _target(obj).__name__
    text = "\n".join(dict.fromkeys(imports)) + ("\n\n" if imports else "")
    text += "\n\n".join(bodies)
    return text + (f"\n{export} = {name}\n" if export != name else "")


# ------------------------------------------------------------------ writing, reading

def sections(path: Path) -> dict[str, str]:
    """Exercise id -> its section (marker lines included) of a saved file."""
    if not path.is_file():
        return {}
    found, current, lines = {}, None, []
    for line in path.read_text().splitlines(keepends=True):
        if line.startswith(_BEGIN):
            current, lines = line[len(_BEGIN):].split()[0], [line]
        elif current is not None:
            lines.append(line)
            if line.startswith(_END + current):
                found[current], current = "".join(lines), None
    return found


def save(ex_id: str, obj: Any, folder: Path) -> Path:
    """Write ``obj``'s source as exercise ``ex_id``'s section of ``folder/chNN.py``
    (replacing an older one; the other sections stay) and return the file's path."""
    piece = SAVED[ex_id]
    body = section_text(obj, piece.name)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    init = folder / "__init__.py"
    if not init.exists():
        init.write_text('"""Your code from the course\'s exercises, saved as each passed its '
                        'check (paged_lib.course.mine)."""\n')
    path = _file(folder, piece.chapter)
    found = sections(path)
    found[ex_id] = f"{_BEGIN}{ex_id} {piece.name}: {piece.role}\n{body}{_END}{ex_id}\n"
    head = (f'"""Your code from chapter {piece.chapter}\'s exercises, each section written '
            "when its check passed.\n\nWritten by paged_lib.course.mine: run the exercise "
            'again to replace a section.\n"""\n')
    tmp = path.with_suffix(".tmp")
    tmp.write_text(head + "".join(f"\n{found[k]}" for k in sorted(found)))
    os.replace(tmp, path)
    return path


def saved(folder: Path | None = None) -> list[str]:
    """Exercise ids with a saved section in ``folder`` (default :func:`load_folder`)."""
    folder = load_folder() if folder is None else Path(folder)
    ids = {ex for ch in {p.chapter for p in SAVED.values()}
           for ex in sections(_file(folder, ch))}
    return sorted(ids & SAVED.keys())


def load(ex_id: str, folder: Path | None = None) -> Any | None:
    """The saved piece of exercise ``ex_id`` (imported from ``folder/chNN.py``), or None
    if it was never saved. A saved file that does not import, or whose section no longer
    defines the piece's name, raises ``ImportError``."""
    folder = load_folder() if folder is None else Path(folder)
    piece = SAVED[ex_id]
    path = _file(folder, piece.chapter)
    if ex_id not in sections(path):
        return None
    name = f"mine_ch{piece.chapter}_{abs(hash(str(path.resolve()))):x}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and Triton look their module up
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ImportError(f"{path} does not import ({type(err).__name__}: {err})") from err
    if not hasattr(module, piece.name):  # the section is there, its def renamed by hand
        raise ImportError(f"{path} has section {ex_id} but defines no {piece.name}")
    return getattr(module, piece.name)


def share_line(folder: Path | None = None) -> str:
    """One line for the scoreboard: how much of chapter 13's engine is the learner's."""
    folder = load_folder() if folder is None else Path(folder)
    have = saved(folder)
    missing = [f"{k} {SAVED[k].name}" for k in SAVED if k not in have]
    line = (f"Your engine (chapter 13): {len(have)} of {len(SAVED)} pieces are yours "
            f"(saved in {folder})")
    return line + (f"; still the library's: {', '.join(missing)}" if missing else "")


# ------------------------------------------------------------------ the check cell's hook

def _from_a_cell(obj: Any) -> bool:
    funcs = _functions(_target(obj)) if isinstance(_target(obj), type | types.FunctionType) \
        else []
    return bool(funcs) and bool(_CELL.search(funcs[0].__code__.co_filename))


def after_verdict(ex_id: str, passed: bool, candidates: list[Any]) -> None:
    """Called by :func:`paged_lib.course.grading.exercise` after it printed a verdict:
    saves the learner's piece when it passed (one note line says where), never raises."""
    if ex_id not in SAVED:
        return
    try:
        folder = save_folder()
        ours = [c for c in candidates if _from_a_cell(c)]
        if folder is None or not ours:
            return
        shown = f"{folder.name}/ch{SAVED[ex_id].chapter}.py"
        if not passed:
            if ex_id in saved(folder):
                print(f"   {shown} keeps your earlier {ex_id} that passed; this attempt is "
                      "not saved")
            return
        save(ex_id, ours[0], folder)
        print(f"   saved to {shown} ({folder.resolve()}): `from mine.ch"
              f"{SAVED[ex_id].chapter} import {SAVED[ex_id].name}`; chapter 13 builds "
              "your engine from it")
    except Exception as err:  # saving must never change a verdict
        print(f"   (your code was not saved: {err})")


# ------------------------------------------------------------------ the solutions' pieces

def save_solutions(folder: Path, solutions: Path | None = None) -> list[str]:
    """Save every piece as the solution notebooks define it into ``folder``: what a
    learner who passed every engine exercise has in ``mine/``. Each solution's first code
    cell (its imports) and its solution cells run in-process, not its checks or demos;
    returns the ids saved."""
    import torch

    from paged_lib.course import notebooks

    solutions = REPO / "solutions" if solutions is None else Path(solutions)
    done, threads = [], torch.get_num_threads()
    for chapter in sorted({p.chapter for p in SAVED.values()}):
        path = next(solutions.glob(f"{chapter}_*.ipynb"))
        space: dict[str, Any] = {"__name__": "__main__"}
        for n, (i, cell) in enumerate(notebooks.code_cells(notebooks.read(path))):
            if n > 0 and notebooks.BEGIN_SOLUTION not in cell.source:
                continue  # the imports, then the definitions: no checks, no demos
            code = "\n".join(line for line in cell.source.split("\n")
                             if not line.lstrip().startswith(("%", "!", "### ")))
            name = f"<solution {path.stem} cell {i}>"
            linecache.cache[name] = (len(code), None, code.splitlines(True), name)
            exec(compile(code, name, "exec"), space)
        for ex_id, piece in SAVED.items():
            if piece.chapter == chapter:
                save(ex_id, space[piece.name], folder)
                done.append(ex_id)
    torch.set_num_threads(threads)
    return done


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Save the solutions' engine pieces.")
    parser.add_argument("--to", type=Path, default=None,
                        help="folder to write (default: $PAGED_LIB_MINE or the checkout's mine/)")
    args = parser.parse_args()
    target = args.to or load_folder()
    print(f"saved {', '.join(save_solutions(target))} to {target}")
