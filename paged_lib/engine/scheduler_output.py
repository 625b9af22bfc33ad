"""What the scheduler decided for one step: the model runner's whole input (pure Python).

Like vLLM's ``SchedulerOutput``: the sequences to run with their new tokens' slots, and
the block copies (copy-on-write) and swaps to do before the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_lib.blocks import Slot
from paged_lib.engine.sequence import Sequence, SequenceGroup


@dataclass
class ScheduledSeq:
    """One sequence in this step: it feeds ``num_new_tokens`` tokens written at ``slots``."""

    group: SequenceGroup
    seq: Sequence
    num_new_tokens: int
    slots: list[Slot]
    is_prefill: bool
    sample: bool = True  # False: the prompt of a shared recompute, nothing drawn from it


@dataclass
class SchedulerOutput:
    """Everything the model runner needs for one step, and what the scheduler did."""

    step: int
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # GPU src -> dst
    swap_out: list[tuple[int, int]] = field(default_factory=list)        # GPU -> CPU
    swap_in: list[tuple[int, int]] = field(default_factory=list)         # CPU -> GPU
    preempted: list[SequenceGroup] = field(default_factory=list)
    admitted: list[SequenceGroup] = field(default_factory=list)
    recomputed_tokens: int = 0
    prefix_cache_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache

    @property
    def kind(self) -> str:
        """``"prefill"``, ``"decode"``, ``"mixed"`` when the step runs both, or ``"idle"``
        when it runs nothing (it only preempted: its victims run again from the next)."""
        if not self.scheduled:
            return "idle"
        prefills = sum(s.is_prefill for s in self.scheduled)
        if prefills and prefills < len(self.scheduled):
            return "mixed"
        return "prefill" if prefills else "decode"

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def is_empty(self) -> bool:
        return not self.scheduled
