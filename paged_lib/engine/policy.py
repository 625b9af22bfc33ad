"""Scheduling policy: the small decisions a chapter's exercise may replace (pure Python).

:func:`can_admit` says whether a waiting group may join this step, given the
:class:`Budget` left. vLLM keeps its queue policies in ``vllm/core/policy.py`` too.
"""

from __future__ import annotations

from dataclasses import dataclass


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
