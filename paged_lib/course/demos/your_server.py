"""Chapter 14: ``python -m paged_lib.serve --mine`` serves chapter 13's engine of your pieces.

:class:`ServedLLM` is what ``--mine`` builds (the server names it by its path; the system
never imports the course). Before the model is loaded it says, piece by piece, whose code
the server will run, as chapter 13 does:

* a piece you have not passed yet (nothing saved in ``mine/``, as in a fresh clone) is the
  library's, and so is one whose saved file no longer imports (the line says why);
* each piece you saved is first run on chapter 13's scenarios (small workloads on the tiny
  model, a few seconds for all of them): one that serves them differently from the library
  is named with the first difference and the library's runs in its place, so a wrong piece
  cannot take the server down;
* the decode kernel (05.5) is yours in chapter 13 only: the server computes attention with
  the library's kernels (a Triton kernel run by the CPU interpreter is far too slow to
  serve). Pieces of options the server was not started with (int8 KV cache, a sliding
  window, tensor parallelism) are said to wait for those flags.

Nothing here raises for a missing or broken piece: the report says it and the library's
piece serves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paged_lib.course import mine
from paged_lib.course.chapters import REPO
from paged_lib.course.demos import your_engine

#: pieces the server never runs, and why
NOT_SERVED = {"05.5": "not run by the server: attention is the library's kernel; "
                      "chapter 13 runs yours"}
#: pieces that run only with an engine option, and the flag that turns it on
NEEDS_FLAG = {"11.3": "--kv-cache-dtype int8", "11.4": "--sliding-window",
              "12.3": "--tensor-parallel-size 2"}


def checked_pieces(pieces: dict[str, Any], options: dict[str, Any]
                   ) -> tuple[dict[str, Any], dict[str, str]]:
    """(the pieces that pass chapter 13's checks (its scenarios, then random workloads), a
    note per piece of yours that does not run: why the library's runs instead). A piece
    the server does not run with these ``options`` is not checked."""
    from paged_lib.course.demos import your_engine_scenarios as scenarios

    kept, notes = {}, {}
    for ex_id, obj in sorted(pieces.items()):
        if ex_id in NOT_SERVED:
            notes[ex_id] = NOT_SERVED[ex_id]
            continue
        if ex_id in NEEDS_FLAG and not _option_on(ex_id, options):
            notes[ex_id] = f"runs with {NEEDS_FLAG[ex_id]}; not checked now"
            continue
        try:
            verdict = scenarios.check_piece(ex_id, obj)
        except Exception as err:  # noqa: BLE001 - a report, never a crash
            verdict = f"could not be checked ({type(err).__name__}: {err})"
        if verdict is None:
            kept[ex_id] = obj
        else:
            notes[ex_id] = f"yours differs, so the library's serves: {verdict[:300]}"
    return kept, notes


def report(parts: list[your_engine.Part], kept: dict[str, Any], notes: dict[str, str],
           folder: Path) -> str:
    """The lines ``--mine`` prints: one per piece, whose it is and why."""
    where = "" if Path(folder).is_dir() else (": no such folder yet; a check cell of "
                                               "exercises/ saves there when it passes")
    try:  # the checkout's own mine/ is named from the checkout's root
        shown = Path(folder).resolve().relative_to(REPO)
    except ValueError:
        shown = folder
    lines = [f"--mine: chapter 13's engine, your pieces from {shown}{where} (the "
             "library's for the rest)"]
    for part in parts:
        ex_id, note = part.ex_id, part.note
        if ex_id in kept:
            who, note = "yours  ", "as the library on chapter 13's checks"
        elif part.yours:
            who, note = "library", notes.get(ex_id, note)
        else:
            who = "library"
        lines.append(f"{ex_id}  {who}  {part.role}" + (f"  ({note})" if note else ""))
    lines.append(f"{len(kept)} of {len(parts)} pieces of the served engine are yours")
    return "\n".join(lines)


def _option_on(ex_id: str, options: dict[str, Any]) -> bool:
    if ex_id == "11.3":
        return options.get("kv_cache_dtype") == "int8"
    if ex_id == "11.4":
        return bool(options.get("sliding_window"))
    return (options.get("tensor_parallel_size") or 1) > 1


class ServedLLM(your_engine.YourLLM):
    """:class:`~paged_lib.course.demos.your_engine.YourLLM` as ``--mine`` serves it: the
    saved pieces that pass chapter 13's checks, the library's for the rest, and the
    report (:func:`report`) printed first."""

    def __init__(self, model, pieces: dict[str, Any] | None = None, **options):
        folder = mine.load_folder()
        found, parts = your_engine.gather(folder)
        if pieces is None and found:
            print(f"--mine: checking {len(found)} saved piece(s) on chapter 13's scenarios "
                  "and random workloads (a few seconds each)", flush=True)
        kept, notes = checked_pieces(found if pieces is None else pieces, options)
        print(report(parts, kept, notes, folder), flush=True)
        super().__init__(model, pieces=kept, **options)
