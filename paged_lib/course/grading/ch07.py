"""Checks for chapter 07 (preemption), each against the library's function: 07.1
``swap_mapping`` on tables with shared blocks, 07.2 ``choose_victim`` on hand-made running
lists (a wrong pick named by the wrong rule that gives it), 07.3 ``preempt_until_fits``
served next to the library's (:mod:`~paged_lib.course.grading.scheduler_loops`); each then
on random workloads."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from paged_lib.blocks import BlockAllocator, BlockTable
from paged_lib.course import grading
from paged_lib.course.grading import generated
from paged_lib.course.grading import scheduler_loops as loops
from paged_lib.course.grading.scheduler_loops import Scenario
from paged_lib.engine import policy
from paged_lib.engine.block_manager import swap_mapping as lib_swap_mapping
from paged_lib.engine.policy import choose_victim as lib_victim
from paged_lib.engine.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus

#: Mutants of the solutions that cannot change any answer (tools/mutants.py skips them).
EQUIVALENT_MUTANTS: dict[str, dict[str, str]] = {"07.3": {
    "off-by-one: `step.running.index(group) + 1` -> `step.running.index(group)` in "
    "`after = step.running[step.running.index(group) + 1:]`":
    "the slice then starts with group itself, which is first in the list offered anyway",
    "constant: `1` -> `0` in `after = step.running[step.running.index(group) + 1:]`":
    "the same slice as above, starting with group itself",
}}

#: name, tables, free blocks of the destination pool in allocation order
_SWAPS: list[tuple[str, list[list[int]], list[int]]] = [
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
    """A pool's ``allocate`` handing out ``order``, then 100, 101, ...; and what it handed."""
    handed: list[int] = []
    def allocate() -> int:
        handed.append(order[len(handed)] if len(handed) < len(order) else 100 + len(handed))
        return handed[-1]
    return allocate, handed


def check_swap_mapping(swap_mapping: Callable[..., Any]) -> None:
    """``swap_mapping(tables, allocate) -> list[tuple[int, int]]``."""
    with grading.exercise("07.1"):
        for name, tables, order in _SWAPS:
            _check_scenario(swap_mapping, name, tables, order)
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
    grading.expect_true(isinstance(got, list) and all(isinstance(p, tuple) and len(p) == 2 and all(
        isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in p) for p in got),
        f"{where}: expected a list of (src, dst) int tuples, got {got!r}",
        "return a list of pairs, e.g. [(7, 0), (3, 1), (5, 2)]")
    blocks, (sources, dsts) = {b for t in tables for b in t}, ([p[i] for p in got] for i in (0, 1))
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


# ------------------------------------------------------------------ 07.2 choose_victim


#: a group's generated tokens (its longest sequence's), blocks (each once), tokens (prompt
#: and outputs, all its live sequences) and last admission step
_generated = lambda g: max(len(s.output_token_ids) for s in g.seqs)
_blocks = lambda g: len({b for s in g.live_seqs() if s.block_table for b in s.block_table.blocks})
_tokens = lambda g: sum(s.num_tokens for s in g.live_seqs())
_admitted = lambda g: g.timeline.admitted_steps[-1] if g.timeline.admitted_steps else -1


_ORDER = ("the list is in admission order: the last is the latest admitted, not the latest "
          "arrival, request id or first admission (a group preempted by recompute and "
          "admitted again arrived early but was admitted last); among groups admitted in "
          "the same step, the later in the list came later, whatever max() returns for a "
          "tie (the first), or their ids, arrivals or sizes")

_LARGEST = ("you preempted the largest group (the most generated tokens, tokens or blocks): "
            "it frees the most, but it has done the most work (all of it recomputed or "
            "moved), and it loses its place to groups admitted after it")
_SMALLEST = ("you preempted the smallest group (the fewest blocks, or tokens: prompt and "
             "output, all its sequences): the least work lost, but a group admitted after it "
             "keeps running and takes its place (first come, first served is never broken)")

