"""One step's input to the model runner: flat, picklable, built once on the scheduler's side.

The scheduler decides in terms of sequences and block tables (:class:`SchedulerOutput`);
the model runner, on this process or on every tensor-parallel rank, needs only lists of
numbers: the new tokens, each sequence's block table and lengths, the block copies and
swaps to do first, and the sliding window's K/V edits (chapter 11). :func:`model_input`
turns the one into the other, so the runner never reads a scheduler object (as vLLM
sends its workers a ``SchedulerOutput`` of plain data).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_lib.engine.scheduler_output import SchedulerOutput


@dataclass
class ModelInput:
    """What the model runner computes in one step; ``block_tables[s]``, ``seq_lens[s]`` and
    ``query_lens[s]`` describe scheduled sequence ``s`` (its K/V length once this step's
    ``query_lens[s]`` new tokens, the next ``query_lens[s]`` of ``input_ids``, are written)."""

    input_ids: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # GPU src -> dst
    swap_out: list[tuple[int, int]] = field(default_factory=list)        # GPU -> CPU
    swap_in: list[tuple[int, int]] = field(default_factory=list)         # CPU -> GPU
    window_ops: list = field(default_factory=list)  # chapter 11: window.WindowOp, in order

    def is_empty(self) -> bool:
        return not self.seq_lens


def model_input(out: SchedulerOutput, window=None) -> ModelInput:
    """The runner's input for the step ``out`` decided. ``window`` (the engine's
    :class:`~paged_lib.engine.window.SlidingWindow`, chapter 11) gives the lengths of the
    kept K/V and hands over its pending edits."""
    inp = ModelInput(blocks_to_copy=list(out.blocks_to_copy), swap_out=list(out.swap_out),
                     swap_in=list(out.swap_in))
    for s in out.scheduled:
        end = s.seq.num_cached + s.num_new_tokens  # the text's tokens with K/V after it
        inp.input_ids += s.seq.token_ids[end - s.num_new_tokens:end]
        inp.block_tables.append(list(s.seq.block_table.blocks))
        inp.seq_lens.append(end if window is None else window.cache_len(s.seq, end))
        inp.query_lens.append(s.num_new_tokens)
    if window is not None:
        inp.window_ops, window.pending = window.pending, []
    return inp
