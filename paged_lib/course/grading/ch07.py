"""Checks for chapter 07 (preemption).

* 07.1 ``swap_mapping``: the block copies that move one sequence group's block tables to
  the other pool. Checked on tables with and without shared blocks (a forked prompt, beams
  with a common history) against :func:`paged_lib.engine.block_manager.swap_mapping`,
  with an allocator that counts every block handed out (a block allocated and never used
  is a leak); then every call the engine makes (replayed) and random workloads, where the
  engine calls it again and again with the same pool's ``allocate``.

* 07.2 ``choose_victim``: which running group to preempt
  (:mod:`paged_lib.course.grading.ch07_victim`).
* 07.3 ``preempt_until_fits``: the whole preemption loop, plugged into the engine and
  compared call by call with the library's (:mod:`paged_lib.course.grading.ch07_preempt`).

:func:`run_demo` serves the chapter's too-small pool with the learner's ``choose_victim``,
by recompute, then by swap with the learner's mapping too, and compares the tokens, the
preemptions and the copies with the library's runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paged_lib.course import grading
from paged_lib.course.demos.engine_compare import (  # the chapter's trace (notebook 07)
    PRESSURE_BLOCK_SIZE,
    PRESSURE_BLOCKS,
    pressure_requests,
)
from paged_lib.course.grading import generated, replay, serving
from paged_lib.course.grading.ch07_preempt import check_preempt_until_fits
from paged_lib.course.grading.ch07_victim import check_choose_victim
from paged_lib.engine.block_manager import swap_mapping as lib_swap_mapping
from paged_lib.engine.hooks import EngineHooks

__all__ = ["EQUIVALENT_MUTANTS", "PRESSURE_BLOCKS", "PRESSURE_BLOCK_SIZE",
           "check_choose_victim", "check_preempt_until_fits", "check_swap_mapping",
           "pressure_requests", "run_demo"]


#: Mutants of the solutions that cannot change any answer (tools/mutants.py skips them).
EQUIVALENT_MUTANTS: dict[str, dict[str, str]] = {"07.3": {
    "off-by-one: `step.running.index(group) + 1` -> `step.running.index(group)` in "
    "`after = step.running[step.running.index(group) + 1:]`":
    "the slice then starts with group itself, which is first in the list offered anyway",
    "constant: `1` -> `0` in `after = step.running[step.running.index(group) + 1:]`":
    "the same slice as above, starting with group itself",
}}

#: name, tables, free blocks of the destination pool in allocation order
_SCENARIOS: list[tuple[str, list[list[int]], list[int]]] = [
    ("the spec's example: one sequence, nothing shared", [[4, 9, 2]], [5, 0, 3, 1]),
    ("two samples share their prompt's block 7", [[7, 3], [7, 5]], [0, 1, 2]),
    ("three beams share 2 prompt blocks; two also share block 6",
     [[10, 11, 6, 1], [10, 11, 6, 8], [10, 11, 3]], [7, 2, 9, 0, 4, 5, 12, 13]),
    ("four samples fork a 1-block prompt, each wrote 1 block of its own",
     [[0, 5], [0, 6], [0, 7], [0, 8]], [3, 2, 1, 9, 10, 11]),
    ("four beams: the last shares block 4 with the second only (beams ordered by score)",
     [[9, 2], [9, 4, 6], [9, 5], [9, 4, 8]], [20, 21, 22, 23, 24, 25, 26]),
]


def _pool(order: list[int]) -> tuple[Callable[[], int], list[int]]:
    """A destination pool's ``allocate``, handing out blocks in a fixed order (then 100,
    101, ...: a real pool has more free blocks than one group needs), and what it handed."""
    handed: list[int] = []

    def allocate() -> int:
        handed.append(order[len(handed)] if len(handed) < len(order) else 100 + len(handed))
        return handed[-1]
    return allocate, handed


def check_swap_mapping(swap_mapping: Callable[..., Any]) -> None:
    """``swap_mapping(tables, allocate) -> list[tuple[int, int]]``."""
    with grading.exercise("07.1"):
        for name, tables, order in _SCENARIOS:
            _check_scenario(swap_mapping, name, tables, order)
        replay.check_replay("swap_mapping", swap_mapping,
                            "a forked group's tables share blocks in any pattern (beams that "
                            "forked at different steps): copy each distinct block once, in "
                            "the order first met reading every table left to right")
        generated.check("swap_mapping", swap_mapping, "copy each distinct block once, in "
                        "the order first met reading every table left to right, to a block "
                        "this call's allocate() returns: nothing carries over from an "
                        "earlier call (the engine passes the same pool's allocate each "
                        "time, and block ids come back)")


def _check_scenario(fn, name: str, tables: list[list[int]], order: list[int]) -> None:
    where = f"scenario '{name}' (tables {tables})"
    given, (allocate, handed) = [list(t) for t in tables], _pool(order)
    got = fn(given, allocate)
    want = lib_swap_mapping(tables, _pool(order)[0])
    grading.expect_true(given == tables, f"{where}: your function changed the tables",
                        "read the tables, do not change them: the block manager "
                        "rebuilds them from your mapping")
    grading.expect_true(isinstance(got, list) and all(
        isinstance(p, tuple) and len(p) == 2 and all(type(x) is int for x in p) for p in got),
        f"{where}: expected a list of (src, dst) int tuples, got {got!r}",
        "return a list of pairs, e.g. [(7, 0), (3, 1), (5, 2)]")
    blocks, sources, dsts = {b for t in tables for b in t}, [p[0] for p in got], \
        [p[1] for p in got]
    twice = sorted({b for b in sources if sources.count(b) > 1})
    for wrong, what, hint in (
            (twice, f"block(s) {twice} are copied more than once: {got}", "copied a shared "
             "block twice: a block held by several sequences moves once, and every table "
             "then points at its one copy"),
            (set(sources) != blocks and set(dsts) == blocks, f"got {got}, expected {want}",
             "the pairs are (src, dst): the block you copy from, then the block allocate() "
             "gave you"),
            (set(sources) != blocks, f"the sources {sorted(set(sources))} are not the "
             f"tables' blocks {sorted(blocks)}", "every block of every table must be copied "
             "(once)"),
            (len(handed) > len(blocks), f"allocate() was called {len(handed)} times for "
             f"{len(blocks)} distinct blocks", "leaked blocks: allocate() only for a block you "
             "have not met yet; a block allocated and not in the mapping is never freed"),
            (sorted(dsts) != sorted(handed), f"destinations {dsts} are not the blocks "
             f"allocate() returned {handed}", "each dst is a fresh block from allocate(), "
             "never a source block"),
            (got != want, f"mapping: expected {want}, got {got}", "pairs in the order the "
             "blocks are first met, reading the tables left to right, top to bottom")):
        if wrong:
            grading.fail(f"{where}: {what}", hint)


# ------------------------------------------------------------------ the demo


def run_demo(swap_mapping: Callable[..., Any], choose_victim: Callable[..., Any],
             model: Any = None, preempt_until_fits: Callable[..., Any] | None = None) -> None:
    """The chapter's too-small pool served with the learner's ``choose_victim`` (and
    ``preempt_until_fits`` when given), by recompute and by swap (with the learner's
    mapping), next to the library's runs."""
    from paged_lib.model import load_tiny_code_llama

    model = model if model is not None else load_tiny_code_llama()
    prompts, params = pressure_requests()

    also = "" if preempt_until_fits is None else " (and preempt_until_fits)"
    asked = [0]

    def victim(running: list) -> Any:
        asked[0] += 1
        return choose_victim(running)

    def serve(mode: str, **hooks: Any) -> None:
        asked[0] = 0
        if preempt_until_fits is not None:
            hooks["preempt_until_fits"] = preempt_until_fits
        run = serving.side_by_side(model, PRESSURE_BLOCKS, PRESSURE_BLOCK_SIZE, prompts,
                                   params, EngineHooks(choose_victim=victim, **hooks),
                                   num_cpu_blocks=64, preemption=mode)
        s, r = run.yours.stats, run.library.stats
        print(f"recompute, your choose_victim{also}: {len(prompts)} requests on {PRESSURE_BLOCKS} "
              f"blocks in {s.steps} steps (library: {r.steps}), {s.preemptions} preemptions "
              f"(library: {r.preemptions}), {s.recomputed_tokens} tokens recomputed "
              f"(library: {r.recomputed_tokens})" if mode == "recompute" else
              f"swap, your choose_victim and swap_mapping{also}: {s.preemptions} preemptions, "
              f"{s.swapped_blocks} block copies (library: {r.preemptions}, "
              f"{r.swapped_blocks})")
        print(f"every token {'equals' if run.same_tokens else 'DIFFERS from'} the library "
              "engine's")
        if s.preemptions and not asked[0]:
            print("your preempt_until_fits never asked step.hooks.choose_victim: these "
                  "victims are its own choice, not your choose_victim's")

    grading.on_learner_code(lambda: serve("recompute"), "exercises 07.2 and 07.3",
                            "recompute with your choose_victim")
    grading.on_learner_code(lambda: serve("swap", swap_mapping=swap_mapping),
                            "exercises 07.1-07.3", "swap with your functions")
