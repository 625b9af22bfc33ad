"""What the scheduler hands its two loop hooks: the step's state and the actions on it.

:class:`WaitingStep` goes to ``schedule_waiting(waiting, step)`` (who joins this step,
chapter 06); :class:`RunningStep` to ``preempt_until_fits(group, step)`` (who leaves so a
running group gets its blocks, chapter 07). Each reads the step as it is now (free
blocks, tokens left, what ran, what was preempted) and does the block work the
library keeps for itself (allocating, freeing, copying to the CPU pool); the decisions
(who, in what order, until when, which queue) are the hook's. The library's own hooks
are :func:`paged_lib.engine.policy.schedule_waiting` and
:func:`paged_lib.engine.policy.preempt_until_fits`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from paged_lib.engine.policy import Budget, seqs_to_come
from paged_lib.engine.prefill import is_decoding
from paged_lib.engine.sequence import SequenceGroup, SequenceStatus
from paged_lib.util import cdiv

_MAX_READS = 100_000


class _Step:
    """What both steps show: the scheduler's queues and the step's free blocks and tokens
    (``sched``: the :class:`~paged_lib.engine.scheduler.Scheduler`; ``out``: this step's
    :class:`~paged_lib.engine.scheduler_output.SchedulerOutput`)."""

    def __init__(self, sched: Any, out: Any):
        self._sched, self._out = sched, out
        #: the engine's hooks (the library's pieces, or yours in chapter 13)
        self.hooks = sched.hooks
        self.running: list[SequenceGroup] = sched.running
        self.waiting: deque[SequenceGroup] = sched.waiting
        self.swapped: deque[SequenceGroup] = sched.swapped
        self._reads = 0

    def _tick(self) -> None:
        # a hook's loop that never ends (nothing admitted or freed, asked again and
        # again) is told as an error instead of hanging the engine
        self._reads += 1
        if self._reads > _MAX_READS:
            raise RuntimeError(f"the step was read {_MAX_READS} times in one call and "
                               "nothing ended the loop: does it stop when the head does not "
                               "fit, or when the blocks fit?")

    @property
    def free_blocks(self) -> int:
        """Free GPU blocks now."""
        self._tick()
        return self._sched.block_manager.num_free_blocks

    @property
    def tokens_left(self) -> int:
        """Tokens this step may still compute (``max_num_batched_tokens`` less those
        scheduled so far: the running decodes and prefills come first)."""
        return self._sched.max_num_batched_tokens - self._out.num_batched_tokens

    @property
    def num_preempted(self) -> int:
        """Groups preempted so far this step."""
        return len(self._out.preempted)

    def is_empty(self) -> bool:
        """Nothing scheduled yet this step."""
        return self._out.is_empty()

    @property
    def admitted(self) -> tuple[SequenceGroup, ...]:
        """Groups admitted so far this step, in order (a copy)."""
        return tuple(self._out.admitted)

    @property
    def preempted(self) -> tuple[SequenceGroup, ...]:
        """Groups preempted so far this step, in order (a copy)."""
        return tuple(self._out.preempted)

    def tokens_scheduled(self, group: SequenceGroup) -> int:
        """Tokens scheduled for ``group``'s sequences so far this step (0: none)."""
        return sum(s.num_new_tokens for s in self._out.scheduled if s.group is group)

    @property
    def cpu_free_blocks(self) -> int | None:
        """Free blocks in the CPU pool now; ``None`` when the engine has no CPU pool."""
        cpu = self._sched.block_manager.cpu
        return None if cpu is None else cpu.num_free


