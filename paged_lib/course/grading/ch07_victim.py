"""Chapter 07's exercise 07.2, ``choose_victim`` (re-exported by
:mod:`paged_lib.course.grading.ch07`).

The learner's rule is asked on hand-made running lists (groups admitted in the same step,
a group admitted again after a recompute, long and short ones, groups of several samples
sharing their prompt's blocks), then on every list the engine offers (replayed) and on
random workloads. A wrong pick is named by recomputing the typical wrong rules on the same
list, and the message says what the learner's rule does when the scheduler (no model:
every sampled token is the same) runs a pressure scenario to the end with it (a request
that finishes much later, or never).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paged_lib.blocks import BlockAllocator, BlockTable
from paged_lib.course import grading
from paged_lib.course.grading import generated, replay
from paged_lib.course.grading import scheduler_loops as loops
from paged_lib.engine.hooks import EngineHooks
from paged_lib.engine.policy import choose_victim as lib_victim
from paged_lib.engine.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus


def _generated(g: SequenceGroup) -> int:
    return max(len(s.output_token_ids) for s in g.seqs)


def _blocks(g: SequenceGroup) -> int:
    return len({b for s in g.live_seqs() if s.block_table for b in s.block_table.blocks})


def _tokens(g: SequenceGroup) -> int:
    return sum(s.num_tokens for s in g.live_seqs())


def _admitted(g: SequenceGroup) -> int:
    return g.timeline.admitted_steps[-1] if g.timeline.admitted_steps else -1


#: The typical wrong rules: (rule, hint). The first that picks what the learner picked
#: on a list names the mistake.
WRONG_RULES: list[tuple[Callable[[list[SequenceGroup]], SequenceGroup], str]] = [
    (lambda r: r[0],
     "you preempted the oldest group (the one asking for the block): it has done the "
     "most work (all of it recomputed or moved), and requests admitted after it finish "
     "first"),
    (lambda r: max(r, key=_generated),
     "you preempted the group with the most generated tokens: all of them are lost "
     "(recomputed) or moved, the most work there is to lose"),
    (lambda r: max(r, key=_blocks),
     "you preempted the group holding the most blocks: it frees the most, but it is the one "
     "that has done the most work, and it loses its place to groups admitted after it"),
    (lambda r: min(r, key=_generated),
     "you chose by generated tokens (fewest): a group admitted again after a recompute "
     "may have many, yet it is the last admitted; a group admitted earlier must not lose "
     "its place to it"),
    (lambda r: max(r, key=lambda g: g.timeline.arrival_step),
     "you chose by arrival: a group preempted by recompute and admitted again arrived "
     "early but was admitted last; the list is in admission order"),
    (lambda r: max(r, key=_admitted),
     "groups admitted in the same step: max() of the admission step returns the first of "
     "them, but the list's order is their admission order (the later one came later)"),
    (lambda r: min(r, key=_blocks),
     "you preempted the group holding the fewest blocks: the least memory to recompute or "
     "move, but a group admitted after it keeps running and takes its place (first come, "
     "first served is never broken: the least work lost only explains why that is cheap)"),
    (lambda r: min(r, key=_tokens),
     "you preempted the group with the fewest tokens (prompt and output, all its "
     "sequences): the least work, but a group admitted after it keeps running and takes "
     "its place (first come, first served is never broken)"),
]


def _group(pool: BlockAllocator, rid: int, prompt_len: int, generated: int, arrival: int,
           admitted: list[int], n: int = 1) -> SequenceGroup:
    """A running group of ``n`` sequences (samples forked after the prompt, each with
    ``generated`` tokens) with real block tables (block size 4)."""
    table = BlockTable(pool, 4)
    for _ in range(prompt_len if n > 1 else prompt_len + generated - 1):
        table.append_token()
    tables = [table] + [table.fork() for _ in range(n - 1)]
    seqs = []
    for i, t in enumerate(tables):
        if n > 1:
            for _ in range(generated - 1):  # the newest token is not cached yet
                t.append_token()
        seqs.append(Sequence(100 * rid + i, [1] * prompt_len, [2 + i] * generated,
                             block_table=t, num_cached=prompt_len + generated - 1,
                             status=SequenceStatus.RUNNING))
    group = SequenceGroup(rid, seqs, SamplingParams(
        max_tokens=128, ignore_eos=True, n=n, temperature=1.0 if n > 1 else 0.0))
    group.timeline.arrival_step = arrival
    group.timeline.admitted_steps = list(admitted)
    return group


#: (what, groups as (request, prompt, generated, arrival, admitted steps)), oldest first
_LISTS: list[tuple[str, list[tuple]]] = [
    ("the example: A, B, C admitted at steps 0, 3, 3 (C after B)",
     [(0, 12, 30, 0, [0]), (1, 8, 10, 1, [3]), (2, 5, 10, 2, [3])]),
    ("a long request first, two short ones admitted after it",
     [(0, 40, 60, 0, [0]), (1, 6, 2, 0, [0]), (2, 9, 1, 3, [5])]),
    ("request 0 was preempted by recompute and admitted again, last",
     [(1, 10, 4, 1, [2]), (2, 6, 3, 2, [4]), (0, 30, 25, 0, [0, 6])]),
    ("the spec's second example: D, then E of four samples",
     [(0, 12, 3, 0, [1]), (1, 20, 2, 1, [5], 4)]),
    ("a request of 3 samples and a short one admitted in the same step, after a long one",
     [(0, 30, 5, 0, [0]), (1, 12, 5, 1, [2], 3), (2, 4, 1, 2, [2])]),
    ("a long single request, then 4 samples of a short prompt",
     [(0, 30, 5, 0, [0]), (1, 8, 2, 1, [3], 4)]),
]


def _describe(groups: list[SequenceGroup]) -> str:
    def one(g: SequenceGroup) -> str:
        n = len(g.live_seqs())
        what = f"{n} samples, {_generated(g)} generated each" if n > 1 else \
            f"{_generated(g)} generated"
        return (f"request {g.request_id} (admitted at step {_admitted(g)}, {what}, "
                f"{_blocks(g)} blocks)")
    return "[" + ", ".join(one(g) for g in groups) + "]"


def _hint_for(picks: list[tuple[list[SequenceGroup], Any]]) -> str | None:
    """The wrong rule that picks what the learner picked on every list (else on the
    first list where the learner was wrong)."""
    for rule, hint in WRONG_RULES:
        if all(rule(list(r)) is got for r, got in picks):
            return hint
    r, got = next((r, g) for r, g in picks if g is not lib_victim(list(r)))
    return next((hint for rule, hint in WRONG_RULES if rule(list(r)) is got), None)


_GENERIC = ("a group is never preempted to make room for one admitted after it; among "
            "those offered, preempting costs the least where the least was done")


def _fail_pick(running: list[SequenceGroup], got: Any, where: str, hint: str | None,
               consequence: str = "") -> None:
    if not any(got is g for g in running):
        grading.fail(f"{where}: returned {got!r}, which is not one of the groups offered",
                     "return one of the SequenceGroup objects in running itself (not an "
                     "index, a request id or a copy)")
    want = lib_victim(list(running))
    grading.fail(f"{where}: running {_describe(running)}: you preempted request "
                 f"{got.request_id}, expected request {want.request_id}{consequence}",
                 hint or _GENERIC)


def check_lists(choose_victim: Callable[..., Any]) -> None:
    picks, pool = [], BlockAllocator(200)
    for what, spec in _LISTS:
        running = [_group(pool, *g) for g in spec]
        given = list(running)
        got = choose_victim(given)
        grading.expect_true(len(given) == len(running) and all(
            a is b for a, b in zip(given, running, strict=True)),
            f"list '{what}': your function changed the list it was given",
            "only choose: the scheduler preempts and removes the group itself")
        picks.append((running, got))
    for (what, _), (running, got) in zip(_LISTS, picks, strict=True):
        if not any(got is g for g in running) or got is not lib_victim(list(running)):
            _fail_pick(running, got, f"list '{what}'", _hint_for(picks),
                       _consequence(choose_victim) if any(got is g for g in running) else "")


#: the scheduler scenario a wrong rule is run on to the end, to tell what it does
PRESSURE = loops.Scenario("a long request among short ones arriving every 3 steps "
                          "(recompute)", dict(num_blocks=10, block_size=4),
                          ((6, 26, 0, 1),) + tuple((3, 6, 1 + 3 * k, 1) for k in range(10)))


def _consequence(choose_victim: Callable) -> str:
    """What the learner's rule does to :data:`PRESSURE`, next to the library's."""
    def run(rule: Callable) -> tuple:
        return loops.serve_scenario(PRESSURE, EngineHooks(choose_victim=rule), [None])[3]
    try:
        mine, lost = run(lambda running: choose_victim(list(running)))
    except Exception:  # noqa: BLE001 - only what the rule would do, not the verdict
        return ""
    ref, ref_lost = run(lib_victim)
    told = f" (run to the end on '{PRESSURE.name}', your rule"
    never = [r for r, s in mine.items() if s is None]
    if never:
        return f"{told} never finishes request(s) {never})"
    late = max(mine, key=lambda r: mine[r] - ref[r])
    said = ([f"finishes request {late} at step {mine[late]} instead of {ref[late]}"]
            if mine[late] != ref[late] else []) + (
        [f"recomputes {lost} tokens instead of {ref_lost}"] if lost != ref_lost else [])
    return f"{told} {', '.join(said)})" if said else ""


def check_choose_victim(choose_victim: Callable[..., Any]) -> None:
    """``choose_victim(running: list[SequenceGroup]) -> SequenceGroup``."""
    with grading.exercise("07.2"):
        check_lists(choose_victim)
        replay.check_replay("choose_victim", choose_victim,
                            "the list is the group that needs blocks, then the groups admitted "
                            "after it, in admission order (several may share a step): the "
                            "last of the list is the latest admitted")
        generated.check("choose_victim", choose_victim, "the list is in admission order, "
                        "whatever the groups' ids, arrivals or sizes: the last is the latest "
                        "admitted")
