"""Chapter 07's exercise 07.3, ``preempt_until_fits`` (re-exported by
:mod:`paged_lib.course.grading.ch07`).

The learner's loop is plugged into the engine (:mod:`~paged_lib.course.grading.scheduler_loops`):
first on edge scenarios served by the scheduler alone (groups admitted in the same step,
by recompute and by swap, groups of several samples, one victim too few, a CPU pool too
small to take a victim, groups that already ran this step, the engine's rule the oldest
first, a group admitted before the one asking that has not run yet, a victim the CPU pool
cannot take while a smaller one before it could), then on the replay workloads with the
tiny model, then on random workloads (:mod:`~paged_lib.course.grading.generated`). Every
call must preempt the same groups, the same way, to the same place, and answer the same
as the library's :func:`paged_lib.engine.policy.preempt_until_fits`; the first call that
does not is told with its state, and the hint names the rule that state exposes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from paged_lib.course import grading
from paged_lib.course.grading import generated
from paged_lib.course.grading import scheduler_loops as loops
from paged_lib.course.grading.scheduler_loops import Scenario
from paged_lib.engine import policy


class Running(NamedTuple):
    rid: int
    admitted: int
    seqs: int
    decoding: bool
    ran: bool
    blocks: int


class PreState(NamedTuple):
    rid: int
    need: int
    free: int
    running: tuple
    mode: str
    cpu_free: int | None
    rule: str | None  # the engine's choose_victim, when it is not the library's


def _snapshot(group, step) -> PreState:
    running = tuple(Running(g.request_id, g.timeline.admitted_steps[-1], len(g.live_seqs()),
                            step.is_decoding(g), step.ran(g), _blocks(g))
                    for g in step.running)
    rule = step.hooks.choose_victim
    told = None if rule is policy.choose_victim else \
        (rule.__doc__ or rule.__name__).strip().splitlines()[0]
    return PreState(group.request_id, step.blocks_needed, step.free_blocks, running,
                    step.preemption, step.cpu_free_blocks, told)


def _blocks(group) -> int:
    return len({b for s in group.live_seqs() if s.block_table for b in s.block_table.blocks})


def _decide(args, before, result) -> tuple:
    step = args[1]
    victims = []
    for g in step.preempted[before[1]:]:
        for name, queue in (("swapped", step.swapped), ("waiting", step.waiting)):
            at = next((k for k, q in enumerate(queue) if q is g), None)
            if at is not None:
                how = "swapped out" if name == "swapped" and g.seqs[0].status.name == \
                    "SWAPPED" else "freed"
                victims.append((g.request_id, how, name, at))
                break
        else:
            victims.append((g.request_id, "lost", "no queue", -1))
    return result, tuple(victims)


def _describe(st: PreState) -> str:
    groups = ", ".join(
        f"request {r.rid} (admitted at step {r.admitted}, {r.seqs} sequence(s), "
        f"{'decoding' if r.decoding else 'part way through a prefill'}, {r.blocks} blocks"
        + (", ran this step" if r.ran else "") + ")" for r in st.running)
    cpu = f", the CPU pool has {st.cpu_free} free blocks" if st.cpu_free is not None else ""
    rule = f"; the engine's choose_victim takes {st.rule}" if st.rule else ""
    return (f"request {st.rid} needs {st.need} free blocks and {st.free} are free; running "
            f"[{groups}] (admission order); preemption '{st.mode}'{cpu}{rule}")


def _show(decision) -> str:
    runs, victims = decision
    if not victims:
        done = "preempts nobody"
    else:
        done = "preempts " + ", ".join(
            f"request {r} ({how}, to position {at} of {queue})" for r, how, queue, at in victims)
    return f"{done} and answers {runs!r}"


def _why(st: PreState, lib, got) -> str:
    if isinstance(got, Exception):
        biggest = max((r.blocks for r in st.running), default=0)
        if st.mode == "swap" and st.cpu_free is not None and biggest > st.cpu_free:
            return ("the CPU pool cannot take every victim: when step.can_swap_out(victim) "
                    "says no, swap falls back to recompute (step.free)")
        return ("for each victim: remove it from step.running, then step.swap_out(victim) or "
                "step.free(victim), then put it at the front of step.swapped or step.waiting")
    (_, lib_v), (_, mine) = lib, got
    by_id = {r.rid: r for r in st.running}
    for a, b in zip([v[:3] for v in lib_v], [v[:3] for v in mine], strict=False):
        if a == b:
            continue
        if a[0] != b[0]:
            me, asker = by_id.get(b[0]), by_id[st.rid]
            if me is not None and me.ran:
                return ("a group that already ran this step cannot be preempted (its tokens "
                        "are scheduled): only the group asking and those after it that have "
                        "not run yet")
            order = [r.rid for r in st.running]
            if b[0] in order and order.index(b[0]) < order.index(asker.rid):
                return ("never preempt a group admitted before the one asking, even one "
                        "that has not run yet this step: first come, first served")
            if a[1] == "freed" and b[1] == "swapped out":
                return (f"the engine's rule chose request {a[0]}, which cannot be swapped "
                        "(its K/V is not all there, or the CPU pool cannot take it all): it "
                        "is still the victim, recomputed; the loop does not pass it over "
                        "for a group that could be swapped")
            if st.rule is not None:
                return ("ask step.hooks.choose_victim for the victim: the engine's rule may be "
                        "another one (here it takes " + st.rule + "); offer it group and the "
                        "groups after it that have not run, oldest first")
            return ("the latest admitted goes first (vLLM pops its running queue from the "
                    "end): it has done the least, and the group asking may be the victim "
                    "itself")
        if a[1] == b[1] == "freed" and a[2] != b[2]:
            return (f"request {a[0]}'s blocks were freed, not copied: nothing of it waits on "
                    "the CPU to be swapped back in; it is prefilled again from its text, from "
                    "step.waiting, whatever the preemption mode")
        if a[1] == "freed" and not by_id[a[0]].decoding:
            return ("a group part way through a prefill cannot be swapped (its K/V is not "
                    "all written): it is recomputed instead")
        if a[1] == "freed" and st.mode == "swap":
            return ("the CPU pool cannot take every block of the victim: swap falls back "
                    "to recompute (step.can_swap_out)")
        if a[1] == "freed":
            return "preemption 'recompute' frees the victim's blocks (step.free)"
        return "preemption 'swap' copies a decoding victim to the CPU pool (step.swap_out)"
    if len(mine) < len(lib_v):
        return ("keep preempting until the group's blocks fit: one victim may free too few "
                "(a group shares blocks, or holds few)")
    if len(mine) > len(lib_v):
        return ("stop as soon as the blocks fit (step.blocks_needed <= step.free_blocks): "
                "preempt nobody more, and nobody at all when they already fit")
    if mine != lib_v:
        queue = next(a for a, b in zip(lib_v, mine, strict=False) if a != b)[2]
        if queue == "swapped":
            return ("a victim swapped out goes to the FRONT of step.swapped (appendleft): "
                    "swapped groups come back from the front, and victims leave latest "
                    "first, so each one put in front keeps the earliest admitted first")
        return ("a victim goes back to the FRONT of its queue (appendleft): it was admitted "
                "before every group waiting, and comes back first")
    return ("answer True when the group's blocks fit and it runs now, False when it was "
            "preempted itself")


loops.LOOPS["preempt_until_fits"] = (_snapshot, _decide, _describe, _show, _why)


def oldest_first(running: list) -> Any:
    """the oldest admitted first (the group asking)"""
    return running[0]


#: scenarios served by the scheduler alone: requests (prompt, max_tokens, arrival, n)
SCENARIOS: list[Scenario] = [
    Scenario("four requests admitted in one step on a pool for two (recompute)",
             dict(num_blocks=12, block_size=4), ((8, 16, 0, 1),) * 4),
    Scenario("the same, by swap",
             dict(num_blocks=12, block_size=4, preemption="swap", num_cpu_blocks=64),
             ((8, 16, 0, 1),) * 4),
    Scenario("groups of 3 and 2 samples: one victim frees too few (recompute)",
             dict(num_blocks=14, block_size=2),
             ((3, 9, 0, 3), (5, 8, 1, 1), (2, 8, 1, 2), (4, 6, 2, 1))),
    Scenario("samples by swap, a CPU pool of 5 blocks: a victim that does not fit",
             dict(num_blocks=12, block_size=2, preemption="swap", num_cpu_blocks=5),
             ((4, 10, 0, 2), (3, 9, 0, 1), (6, 7, 1, 1), (2, 9, 2, 2))),
    Scenario("samples recomputed in two phases: groups that already ran are not offered",
             dict(num_blocks=9, block_size=2),
             ((2, 9, 3, 2), (5, 12, 0, 1), (6, 3, 2, 2), (3, 6, 3, 1))),
    Scenario("samples recomputed by chunks of 6, admitted before a decoding group that "
             "needs a block; the engine's choose_victim the oldest first",
             dict(num_blocks=6, block_size=2, preemption="swap", num_cpu_blocks=4,
                  enable_chunked_prefill=True, max_num_batched_tokens=6, max_num_seqs=4),
             ((2, 6, 3, 1), (8, 10, 1, 2), (9, 10, 4, 1)),
             hooks=(("choose_victim", oldest_first),)),
    Scenario("by swap, a CPU pool of 4 blocks: the latest admitted holds 5, the one before "
             "it 2", dict(num_blocks=12, block_size=4, preemption="swap", num_cpu_blocks=4),
             ((18, 10, 3, 1), (17, 8, 4, 1), (18, 5, 2, 1), (5, 12, 2, 1))),
]


def check_preempt_until_fits(preempt_until_fits: Callable[..., Any]) -> None:
    """``preempt_until_fits(group, step) -> bool``."""
    with grading.exercise("07.3"):
        loops.run_scheduler("preempt_until_fits", preempt_until_fits, SCENARIOS)
        generated.check("preempt_until_fits", preempt_until_fits, "ask choose_victim among "
                        "the group and those admitted after it that have not run, one victim "
                        "at a time, until the blocks fit or the group itself is preempted")