#: The typical wrong rules: (rule, hint). The one that picks what the learner picked on
#: the most lists (the first of those tied) names the mistake.
WRONG_RULES: list[tuple[Callable[[list[SequenceGroup]], SequenceGroup], str]] = [
    (lambda r: r[0],
     "you preempted the oldest group (the one asking for the block): it has done the "
     "most work (all of it recomputed or moved), and requests admitted after it finish "
     "first"),
    (lambda r: max(r, key=_generated), _LARGEST),
    (lambda r: max(r, key=_blocks), _LARGEST),
    (lambda r: min(r, key=_generated),
     "you chose by generated tokens (fewest): a group admitted again after a recompute "
     "may have many, yet it is the last admitted; a group admitted earlier must not lose "
     "its place to it"),
    (lambda r: max(r, key=_admitted), _ORDER),
    (lambda r: max(r, key=lambda g: (_admitted(g), -_generated(g))), _ORDER),  # tie: fewest
    (lambda r: max(r, key=lambda g: g.timeline.arrival_step), _ORDER),
    (lambda r: min(r, key=_blocks), _SMALLEST),
    (lambda r: min(r, key=_tokens), _SMALLEST),
    (lambda r: r[min(1, len(r) - 1)],
     "you preempted the group right after the one asking (running[1]): the groups after "
     "it are in admission order too, and the last of them is the latest admitted"),
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
     [(1, 10, 3, 1, [2]), (2, 6, 4, 2, [4]), (0, 30, 25, 0, [0, 6])]),
    ("the spec's second example: D, then E of four samples",
     [(0, 12, 3, 0, [1]), (1, 20, 2, 1, [5], 4)]),
    ("a request of 3 samples and a short one admitted in the same step, after a long one",
     [(0, 30, 5, 0, [0]), (1, 12, 6, 1, [2], 3), (2, 4, 1, 2, [2])]),
    ("request 5, then request 3, admitted in the same step: 5 arrived with 3, is smaller",
     [(0, 16, 8, 0, [0]), (5, 4, 2, 2, [4]), (3, 14, 6, 2, [4])]),
    ("a long single request, then 4 samples of a short prompt",
     [(0, 30, 5, 0, [0]), (1, 8, 2, 1, [3], 4)]),
]


def _running(groups: list[SequenceGroup]) -> str:
    def one(g: SequenceGroup) -> str:
        n = len(g.live_seqs())
        what = f"{n} samples, {_generated(g)} generated each" if n > 1 else \
            f"{_generated(g)} generated"
        return (f"request {g.request_id} (admitted at step {_admitted(g)}, {what}, "
                f"{_blocks(g)} blocks)")
    return "[" + ", ".join(one(g) for g in groups) + "]"


def check_choose_victim(choose_victim: Callable[..., Any]) -> None:
    """``choose_victim(running: list[SequenceGroup]) -> SequenceGroup``: a wrong pick is
    named by the wrong rule that picks as the learner did on the most lists."""
    with grading.exercise("07.2"):
        picks, pool = [], BlockAllocator(200)
        for what, spec in _LISTS:
            running = [_group(pool, *g) for g in spec]
            given = list(running)
            got = choose_victim(given)
            grading.expect_true(list(map(id, given)) == list(map(id, running)),
                                f"list '{what}': your function changed the list it was given",
                                "only choose: the scheduler preempts and removes the group itself")
            grading.expect_true(any(got is g for g in running), f"list '{what}': returned "
                                f"{got!r}, which is not one of the groups offered",
                                "return one of the SequenceGroup objects in running itself "
                                "(not an index, a request id or a copy)")
            picks.append((what, running, got))
        wrong = [(what, r, got) for what, r, got in picks if got is not lib_victim(list(r))]
        if wrong:  # told on a list where that rule picks as the learner did
            rule, hint = max(WRONG_RULES, key=lambda w: sum(w[0](list(r)) is g
                                                            for _, r, g in picks))
            what, running, got = next((p for p in wrong if rule(list(p[1])) is p[2]), wrong[0])
            grading.fail(f"list '{what}': running {_running(running)}: you preempted "
                         f"request {got.request_id}, expected request "
                         f"{lib_victim(list(running)).request_id}", hint if rule(list(
                             running)) is got else "a group is never preempted to make room "
                         "for one admitted after it; among those offered, preempting costs "
                         "the least where the least was done")
        generated.check("choose_victim", choose_victim, "the list is in admission order, "
                        "whatever the groups' ids, arrivals or sizes: the last is the latest "
                        "admitted")


