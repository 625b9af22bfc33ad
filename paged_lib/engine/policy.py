"""Scheduling policy: the small decisions a chapter's exercise may replace (pure Python).

:func:`can_admit` says whether a waiting group may join this step, given the
:class:`Budget` left; :func:`choose_victim` which running group leaves when the pool
runs out. vLLM keeps its queue policies in ``vllm/core/policy.py`` too.
"""

from __future__ import annotations

from dataclasses import dataclass

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