class WaitingStep(_Step):
    """The step as ``schedule_waiting`` sees it (the hook's docstring says what it is for)."""

    def __init__(self, sched: Any, out: Any):
        super().__init__(sched, out)
        self.watermark_blocks: int = sched.watermark_blocks
        self.max_num_seqs: int = sched.max_num_seqs
        self.max_num_batched_tokens: int = sched.max_num_batched_tokens
        self.chunked_prefill: bool = sched.enable_chunked_prefill
        self.prefill_first: bool = sched.scheduling == "prefill_first"

    @property
    def num_seqs(self) -> int:
        """Sequences the running groups decode (a fresh ``n > 1`` group counts ``n``)."""
        return sum(seqs_to_come(g) for g in self.running)

    def budget(self) -> Budget:
        """What is left, as ``can_admit`` takes it."""
        return Budget(self.free_blocks, self.watermark_blocks, self.num_seqs,
                      self.max_num_seqs, self._out.num_batched_tokens,
                      self.max_num_batched_tokens)

    def _text(self, group: SequenceGroup) -> list[int]:
        # the first phase: one sequence's text, or a shared recompute's prompt
        seqs = group.live_seqs()
        return seqs[0].token_ids if len(seqs) == 1 else group.prompt_token_ids

    def _hits(self, group: SequenceGroup) -> list[int]:
        return self._sched.block_manager.cache_hits(self._text(group))

    def prefill_tokens(self, group: SequenceGroup) -> int:
        """Tokens ``group``'s first prefill computes: its text (a group of several
        sequences preempted by recompute: its prompt, the tails follow later) less the
        leading tokens the prefix cache already holds."""
        self._tick()
        bs = self._sched.block_manager.block_size
        return len(self._text(group)) - len(self._hits(group)) * bs

    def blocks_needed(self, group: SequenceGroup, num_tokens: int) -> int:
        """Free blocks admitting ``group`` with ``num_tokens`` of its
        :meth:`prefill_tokens` takes: the whole group's (``num_required_blocks``) when
        that is all of them, the blocks of a first chunk only when fewer; cached blocks
        adopted are not counted, unless they are taken out of the free queue."""
        bm = self._sched.block_manager
        text, hits = self._text(group), self._hits(group)
        start = len(hits) * bm.block_size
        if start + num_tokens < len(text):  # a first chunk: only its blocks are asked for
            need = cdiv(start + num_tokens, bm.block_size) - len(hits)
        else:
            need = self._sched._required_blocks(group) - len(hits)
        return need + bm.hits_taken_from_free(hits)

    def admit(self, group: SequenceGroup, num_tokens: int) -> None:
        """Take ``group`` out of ``waiting``, give it its blocks and schedule the first
        ``num_tokens`` of its :meth:`prefill_tokens` (all of them: its group samples
        this step; fewer: a first chunk) in this step; it joins the end of ``running``."""
        sched, bm, out = self._sched, self._sched.block_manager, self._out
        left = self.prefill_tokens(group)
        if group not in self.waiting or not 1 <= num_tokens <= left:
            why = "it is not waiting" if group not in self.waiting else \
                f"its first prefill has {left} tokens to compute"
            raise ValueError(f"admit(request {group.request_id}, {num_tokens}): {why}")
        need, text, hits = self.blocks_needed(group, num_tokens), self._text(group), \
            self._hits(group)
        start = len(hits) * bm.block_size
        self.waiting.remove(group)
        bm.check_allocation_fits(group.request_id, need, start + num_tokens, hits)
        out.prefix_cache_hit_tokens += start
        seqs = group.live_seqs()
        slots = bm.allocate(seqs[0], start + num_tokens, hits)
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
        group.awaiting_tails = len(seqs) > 1  # the others fork once the prompt is in
        sample = len(seqs) == 1 and start + num_tokens == len(text)
        sched._add_scheduled(group, seqs[0], slots, True, sample, out)
        self.running.append(group)
        out.admitted.append(group)
        group.timeline.admitted_steps.append(sched.step)


class RunningStep(_Step):
    """The step as ``preempt_until_fits`` sees it, for one running group about to run."""

    def __init__(self, sched: Any, out: Any, group: SequenceGroup,
                 needed: int, ran: set[int]):
        super().__init__(sched, out)
        #: free blocks the group needs for this step's tokens
        self.blocks_needed: int = needed
        #: ``"recompute"`` or ``"swap"``
        self.preemption: str = sched.preemption
        self._ran = ran

    def ran(self, group: SequenceGroup) -> bool:
        """Has ``group`` run this step already (it can no longer be preempted)?"""
        return id(group) in self._ran

    def is_decoding(self, group: SequenceGroup) -> bool:
        """Is every live sequence of ``group`` past its prefill (not part way through a
        chunked prompt or a recompute)?"""
        return is_decoding(group)

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Has the CPU pool room for every block ``group`` holds (shared ones once)?"""
        return self._sched.block_manager.can_swap_out(group)

    def _preempted(self, group: SequenceGroup) -> None:
        if group in self.running:
            raise ValueError(f"request {group.request_id} is preempted but still in "
                             "running: remove it from step.running first")
        self._out.preempted.append(group)
        group.timeline.preempted_steps.append(self._sched.step)

    def swap_out(self, group: SequenceGroup) -> None:
        """Copy every block of ``group`` to the CPU pool and free them on the GPU."""
        self._preempted(group)
        self._out.swap_out += self._sched.block_manager.swap_out(group)
        for seq in group.live_seqs():
            seq.status = SequenceStatus.SWAPPED

    def free(self, group: SequenceGroup) -> None:
        """Free every block of ``group``: it will be prefilled again from its text."""
        self._preempted(group)
        for seq in group.live_seqs():
            self._sched.block_manager.free(seq)
            seq.num_cached = 0
            seq.status = SequenceStatus.WAITING
        group.awaiting_tails = False
