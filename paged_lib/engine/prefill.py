"""How much of each running sequence's text a step computes (pure Python).

As in vLLM v1, a sequence is two numbers: ``num_tokens`` (its text) and ``num_cached``
(the leading tokens whose K/V is written). A decode is the case where they differ by
one; a prefill, a chunk of a prompt, or a text recomputed after a preemption are the
cases where they differ by more. One rule covers them all (:func:`tokens_to_run`), under
the step's token budget.

Chunked prefill (chapter 10, ``LLMEngine(..., enable_chunked_prefill=True)``): a waiting
request whose text needs more tokens than the step has left is admitted anyway, with the
blocks of its first chunk only; each later step appends the blocks of its next chunk
(preempting the latest admitted, or itself, when the pool is short), after the running
decodes. Nothing is sampled until the last chunk, so the tokens are those of a prefill
in one go.
"""

from __future__ import annotations

from paged_lib.engine.sequence import SequenceGroup


def is_decoding(group: SequenceGroup) -> bool:
    """Does every live sequence of ``group`` feed exactly its last sampled token?"""
    return not group.awaiting_tails and all(
        s.output_token_ids and s.num_tokens - s.num_cached == 1 for s in group.live_seqs())


def tokens_to_run(group: SequenceGroup, left: int) -> tuple[list[int], bool]:
    """How many new tokens each live sequence of a running ``group`` computes this step,
    with ``left`` tokens of budget; and whether the group samples.

    The group samples only when every sequence computes all it has left (so a group of
    several sequences draws together, as if it had never been preempted). Otherwise each
    sequence computes as much as the budget allows but holds back its last token.
    The first phase of a shared recompute (``awaiting_tails``) runs the first sequence's
    prompt only. Example: remaining ``[1, 1]`` with 5 left -> ``([1, 1], True)``;
    ``[6, 4]`` with 5 left -> ``([5, 0], False)``; ``[6, 4]`` with 12 left -> all, True.
    """
    seqs = group.live_seqs()
    if group.awaiting_tails:
        rest = len(group.prompt_token_ids) - seqs[0].num_cached
        return [min(rest, left)] + [0] * (len(seqs) - 1), False
    remaining = [s.num_tokens - s.num_cached for s in seqs]
    if sum(remaining) <= left:
        return remaining, True
    take = []
    for r in remaining:
        take.append(max(0, min(r - 1, left)))
        left -= take[-1]
    return take, False