# ------------------------------------------------------------------ 07.3 preempt_until_fits


def _snapshot(group, step) -> SimpleNamespace:
    rule = step.hooks.choose_victim
    return SimpleNamespace(
        rid=group.request_id, need=step.blocks_needed, free=step.free_blocks,
        mode=step.preemption, cpu_free=step.cpu_free_blocks,
        running=[SimpleNamespace(rid=g.request_id, admitted=g.timeline.admitted_steps[-1],
                                 seqs=len(g.live_seqs()), decoding=step.is_decoding(g),
                                 ran=step.ran(g), blocks=_blocks(g)) for g in step.running],
        rule=None if rule is policy.choose_victim else  # the engine's, when not the library's
        (rule.__doc__ or rule.__name__).strip().splitlines()[0])


def _decide(args, before, result) -> tuple:
    step, victims = args[1], []
    for g in step.preempted[before[1]:]:
        name, at = next(((name, k) for name, q in (("swapped", step.swapped), ("waiting",
                         step.waiting)) for k, x in enumerate(q) if x is g), ("no queue", -1))
        victims.append((g.request_id, "lost" if at < 0 else "swapped out" if name ==
                        "swapped" and g.seqs[0].status.name == "SWAPPED" else "freed",
                        name, at))
    return result, tuple(victims)


def _describe(st: SimpleNamespace) -> str:
    groups = ", ".join(
        f"request {r.rid} (admitted at step {r.admitted}, {r.seqs} sequence(s), "
        f"{'decoding' if r.decoding else 'part way through a prefill'}, {r.blocks} blocks"
        + (", ran this step" if r.ran else "") + ")" for r in st.running)
    cpu = f", the CPU pool has {st.cpu_free} free blocks" if st.cpu_free is not None else ""
    rule = f"; the engine's choose_victim takes {st.rule}" if st.rule else ""
    return (f"request {st.rid} needs {st.need} free blocks and {st.free} are free; running "
            f"[{groups}] (admission order); preemption '{st.mode}'{cpu}{rule}")


def _show(decision) -> str:
    return "preempts " + (", ".join(f"request {r} ({how}, to position {at} of {queue})"
                                    for r, how, queue, at in decision[1]) or "nobody") + \
        f" and answers {decision[0]!r}"


def _why(st: SimpleNamespace, lib, got) -> str:
    by_id, order = {r.rid: r for r in st.running}, [r.rid for r in st.running]
    if isinstance(got, Exception):
        return _WHY["mode"] if "not in list" not in str(got) and st.mode == "swap" and max(
            (r.blocks for r in st.running), default=0) > st.cpu_free else _WHY["steps"]
    (_, lib_v), (_, mine) = lib, got
    a, b = next(((a, b) for a, b in zip(lib_v, mine, strict=False) if a[:3] != b[:3]),
                (None, None))
    if a is None:
        return _WHY["loop" if len(mine) != len(lib_v) else "front" if mine != lib_v else
                    "answer"]
    if a[0] == b[0]:
        return _WHY["steps" if b[1] == "lost" else "waiting" if a[1] == b[1] == "freed" else
                    "mode"]
    me = by_id.get(b[0])
    return _WHY[next((rule for cond, rule in (
        (me is not None and me.ran, "ran"),
        (b[0] in order and order.index(b[0]) < order.index(st.rid), "before"),
        (a[0] in by_id and not by_id[a[0]].decoding and a[0] != st.rid, "prefilling"),
        (a[1] == "freed" and b[1] == "swapped out", "unswappable"),
        (st.rule is not None, "hook"))
        if cond), "latest")]


