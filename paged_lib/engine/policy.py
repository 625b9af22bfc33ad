"""Scheduling policy: the decisions a chapter's exercise may replace (pure Python).

:func:`can_admit` says whether a waiting group may join this step, given the
:class:`Budget` left; :func:`choose_victim` which running group leaves when the pool
runs out. The two loops around them are here too: :func:`schedule_waiting` admits
waiting groups (chapter 06), :func:`preempt_until_fits` preempts until a running group's
blocks fit (chapter 07); the scheduler hands them a step
(:mod:`~paged_lib.engine.scheduler_step`) that does the block work. vLLM keeps its queue
policies in ``vllm/core/policy.py``, and both loops in ``vllm/v1/core/sched/scheduler.py``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from paged_lib.engine.sequence import SequenceGroup


@dataclass(frozen=True)
class Budget:
    """What is left for the step when the scheduler considers the next waiting group."""

    free_blocks: int             # free GPU blocks now
    watermark_blocks: int        # blocks admission must leave free (room for decodes)
    num_seqs: int                # sequences already scheduled this step
    max_num_seqs: int
    num_batched_tokens: int      # tokens already scheduled this step
    max_num_batched_tokens: int


def can_admit(blocks_needed: int, num_seqs: int, num_tokens: int, budget: Budget) -> bool:
    """May a waiting group that needs ``blocks_needed`` free blocks for its ``num_seqs``
    sequences and ``num_tokens`` prompt tokens join this step?

    Yes when, after taking its blocks, at least ``watermark_blocks`` stay free, and
    neither the sequence count nor the token count of the step goes over its maximum.
    Example: 10 free, watermark 1, needs 9 -> True; needs 10 -> False.
    """
    return (budget.free_blocks - blocks_needed >= budget.watermark_blocks
            and budget.num_seqs + num_seqs <= budget.max_num_seqs
            and budget.num_batched_tokens + num_tokens <= budget.max_num_batched_tokens)


def choose_victim(running: list[SequenceGroup]) -> SequenceGroup:
    """Which group to preempt when a running group cannot get its next blocks.

    ``running`` lists the groups that may still be preempted this step, oldest admitted
    first: the group that needs blocks, then those admitted after it (groups that
    already ran this step are not offered). The default takes the most recently
    admitted, as vLLM does (``running_queue.pop()``): it has made the least progress,
    so the least work is lost or moved. Example: ``[A, B, C] -> C``; ``[A] -> A``.
    """
    return running[-1]


def seqs_to_come(group: SequenceGroup) -> int:
    """Sequences a group decodes: its live ones, or ``n`` (``params.num_seqs``: samples
    or beams) before it first samples."""
    if any(s.output_token_ids for s in group.seqs):
        return len(group.live_seqs())
    return max(len(group.live_seqs()), group.params.num_seqs)


def schedule_waiting(waiting: deque[SequenceGroup], step: Any) -> None:
    """Admit waiting groups into this step, first come first served (``step.admit``;
    ``step`` is a :class:`~paged_lib.engine.scheduler_step.WaitingStep`).

    Nobody joins while groups are swapped out (they come back first) or in a step that
    preempted (vLLM v1: a victim is not readmitted in the step that evicted it). The head
    of ``waiting`` joins when ``can_admit`` says its blocks leave the watermark free and
    its sequences (``n`` for a fresh ``n > 1`` group) and tokens fit the step; with
    chunked prefill it brings what the budget leaves of its prefill (a first chunk), and
    nothing when no token is left. The first group that does not fit stops admission
    (head-of-line: nobody behind it is considered). One exception keeps every request
    moving: a group alone in an empty step (``prefill_first``: with nobody running
    either) joins if its blocks are free, even into the watermark.
    """
    if step.swapped or step.num_preempted:
        return
    while waiting:
        group = waiting[0]
        tokens = step.prefill_tokens(group)
        if step.chunked_prefill:
            tokens = min(tokens, step.tokens_left)
            if tokens < 1:
                return
        need = step.blocks_needed(group, tokens)
        fits = step.hooks.can_admit(need, seqs_to_come(group), tokens, step.budget())
        alone = (step.is_empty() and (not step.prefill_first or not step.running)
                 and need <= step.free_blocks and tokens <= step.tokens_left)
        if not (fits or alone):
            return
        step.admit(group, tokens)


def preempt_until_fits(group: SequenceGroup, step: Any) -> bool:
    """Preempt running groups until ``group`` gets its ``step.blocks_needed`` blocks;
    True if it may run now, False if it was preempted itself (``step`` is a
    :class:`~paged_lib.engine.scheduler_step.RunningStep`).

    Victims are asked of ``choose_victim`` among ``group`` and the groups admitted after
    it that have not run this step, one at a time, all of a group or nothing. ``swap``
    copies the victim to the CPU pool and puts it at the front of ``swapped``; it falls
    back to recompute when the CPU pool cannot take it or the victim is part way through
    a prefill. ``recompute`` frees its blocks and puts it at the front of ``waiting``.
    """
    while step.blocks_needed > step.free_blocks:
        later = step.running[step.running.index(group) + 1:]
        candidates = [group, *[g for g in later if not step.ran(g)]]
        victim = step.hooks.choose_victim(list(candidates))
        if not any(victim is g for g in candidates):
            ids = [g.request_id for g in candidates]
            got = getattr(victim, "request_id", victim)
            raise ValueError(f"choose_victim returned {got!r}, which is not one of the "
                             f"groups it may preempt now (requests {ids}, oldest first): "
                             "return one of the list it was given")
        preempt(victim, step)
        if victim is group:
            return False
    return True


def preempt(victim: SequenceGroup, step: Any) -> None:
    """Take ``victim`` out of ``running``, all of it: swapped to the front of ``swapped``,
    or (recompute, a prefill part way, a CPU pool too full) freed to the front of
    ``waiting``."""
    step.running.remove(victim)
    if step.preemption == "swap" and step.is_decoding(victim) and step.can_swap_out(victim):
        step.swap_out(victim)
        step.swapped.appendleft(victim)
    else:
        step.free(victim)
        step.waiting.appendleft(victim)
