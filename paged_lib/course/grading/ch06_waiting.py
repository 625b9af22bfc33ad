"""Chapter 06's exercise 06.4, ``schedule_waiting`` (re-exported by
:mod:`paged_lib.course.grading.ch06`).

The learner's loop is plugged into the engine (:mod:`~paged_lib.course.grading.scheduler_loops`):
first on edge scenarios served by the scheduler alone (ties after an empty queue, the token
budget and the watermark met exactly, a group alone in an empty step, ``n > 1`` against
``max_num_seqs`` and head-of-line blocking, swapped groups, chunks, a preempting step, a
group back with a finished sample, ``prefill_first``), then on the replay workloads with
the tiny model, then on random workloads (:mod:`~paged_lib.course.grading.generated`).
Every call must admit the same groups with the same tokens as the library's
:func:`paged_lib.engine.policy.schedule_waiting`; the first that does not is told with its
state, and the hint names the rule that state exposes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from paged_lib.course import grading
from paged_lib.course.grading import generated
from paged_lib.course.grading import scheduler_loops as loops
from paged_lib.course.grading.scheduler_loops import Scenario
from paged_lib.engine.policy import seqs_to_come


class Head(NamedTuple):
    rid: int
    seqs: int     # sequences it brings
    n: int        # its params.num_seqs (samples or beams)
    tokens: int   # its first prefill's tokens, cache hits left out
    chunk: int    # what it would bring now (tokens, or what the budget leaves)
    need: int     # free blocks that takes


class WaitState(NamedTuple):
    heads: tuple
    num_waiting: int
    free: int
    watermark: int
    tokens_left: int
    max_tokens: int
    num_seqs: int
    max_num_seqs: int
    swapped: int
    preempted: int
    empty: bool
    running: int
    chunked: bool
    prefill_first: bool


def _snapshot(waiting, step) -> WaitState:
    heads = []
    for g in list(waiting)[:4]:
        tokens = step.prefill_tokens(g)
        chunk = min(tokens, step.tokens_left) if step.chunked_prefill else tokens
        heads.append(Head(g.request_id, seqs_to_come(g), g.params.num_seqs, tokens, chunk,
                          step.blocks_needed(g, chunk) if chunk > 0 else 0))
    return WaitState(tuple(heads), len(waiting), step.free_blocks, step.watermark_blocks,
                     step.tokens_left, step.max_num_batched_tokens, step.num_seqs,
                     step.max_num_seqs, len(step.swapped), step.num_preempted,
                     step.is_empty(), len(step.running), step.chunked_prefill,
                     step.prefill_first)


def _decide(args, before, result) -> tuple:
    step = args[1]
    return tuple((g.request_id, step.tokens_scheduled(g)) for g in step.admitted[before[0]:])


def _describe(st: WaitState) -> str:
    if not st.heads:
        queue = "nobody waiting"
    else:
        queue = "waiting " + ", ".join(
            f"request {h.rid} ("
            + (f"{h.seqs} of its {h.n} sequences live, {h.n - h.seqs} finished"
               if h.seqs < h.n else f"{h.seqs} sequence(s)")
            + f", {h.tokens} tokens to prefill"
            + (f", {h.chunk} of them now" if h.chunk != h.tokens else "")
            + f", {h.need} blocks)" for h in st.heads) + (
            f" and {st.num_waiting - len(st.heads)} more" if st.num_waiting > len(st.heads)
            else "")
    parts = [queue, f"{st.free} free blocks (watermark {st.watermark})",
             f"{st.tokens_left} of {st.max_tokens} tokens left",
             f"{st.num_seqs} of {st.max_num_seqs} sequences running",
             f"{st.swapped} group(s) swapped out" if st.swapped else "nothing swapped out",
             f"{st.preempted} group(s) preempted this step" if st.preempted else
             "nobody preempted this step",
             "nothing scheduled yet" if st.empty else "others already scheduled"]
    if st.chunked:
        parts.append("chunked prefill on")
    if st.prefill_first:
        parts.append(f"prefill_first, {st.running} group(s) running")
    return "; ".join(parts)


def _show(decision) -> str:
    if not decision:
        return "admits nobody"
    return "admits " + ", ".join(f"request {r} ({t} tokens)" for r, t in decision)


def _why(st: WaitState, lib, got) -> str:
    if isinstance(got, Exception):
        if "admit(" in str(got):
            return ("step.admit(group, num_tokens) takes the group out of waiting itself: "
                    "call it for the head of waiting, with 1 to step.prefill_tokens(group) "
                    "tokens")
        return "the state above is the one your code met: follow it by hand"
    i = next((k for k, (a, b) in enumerate(zip(lib, got, strict=False)) if a != b),
             min(len(lib), len(got)))
    free, left, seqs = st.free, st.tokens_left, st.num_seqs
    for h in st.heads[:i]:
        free, left, seqs = free - h.need, left - h.chunk, seqs + h.seqs
    head = st.heads[i] if i < len(st.heads) else None
    if len(got) > len(lib) and i == len(lib):
        if st.swapped:
            return ("groups are swapped out: they come back first, and nobody new is "
                    "admitted while any is swapped (their blocks would be taken)")
        if st.preempted:
            return ("this step preempted a group: as in vLLM v1, a step that preempts "
                    "admits nobody (the victim would be readmitted at once)")
        if head is not None and got[i][0] != head.rid:
            return ("head-of-line blocking: the first waiting group that does not fit stops "
                    "admission; nobody behind it may overtake it (first come, first served)")
        if head is not None:
            alone = st.empty and i == 0
            if st.chunked and left < 1:
                return "no token of the budget is left: nobody more joins this step"
            if head.need > free:
                return "its blocks are not free: a group never joins without its blocks"
            if alone and st.prefill_first and st.running:
                return ("prefill_first: a group is alone only if nobody is running either "
                        "(the running groups decode next step and need the watermark)")
            if free - head.need < st.watermark and not alone:
                return ("the watermark: after its blocks at least watermark_blocks must stay "
                        "free, unless it would be alone in an empty step")
            if seqs + head.seqs > st.max_num_seqs:
                return ("max_num_seqs: a group brings all its sequences, a fresh n > 1 "
                        "group (samples or beams) its n, and the running ones count too")
            if head.chunk > left:
                return ("the token budget: the running groups' tokens come first; a group "
                        "joins only if its tokens fit what is left")
    if len(lib) > len(got) and i == len(got) and head is not None:
        if head.seqs < head.n and seqs + head.seqs <= st.max_num_seqs < seqs + head.n:
            return ("a group that has sampled brings only its live sequences "
                    "(group.live_seqs()), not params.num_seqs: a sample that finished is gone, "
                    "and a group preempted by recompute comes back without it")
        if st.chunked and lib[i][1] < head.tokens:
            return ("with chunked prefill the head joins with what the budget leaves of its "
                    "prefill (a first chunk of min(tokens, step.tokens_left))")
        if st.chunked and head.chunk == 1 and left >= 1:
            return ("one token left, or one to prefill, is still a chunk: with chunked "
                    "prefill admission stops only when no token is left")
        if st.empty and i == 0 and head.need <= free and head.chunk <= left \
                and (not st.prefill_first or not st.running):
            return ("a group alone in an empty step joins when its blocks are free, even "
                    "into the watermark: otherwise a long request could wait forever")
        if free - head.need == st.watermark:
            return "leaving exactly watermark_blocks free is allowed (>=)"
        if head.chunk == left:
            return "reaching max_num_batched_tokens exactly is allowed (<=)"
        if seqs + head.seqs == st.max_num_seqs:
            return "reaching max_num_seqs exactly is allowed (<=)"
        return ("keep admitting while the head fits: each admitted group is followed by the "
                "next one, first come first served")
    if i < len(lib) and i < len(got) and lib[i][0] == got[i][0]:
        return ("the tokens it brings: its whole first prefill (step.prefill_tokens), or with "
                "chunked prefill what the budget leaves of it")
    if i < len(lib) and i < len(got):
        return "first come, first served: the head of waiting is considered first"
    return ("admission: the head first, while its blocks leave the watermark free and its "
            "sequences and tokens fit the step")


loops.LOOPS["schedule_waiting"] = (_snapshot, _decide, _describe, _show, _why)


#: scenarios served by the scheduler alone: requests (prompt, max_tokens, arrival, n)
SCENARIOS: list[Scenario] = [
    Scenario("nobody waiting, then four requests arriving together (ties)",
             dict(num_blocks=40, block_size=4, max_num_batched_tokens=64, max_num_seqs=8),
             ((9, 4, 2, 1), (7, 4, 2, 1), (12, 4, 2, 1), (5, 4, 2, 1))),
    Scenario("the token budget met exactly (16 tokens: prompts of 10 and 6, then 5)",
             dict(num_blocks=40, block_size=4, max_num_batched_tokens=16, max_num_seqs=4),
             ((10, 5, 0, 1), (6, 5, 0, 1), (5, 5, 0, 1), (11, 3, 1, 1))),
    Scenario("the watermark met exactly (10 blocks, watermark 2)",
             dict(num_blocks=10, block_size=4, watermark_blocks=2),
             ((12, 2, 0, 1), (20, 2, 0, 1), (4, 2, 0, 1), (3, 2, 1, 1))),
    Scenario("a long request alone in an empty step, into the watermark, one taking all",
             dict(num_blocks=8, block_size=4, watermark_blocks=2),
             ((27, 2, 0, 1), (4, 3, 1, 1), (9, 2, 1, 1), (32, 1, 12, 1))),
    Scenario("samples against max_num_seqs 4 (n=3, n=2, then one behind)",
             dict(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=64),
             ((5, 3, 0, 3), (5, 3, 0, 2), (4, 3, 0, 1), (6, 2, 1, 1))),
    Scenario("swap: nobody is admitted while a group is swapped out",
             dict(num_blocks=7, block_size=4, preemption="swap", num_cpu_blocks=16),
             ((8, 12, 0, 1), (6, 10, 1, 1), (2, 3, 4, 1), (3, 3, 6, 1))),
    Scenario("chunked prefill, 8 tokens a step: first chunks of what the budget leaves",
             dict(num_blocks=30, block_size=4, enable_chunked_prefill=True,
                  max_num_batched_tokens=8, max_num_seqs=4),
             ((20, 4, 0, 1), (5, 4, 0, 1), (3, 3, 1, 1), (9, 2, 2, 2))),
    Scenario("chunks of 4: three decodes leave one token, a first chunk of 1",
             dict(num_blocks=30, block_size=4, enable_chunked_prefill=True,
                  max_num_batched_tokens=4, max_num_seqs=4),
             ((1, 5, 0, 1), (1, 5, 0, 1), (1, 5, 0, 1), (5, 3, 1, 1))),
    Scenario("chunks of 8 on 7 blocks: a step that preempts admits nobody, not its victim",
             dict(num_blocks=7, block_size=4, enable_chunked_prefill=True,
                  max_num_batched_tokens=8, max_num_seqs=4),
             ((9, 5, 0, 1), (10, 8, 0, 1), (10, 13, 1, 1))),
    Scenario("chunks of 6, recompute: 3 samples, one finished at once, back against "
             "max_num_seqs 4",
             dict(num_blocks=8, block_size=4, enable_chunked_prefill=True,
                  max_num_batched_tokens=6, max_num_seqs=4),
             ((3, 10, 2, 1), (9, 14, 0, 1), (7, 5, 0, 3, 4))),
    Scenario("prefill_first: alone means nobody running either (watermark 2)",
             dict(num_blocks=9, block_size=4, watermark_blocks=2, scheduling="prefill_first"),
             ((12, 4, 0, 1), (14, 3, 1, 1), (20, 2, 2, 1))),
]


def check_schedule_waiting(schedule_waiting: Callable[..., Any]) -> None:
    """``schedule_waiting(waiting, step) -> None`` (admits with ``step.admit``)."""
    with grading.exercise("06.4"):
        loops.run_scheduler("schedule_waiting", schedule_waiting, SCENARIOS)
        generated.check("schedule_waiting", schedule_waiting, "admission: the head first, "
                        "while can_admit lets it in (or it is alone in an empty step), "
                        "nobody while groups are swapped out or after a preemption")