#: one hint per rule of preemption, whichever way the answer broke it
_WHY = {
    "steps": "for each victim: remove it from step.running, then step.swap_out(victim) or "
             "step.free(victim), then put it at the front of step.swapped or step.waiting; "
             "a victim is offered once: build the list again from step.running each time",
    "ran": "a group that already ran this step cannot be preempted (its tokens are "
           "scheduled): only the group asking and those after it that have not run yet",
    "before": "never preempt a group admitted before the one asking, even one that has not "
              "run yet this step: first come, first served",
    "unswappable": "the engine's rule chose a victim that cannot be swapped (its K/V is not "
                   "all there, or the CPU pool cannot take it all): it is still the victim, "
                   "recomputed; the loop does not pass it over for a group that could be "
                   "swapped",
    "hook": "ask step.hooks.choose_victim for the victim: the engine's rule may be another "
            "one; offer it group and the groups after it that have not run, oldest first",
    "prefilling": "a group part way through its prefill (admitted this step, or between "
                  "chunks) that has not run yet is a candidate too: offer group and every "
                  "group after it that has not run, decoding or not (one that cannot be "
                  "swapped is recomputed)",
    "latest": "the latest admitted goes first (vLLM pops its running queue from the end): it "
              "has done the least, and the group asking may be the victim itself",
    "waiting": "a victim whose blocks were freed, not copied, has nothing waiting on the CPU "
               "to be swapped back in: it is prefilled again from its text, from "
               "step.waiting, whatever the preemption mode",
    "mode": "preemption 'swap' copies a decoding victim to the CPU pool (step.swap_out), "
            "'recompute' frees its blocks (step.free); a group part way through a prefill "
            "cannot be swapped (its K/V is not all written; step.is_decoding says, outputs or "
            "not: a recomputed group prefills them again), nor one the CPU pool cannot "
            "take (step.can_swap_out): swap falls back to recompute, for that victim alone (the "
            "next one is swapped if it can be)",
    "loop": "keep preempting until the group's blocks fit: one victim may free too few (a "
            "group shares blocks, or holds few); stop as soon as they fit "
            "(step.blocks_needed <= step.free_blocks), and preempt nobody at all when they "
            "already fit",
    "front": "a victim goes back to the FRONT of its queue (appendleft): it was admitted "
             "before every group waiting, and comes back first; a victim swapped out goes "
             "to the FRONT of step.swapped too (victims leave latest first, so each one put "
             "in front keeps the earliest admitted first)",
    "answer": "answer True when the group's blocks fit and it runs now, False when it was "
              "preempted itself",
}


loops.LOOPS["preempt_until_fits"] = (_snapshot, _decide, _describe, _show, _why)


def oldest_first(running: list) -> Any:
    """the oldest admitted first (the group asking)"""
    return running[0]


#: scenarios served by the scheduler alone: requests (prompt, max_tokens, arrival, n)
SCENARIOS: list[Scenario] = [
    Scenario("by swap, 2 samples recomputed, prefilled again by chunks of 8, admitted before "
             "a decoding group that needs a block; the engine's choose_victim the oldest first",
             dict(num_blocks=11, block_size=2, preemption="swap", num_cpu_blocks=5,
                  enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4),
             ((5, 8, 0, 1), (8, 6, 0, 2), (2, 8, 4, 1)), hooks=(("choose_victim", oldest_first),)),
    Scenario("by swap, a CPU pool of 4 blocks: the latest admitted holds 5, the one before "
             "it 2", dict(num_blocks=12, block_size=4, preemption="swap", num_cpu_blocks=4),
             ((18, 10, 3, 1), (17, 8, 4, 1), (18, 5, 2, 1), (5, 12, 2, 1))),
    Scenario("2 samples recomputed, prefilled again by chunks of 8, admitted before a "
             "decoding group that needs a block", dict(num_blocks=11, block_size=2,
             enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4),
             ((3, 8, 0, 1), (9, 5, 1, 2), (1, 5, 3, 1))),
    Scenario("by swap, chunks of 6, a CPU pool of 3 blocks: in one call a victim part way "
             "through its prompt is recomputed, then a decoding one swapped",
             dict(num_blocks=7, block_size=4, preemption="swap", num_cpu_blocks=3,
                  enable_chunked_prefill=True, max_num_batched_tokens=6, max_num_seqs=4),
             ((10, 4, 1, 2), (8, 4, 1, 1), (15, 9, 2, 1))),
]


def check_preempt_until_fits(preempt_until_fits: Callable[..., Any]) -> None:
    """``preempt_until_fits(group, step) -> bool``."""
    with grading.exercise("07.3"):
        loops.run_scheduler("preempt_until_fits", preempt_until_fits, SCENARIOS, "ask "
                            "choose_victim among the group and those admitted after it that "
                            "have not run, one victim at a time, until the blocks fit or the "
                            "group itself is preempted")
