"""Chunked prefill (chapter 10): a prompt computed over several steps (pure Python).

With ``LLMEngine(..., enable_chunked_prefill=True)`` a waiting request whose text needs
more tokens than the step has left in its ``max_num_batched_tokens`` budget is admitted
anyway: its table takes the blocks of its whole text at once (so a later chunk never
runs out of blocks half way) and each step computes the next chunk, after the running
decodes, attending to the chunks before it through the cache. Nothing is sampled until
the last chunk, so the tokens are those of a prefill in one go (vLLM v1 schedules the
same way: decodes first, then chunks, within one token budget).

A chunked prefill preempted half way is recomputed (never swapped: its table holds
tokens not computed yet). A group of several sequences coming back from a recompute
prefills its prompt, then its tails, each whole (no chunks), as without chunking.
"""

from __future__ import annotations

from paged_lib.blocks import Slot
from paged_lib.engine.sequence import Sequence, SequenceGroup


def is_prefilling(group: SequenceGroup) -> bool:
    """Is ``group`` part way through a chunked prefill? Its one sequence's table holds
    its whole text, but fewer of its tokens have K/V written (``num_cached``)."""
    if group.awaiting_tails:
        return False
    seqs = group.live_seqs()
    return (len(seqs) == 1 and seqs[0].block_table is not None
            and seqs[0].block_table.num_tokens > seqs[0].num_cached)


def chunk_slots(seq: Sequence, start: int, stop: int) -> list[Slot]:
    """The slots of tokens ``start..stop-1`` in ``seq``'s table, which already holds
    them (blocks taken at admission, none shared: no copy-on-write)."""
    blocks, bs = seq.block_table.blocks, seq.block_table.block_size
    return [Slot(blocks[t // bs], t % bs) for t in range(start, stop)]
