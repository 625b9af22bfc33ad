"""The scheduler: who runs this step, and which blocks they get (pure Python).

Three queues of sequence groups: ``waiting`` (not admitted, or preempted by
recompute), ``running`` (K/V in the GPU pool, in admission order) and ``swapped``
(preempted by swap, K/V in the CPU pool). A sequence is described, as in vLLM v1, by two
numbers: ``num_tokens`` (its text) and ``num_cached`` (the leading tokens whose K/V is
written). Each step runs some of the difference - one token for a decode, a whole text or
a chunk of it for a prefill - and **every token counts against one budget**,
``max_num_batched_tokens``: no step ever computes more. Every step
(:meth:`Scheduler.schedule`):

1. **Decode the running groups**, oldest first: each live sequence gets the slot of one
   more token. When the pool cannot give a group its blocks, a group is preempted, all
   of it (:func:`~paged_lib.engine.policy.choose_victim`: the *most recently admitted*):
   ``recompute`` frees its blocks and puts it at the front of ``waiting``; ``swap``
   copies its blocks to the CPU pool (the loop is the ``preempt_until_fits`` hook,
   :func:`~paged_lib.engine.policy.preempt_until_fits`).
2. **Swap in** swapped groups, first come first served, if nothing was preempted this
   step and they fit.
3. **Continue the prefills** of running groups part way through their text (a chunked
   prompt, a group recomputing), as much as the budget left allows, preempting as in 1.
4. **Admit** waiting groups, first come first served, while :func:`can_admit` says yes,
   nobody is left in ``swapped`` (swapped groups come back first) and nobody was
   preempted this step (vLLM v1: a victim is not readmitted in the step that evicted it);
   the loop is the ``schedule_waiting`` hook (:func:`~paged_lib.engine.policy.schedule_waiting`).
   An admitted group is prefilled in the same step as the decodes (iteration-level
   batching, as in Orca).

A table holds the blocks of the tokens computed so far and of this step's, never more
(vLLM v1's ``allocate_slots``): a chunked prompt starts as soon as its first chunk fits
and can be preempted between chunks. Nothing is sampled for a group until the step that
computes the last token of every one of its sequences; a group of several sequences
holds back each one's last token until all of them fit in one step, so they all draw
together (a seeded group draws what it draws unpreempted).

That is ``scheduling="mixed"`` (the default). ``scheduling="prefill_first"`` is vLLM
v0's default instead: a step runs prefills *or* decodes, never both. Waiting groups
are admitted first (unless some are swapped); only when none is, the running groups
decode (preempting as above) and swapped groups come back.

**Recompute keeps sharing.** A group of several sequences (``n > 1`` samples, beams)
preempted by recompute comes back in two phases: (1) its first sequence prefills the
*prompt* alone, nothing sampled; (2) the others fork that table (full prompt blocks
shared; a part-filled last block copied on write, via :class:`~paged_lib.blocks.Slot`'s
``copy``), and every sequence prefills its own generated tail over the cached prompt.
vLLM v0 never recomputes a multi-sequence group (it swaps it out); vLLM v1 splits ``n``
samples into ``n`` requests that share the prompt through the prefix cache.

Admission never splits a group: its blocks are counted for all its sequences at once,
shared ones once (:func:`~paged_lib.engine.block_manager.num_required_blocks`); with
chunked prefill only the first chunk's blocks are asked of a fresh prompt. One exception
keeps every request moving: a group that would be alone in an empty step is admitted (or
swapped in) whenever its blocks are free, even if it would eat into the watermark.

Chapter 10 (both off by default). **Prefix caching**: an admitted sequence adopts the
cached blocks of its text's longest cached prefix and prefills only the rest. A full
block is registered in the cache *when it is scheduled* (vLLM v1), so a request admitted
later in the same step, or the next chunk, already hits it: every layer writes the
step's K/V before any attention reads it. **Chunked prefill** (``mixed`` only): a text
longer than the budget left is prefilled in chunks (:mod:`~paged_lib.engine.prefill`).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections import deque

from paged_lib.engine.beam_search import update_beams
from paged_lib.engine.block_manager import BlockManager
from paged_lib.engine.hooks import EngineHooks
from paged_lib.engine.policy import Budget, can_admit, choose_victim, preempt, seqs_to_come
from paged_lib.engine.prefill import is_decoding, tokens_to_run
from paged_lib.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from paged_lib.engine.scheduler_step import RunningStep, WaitingStep
from paged_lib.engine.sequence import (
    Sequence,
    SequenceGroup,
    SequenceStatus,
    fork_samples,
)
from paged_lib.engine.stop import check_stop

__all__ = ["Budget", "ScheduledSeq", "Scheduler", "SchedulerOutput", "can_admit",
           "choose_victim"]

PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_MODES = ("mixed", "prefill_first")
SCHEDULING_POLICIES = ("fcfs", "priority")


def priority_victim(running: list[SequenceGroup]) -> SequenceGroup:
    """vLLM v1's victim under ``scheduling_policy="priority"``: the group of lowest
    priority (largest value), the latest arrival of those, the latest admitted of ties.
    It chooses among the groups :func:`~paged_lib.engine.policy.choose_victim` is offered
    (the group short of blocks and those admitted after it), where vLLM looks at every
    running request: here a group that already ran this step keeps its blocks."""
    return max(reversed(running), key=lambda g: (g.priority, g.timeline.arrival_step))


class Scheduler:
    """Waiting / running / swapped queues over a :class:`BlockManager` (module docstring)."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 4096, watermark_blocks: int = 0,
                 preemption: str = "recompute", scheduling: str = "mixed",
                 enable_chunked_prefill: bool = False, hooks: EngineHooks | None = None,
                 policy: str = "fcfs"):
        if enable_chunked_prefill and scheduling != "mixed":
            raise ValueError("enable_chunked_prefill batches chunks with decodes: it needs "
                             f"scheduling='mixed', got {scheduling!r}")
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {preemption!r}")
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        if scheduling not in SCHEDULING_MODES:
            raise ValueError(f"scheduling must be one of {SCHEDULING_MODES}, got {scheduling!r}")
        if preemption == "swap" and block_manager.cpu is None:
            raise ValueError("preemption='swap' needs a CPU pool: set num_cpu_blocks > 0")
        for name, v in (("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({max_num_seqs}): every running sequence decodes "
                             "one token a step, and all of them must fit in one step's budget")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = watermark_blocks
        self.preemption = preemption
        self.scheduling = scheduling
        #: ``"fcfs"``, or ``"priority"`` (vLLM v1's): waiting groups in order of
        #: ``(priority, arrival)`` and, with the default ``choose_victim``, the victim the
        #: one of lowest priority (the largest value; of those, the latest admitted)
        self.policy = policy
        hooks = hooks if hooks is not None else EngineHooks()
        if policy == "priority" and hooks.choose_victim is choose_victim:
            hooks = dataclasses.replace(hooks, choose_victim=priority_victim)
        #: schedule_waiting, preempt_until_fits, can_admit, ... are asked here (EngineHooks)
        self.hooks = hooks
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        #: the engine's clock, owned here: the step being scheduled. :meth:`update` ends a
        #: step, :meth:`idle_step` one with nothing to run, :meth:`restart_clock` a new run
        self.step = 0

    @classmethod
    def from_config(cls, block_manager: BlockManager, config, watermark_blocks: int = 0,
                    hooks: EngineHooks | None = None) -> Scheduler:
        """The scheduler of an :class:`~paged_lib.engine.config.EngineConfig` (its budgets,
        preemption and scheduling mode)."""
        return cls(block_manager, max_num_seqs=config.max_num_seqs,
                   max_num_batched_tokens=config.max_num_batched_tokens,
                   watermark_blocks=watermark_blocks, preemption=config.preemption,
                   scheduling=config.scheduling, policy=config.scheduling_policy,
                   enable_chunked_prefill=config.enable_chunked_prefill, hooks=hooks)

    def idle_step(self) -> None:
        """A step passes with nothing to run (requests yet to arrive)."""
        self.step += 1

    def restart_clock(self) -> None:
        """Step 0 again, for a new run (``LLMEngine.generate``)."""
        self.step = 0

    def add(self, group: SequenceGroup) -> None:
        """A new request joins the back of the waiting queue."""
        group.timeline.arrival_step = self.step
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Decide this step (see the module docstring); changes queues and block tables."""
        out = SchedulerOutput(step=self.step)
        if self.policy == "priority":  # (stable: a preempted group keeps its place)
            self.waiting = deque(sorted(self.waiting, key=lambda g: (
                g.priority, g.timeline.arrival_step)))
        if self.scheduling == "prefill_first":
            self._schedule_running(out, decoding=False)  # shared recomputes: prefills
            self._schedule_waiting(out)
            if out.scheduled:  # a prefill step: the running groups wait for the next one
                return out
        self._schedule_running(out, decoding=True)
        if not out.preempted:
            self._schedule_swapped(out)
        if self.scheduling == "mixed":
            self._schedule_running(out, decoding=False)  # decodes first, then prefills
            self._schedule_waiting(out)  # (nobody while swapped, nor after a preemption)
        return out

    def _tokens_left(self, out: SchedulerOutput) -> int:
        return self.max_num_batched_tokens - out.num_batched_tokens

    def _schedule_running(self, out: SchedulerOutput, decoding: bool) -> None:
        """Run the running groups that decode (``decoding``) or that prefill part of a
        text; a group the pool cannot serve preempts the latest admitted first."""
        done = {id(s.group) for s in out.scheduled}
        for group in list(self.running):
            if id(group) in done or is_decoding(group) != decoding or group not in self.running:
                continue
            if group.awaiting_tails and _prompt_done(group):
                self.block_manager.fork_prompt(group)  # phase 2 of a shared recompute
                group.awaiting_tails = False
            take, sample = tokens_to_run(group, self._tokens_left(out))
            if not any(take):
                continue  # no budget left for it this step: it keeps its blocks
            need = self.block_manager.blocks_to_append(group.live_seqs(), take)
            if self._make_room(group, RunningStep(self, out, group, need, done)):
                self._schedule_tokens(group, take, sample, out, decoding)
                done.add(id(group))

    def _make_room(self, group: SequenceGroup, step: RunningStep) -> bool:
        """Ask ``preempt_until_fits`` whether ``group`` runs now, and check its answer."""
        before = len(step._out.preempted)
        runs = self.hooks.preempt_until_fits(group, step)
        if not isinstance(runs, bool):
            raise ValueError(f"preempt_until_fits returned {runs!r} for request "
                             f"{group.request_id}: expected True (it runs) or False")
        for victim in step._out.preempted[before:]:
            queue = self.swapped if victim.seqs[0].status is SequenceStatus.SWAPPED \
                else self.waiting
            if not any(victim is g for g in queue):
                where = "swapped" if queue is self.swapped else "waiting"
                raise ValueError(f"request {victim.request_id} was preempted but is not in "
                                 f"{where}: put it back in the queue it returns from")
        if runs and (step.blocks_needed > step.free_blocks or group not in self.running):
            raise ValueError(f"preempt_until_fits said request {group.request_id} runs, "
                             f"but it needs {step.blocks_needed} free blocks and "
                             f"{step.free_blocks} are free"
                             + ("" if group in self.running else ", and it is not running"))
        if not runs and any(group is g for g in self.running):
            raise ValueError(f"preempt_until_fits said request {group.request_id} does not "
                             "run, but it is still running: return False only when it "
                             "was preempted itself")
        return runs

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Preempt ``group`` now, as the library's ``preempt_until_fits`` does a victim."""
        preempt(group, RunningStep(self, out, group, 0, set()))

    def _schedule_swapped(self, out: SchedulerOutput) -> None:
        while self.swapped:
            group = self.swapped[0]
            # its blocks come back, then it decodes: one more token per live sequence
            # (counted on its CPU tables, which share blocks exactly as they will)
            seqs = group.live_seqs()
            need = (self.block_manager.distinct_blocks(group)
                    + self.block_manager.blocks_to_append(seqs, [1] * len(seqs)))
            fits = self.hooks.can_admit(need, len(seqs), len(seqs), self._budget(out, group))
            alone = out.is_empty() and need <= self.block_manager.num_free_blocks  # progress
            if not (fits or alone):
                break
            self.swapped.popleft()
            out.swap_in += self.block_manager.swap_in(group)
            self.running.append(group)
            self._schedule_tokens(group, [1] * len(seqs), True, out, decoding=True)
            group.timeline.admitted_steps.append(self.step)

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        """Ask ``schedule_waiting`` who joins this step (it calls ``step.admit``)."""
        self.hooks.schedule_waiting(self.waiting, WaitingStep(self, out))

    def _required_blocks(self, group: SequenceGroup) -> int:
        """The ``num_required_blocks`` hook's answer for a waiting group, checked."""
        need = self.hooks.num_required_blocks(group, self.block_manager.block_size)
        if isinstance(need, bool) or not isinstance(need, numbers.Integral) or need < 0:
            raise ValueError(f"num_required_blocks returned {need!r} for request "
                             f"{group.request_id}: expected an int >= 0 (a block count)")
        return int(need)

    def _schedule_tokens(self, group: SequenceGroup, take: list[int], sample: bool,
                         out: SchedulerOutput, decoding: bool) -> None:
        """Append ``take[i]`` slots to live sequence ``i`` and schedule them (as decodes,
        or as parts of a prefill)."""
        for seq, n in zip(group.live_seqs(), take, strict=True):
            if n == 0:
                continue
            slots = [self.block_manager.append_slot(seq) for _ in range(n)]
            out.blocks_to_copy += [s.copy for s in slots if s.copy is not None]
            seq.status = SequenceStatus.RUNNING
            self._add_scheduled(group, seq, slots, not decoding, sample, out)

    def _add_scheduled(self, group: SequenceGroup, seq: Sequence, slots: list,
                       is_prefill: bool, sample: bool, out: SchedulerOutput) -> None:
        out.scheduled.append(ScheduledSeq(group, seq, len(slots), slots, is_prefill, sample))
        # full blocks whose K/V this step writes are cached now: a later request in the
        # same step can hit them (every layer writes before it attends)
        self.block_manager.cache_full_blocks(seq, seq.num_cached + len(slots))
        if is_prefill and (seq.output_token_ids or group.awaiting_tails
                           or len(group.seqs) > 1):
            out.recomputed_tokens += len(slots)

    def _budget(self, out: SchedulerOutput, group: SequenceGroup) -> Budget:
        """What is left when ``group`` asks to join: free blocks, and the sequences that
        run (every running group's, a fresh ``n > 1`` group counted as its ``n``)."""
        num_seqs = sum(seqs_to_come(g) for g in self.running if g is not group)
        return Budget(self.block_manager.num_free_blocks, self.watermark_blocks, num_seqs,
                      self.max_num_seqs, out.num_batched_tokens, self.max_num_batched_tokens)

    # ------------------------------------------------------------------ update

    def update(self, out: SchedulerOutput, samples: list[list[tuple[int, float]]],
               eos_token_id: int | None, stop_strings=None) -> list[SequenceGroup]:
        """Append each sequence's sampled token; finish and free; return finished groups.

        ``samples[i]`` holds the (token, logprob) pairs drawn for ``out.scheduled[i]``:
        one, or ``n`` for the prefill of an ``n > 1`` group (the prompt's table is then
        forked, so the samples share its blocks). A sequence is done as
        :func:`~paged_lib.engine.stop.check_stop` says (``stop_strings``: the engine's
        :class:`~paged_lib.engine.stop.StopStrings` when it has a tokenizer).
        """
        beam_groups: dict[SequenceGroup, list[tuple[Sequence, list]]] = {}
        for sched, drawn in zip(out.scheduled, samples, strict=True):
            seq, group = sched.seq, sched.group
            seq.num_cached += sched.num_new_tokens
            if not sched.sample:  # part of a text: its group draws in a later step
                continue
            if group.params.beam_width is not None:
                beam_groups.setdefault(group, []).append((seq, drawn))
                continue
            if len(drawn) > 1:
                fork_samples(group, seq, drawn[1:])
            seq.append(*drawn[0])
        for group, beams in beam_groups.items():
            update_beams(group, [b for b, _ in beams], [d for _, d in beams], eos_token_id,
                         self.hooks.beam_step)
        finished = []
        for group in dict.fromkeys(s.group for s in out.scheduled if s.sample):  # in order
            for seq in group.live_seqs():  # (beam search ends its beams itself)
                if check_stop(seq, group, eos_token_id, stop_strings):
                    seq.status = SequenceStatus.FINISHED
                    self.block_manager.free(seq)
            if group.is_finished():
                group.timeline.finished_step = self.step
                finished.append(group)
        if finished:
            self.running = [g for g in self.running if not g.is_finished()]
        self.step += 1
        return finished


def _prompt_done(group: SequenceGroup) -> bool:
    """Has the first phase of a shared recompute cached the whole prompt?"""
    return group.live_seqs()[0].num_cached == len(group.prompt_token_ids)
