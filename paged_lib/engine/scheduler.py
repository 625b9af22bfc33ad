"""The scheduler: who runs this step, and which blocks they get (pure Python).

Three queues of sequence groups: ``waiting`` (not admitted, or preempted by
recompute), ``running`` (K/V in the GPU pool, in admission order) and ``swapped``
(preempted by swap, K/V in the CPU pool). Every step (:meth:`Scheduler.schedule`):

1. **Decode the running groups**, oldest first: each live sequence gets the slot of one
   more token. When the pool cannot give a group its blocks, a group is preempted, all
   of it (:func:`~paged_lib.engine.policy.choose_victim`: the *most recently admitted*):
   ``recompute`` frees its blocks and puts it at the front of ``waiting``; ``swap``
   copies its blocks to the CPU pool.
2. **Swap in** swapped groups, first come first served, if nothing was preempted this
   step and they fit.
3. **Admit** waiting groups, first come first served, while :func:`can_admit` says yes
   and nobody is left in ``swapped`` (swapped groups come back first). An admitted group
   is prefilled in the same step as the decodes (iteration-level batching, as in Orca).

That is ``scheduling="mixed"`` (the default). ``scheduling="prefill_first"`` is vLLM
v0's default instead: a step runs prefills *or* decodes, never both. Waiting groups
are admitted first (unless some are swapped); only when none is, the running groups
decode (preempting as above) and swapped groups come back. New requests start sooner;
running ones skip a step whenever someone is admitted.

**Recompute keeps sharing.** A group of several sequences (``n > 1`` samples, beams)
preempted by recompute comes back in two steps: (1) its first sequence prefills the
*prompt* alone, nothing sampled; (2) the others fork that table (full prompt blocks
shared; a part-filled last block copied on write, via :class:`~paged_lib.blocks.Slot`'s
``copy``), and every sequence prefills its own generated tail over the cached prompt.
The prompt is computed once and held once, as swapping would keep it; all sequences
still sample in the same step, so a seeded group draws what it draws unpreempted.
vLLM v0 never recomputes a multi-sequence group: it swaps it out (its recompute path
asserts one sequence) and aborts the run when the CPU swap space is full. Here
``recompute`` takes such groups too (and ``swap`` falls back to it when the CPU pool is
full); only the prompt is shared again (beams that shared more history share less for
a step or two, until beam search forks them again).

Admission never splits a group: its blocks are counted for all its sequences at once,
shared ones once (:func:`~paged_lib.engine.block_manager.num_required_blocks`), and
the blocks promised to a shared recompute's tails are not given to anyone else.
One exception to the limits keeps every request moving: a group that would be alone in
an empty step is admitted (or swapped in) whenever its blocks are free, even if its
tokens exceed ``max_num_batched_tokens`` or it would eat into the watermark.

Chapter 10 (both off by default). **Prefix caching**: an admitted sequence adopts the
cached blocks of its text's longest cached prefix and prefills only the rest; admission
counts only the blocks not hit, plus the hits that were free (adopting a free cached
block takes it from the free queue). **Chunked prefill** (``mixed`` only): a text longer
than the step's token budget left is prefilled in chunks (:mod:`~paged_lib.engine.prefill`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from paged_lib.blocks import Slot
from paged_lib.engine.beam_search import beam_step, update_beams
from paged_lib.engine.block_manager import BlockManager, num_required_blocks
from paged_lib.engine.policy import Budget, can_admit, choose_victim
from paged_lib.engine.prefill import chunk_slots, is_prefilling
from paged_lib.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from paged_lib.engine.sequence import (
    Sequence,
    SequenceGroup,
    SequenceStatus,
    fork_samples,
    is_done,
)

__all__ = ["Budget", "ScheduledSeq", "Scheduler", "SchedulerOutput", "can_admit",
           "choose_victim"]

PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_MODES = ("mixed", "prefill_first")


class Scheduler:
    """Waiting / running / swapped queues over a :class:`BlockManager` (module docstring)."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 4096, watermark_blocks: int = 0,
                 preemption: str = "recompute", admission: Callable = can_admit,
                 beam_step: Callable = beam_step, scheduling: str = "mixed",
                 num_required_blocks: Callable = num_required_blocks,
                 choose_victim: Callable = choose_victim, enable_chunked_prefill: bool = False):
        if enable_chunked_prefill and scheduling != "mixed":
            raise ValueError("enable_chunked_prefill batches chunks with decodes: it needs "
                             f"scheduling='mixed', got {scheduling!r}")
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {preemption!r}")
        if scheduling not in SCHEDULING_MODES:
            raise ValueError(f"scheduling must be one of {SCHEDULING_MODES}, got {scheduling!r}")
        if preemption == "swap" and block_manager.cpu is None:
            raise ValueError("preemption='swap' needs a CPU pool: set num_cpu_blocks > 0")
        for name, v in (("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = watermark_blocks
        self.preemption = preemption
        self.scheduling = scheduling
        self.admission = admission
        self.beam_step = beam_step
        self.num_required_blocks = num_required_blocks
        self.choose_victim = choose_victim
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
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
        if self.scheduling == "prefill_first":
            self._schedule_pending_tails(out)
            if not self.swapped:
                self._schedule_waiting(out)
            if out.scheduled:  # a prefill step: the running groups wait for the next one
                return out
        chunked = self._schedule_running(out)
        if not out.preempted:
            self._schedule_swapped(out)
        self._schedule_chunks(chunked, out)  # decodes first, then prefill chunks
        if not self.swapped and self.scheduling == "mixed":
            self._schedule_waiting(out)
        return out

    def _schedule_pending_tails(self, out: SchedulerOutput) -> None:
        """``prefill_first``: the tails of shared recomputes are prefills, so they run in
        a prefill step (admission reserved their blocks; preempt again if they are gone)."""
        for group in [g for g in self.running if g.awaiting_tails]:
            if self.block_manager.tail_blocks_needed(group) <= self.block_manager.num_free_blocks:
                self._schedule_tails(group, out)
            else:
                self.running.remove(group)
                self._preempt(group, out)

    def _schedule_running(self, out: SchedulerOutput) -> list[SequenceGroup]:
        """Decode (or recompute tails of) the running groups; returns those half way
        through a chunked prefill, whose next chunks run after the decodes."""
        queue = deque(self.running)  # oldest first
        kept: list[SequenceGroup] = []
        chunked: list[SequenceGroup] = []
        while queue:
            group = queue.popleft()
            if is_prefilling(group):  # its blocks are taken: its next chunk runs last
                chunked.append(group)
                kept.append(group)
                continue
            while self._blocks_to_continue(group) > self.block_manager.num_free_blocks:
                victim = self._victim(group, queue)  # the choose_victim hook names who goes
                self._preempt(victim, out)
                if victim is group:
                    break
                queue.remove(victim)
            else:
                if group.awaiting_tails:
                    self._schedule_tails(group, out)
                else:
                    self._schedule_decode(group, out)
                kept.append(group)
        self.running = kept
        return chunked

    def _schedule_chunks(self, chunked: list[SequenceGroup], out: SchedulerOutput) -> None:
        for group in chunked:  # as much of the next chunk as the token budget leaves
            seq = group.live_seqs()[0]
            left = self.max_num_batched_tokens - out.num_batched_tokens
            stop = seq.num_cached + min(seq.block_table.num_tokens - seq.num_cached, left)
            if stop > seq.num_cached:
                self._schedule_chunk(group, seq, chunk_slots(seq, seq.num_cached, stop), out)

    def _victim(self, group: SequenceGroup, queue: deque[SequenceGroup]) -> SequenceGroup:
        """Ask ``choose_victim`` among ``group`` and the groups not yet run this step."""
        candidates = [group, *queue]
        victim = self.choose_victim(list(candidates))
        if not any(victim is g for g in candidates):
            ids = [g.request_id for g in candidates]
            got = getattr(victim, "request_id", victim)
            raise ValueError(f"choose_victim returned {got!r}, which is not one of the groups "
                             f"it may preempt now (requests {ids}, oldest first): return one "
                             "of the list it was given")
        return victim

    def _blocks_to_continue(self, group: SequenceGroup) -> int:
        if group.awaiting_tails:
            return self.block_manager.tail_blocks_needed(group)
        return self.block_manager.append_blocks_needed(group)

    def _schedule_swapped(self, out: SchedulerOutput) -> None:
        while self.swapped:
            group = self.swapped[0]
            # its blocks come back, then it decodes: one more token per live sequence
            # (counted on its CPU tables, which share blocks exactly as they will)
            need = (self.block_manager.distinct_blocks(group)
                    + self.block_manager.append_blocks_needed(group))
            seqs = len(group.live_seqs())
            fits = self.admission(need, seqs, seqs, self._budget(out))
            alone = out.is_empty() and need <= self.block_manager.num_free_blocks  # progress rule
            if not (fits or alone):
                break
            self.swapped.popleft()
            out.swap_in += self.block_manager.swap_in(group)
            self._schedule_decode(group, out)
            self.running.append(group)
            group.timeline.admitted_steps.append(self.step)

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        while self.waiting:
            group = self.waiting[0]
            seqs = group.live_seqs()
            # tokens this step: the text of one sequence, or a shared recompute's prompt,
            # less what the prefix cache holds (a chunk of it, with chunked prefill)
            text = seqs[0].token_ids if len(seqs) == 1 else group.prompt_token_ids
            hits = self.block_manager.cache_hits(text)
            need = (self._required_blocks(group) - len(hits)
                    + self.block_manager.hits_taken_from_free(hits))
            tokens = len(text) - len(hits) * self.block_manager.block_size
            if self.enable_chunked_prefill and len(seqs) == 1:
                tokens = min(tokens, self.max_num_batched_tokens - out.num_batched_tokens)
                if tokens < 1:
                    break
            # a fresh n > 1 group forks after its prefill: count the sequences it will be
            num_seqs = max(len(seqs), group.params.num_seqs)
            fits = self.admission(need, num_seqs, tokens, self._budget(out))
            # progress rule: a group alone in an empty step is admitted if its blocks are
            # free, even when its tokens exceed max_num_batched_tokens (prefill_first:
            # alone means nobody running either, since they decode next step)
            alone = (out.is_empty() and (self.scheduling == "mixed" or not self.running)
                     and need <= self._free_for_admission())
            if not (fits or alone):
                break
            self.waiting.popleft()
            self.block_manager.check_allocation_fits(group.request_id, need, len(text), hits)
            out.prefix_cache_hit_tokens += len(hits) * self.block_manager.block_size
            if len(seqs) > 1:  # a group preempted by recompute: its prompt first, once
                self._schedule_prompt(group, hits, out)
            else:
                seq = seqs[0]
                slots = self.block_manager.allocate(seq, hits=hits)  # its whole text
                seq.status = SequenceStatus.RUNNING
                self._schedule_chunk(group, seq, slots[:tokens], out)
            self.running.append(group)
            out.admitted.append(group)
            group.timeline.admitted_steps.append(self.step)

    def _required_blocks(self, group: SequenceGroup) -> int:
        """The ``num_required_blocks`` hook's answer for a waiting group, checked."""
        need = self.num_required_blocks(group, self.block_manager.block_size)
        if isinstance(need, bool) or not isinstance(need, int) or need < 0:
            raise ValueError(f"num_required_blocks returned {need!r} for request "
                             f"{group.request_id}: expected an int >= 0 (a block count)")
        return need

    def _schedule_chunk(self, group: SequenceGroup, seq: Sequence, slots: list[Slot],
                        out: SchedulerOutput) -> None:
        """``seq`` computes the tokens at ``slots`` (the next after ``num_cached``): all of
        its uncached text, or a chunk of it; it samples only if that ends its text."""
        stop = seq.num_cached + len(slots)
        out.scheduled.append(ScheduledSeq(group, seq, len(slots), slots, True,
                                          sample=stop == seq.num_tokens))
        if seq.output_token_ids:
            out.recomputed_tokens += len(slots)

    def _schedule_prompt(self, group: SequenceGroup, hits: list[int],
                         out: SchedulerOutput) -> None:
        """Step 1 of a shared recompute: the first sequence prefills the prompt alone.

        Nothing is sampled (the group's sequences all draw together next step, so a
        seeded group draws exactly as if it had never been preempted).
        """
        seqs = group.live_seqs()
        prompt_len = len(group.prompt_token_ids)
        slots = self.block_manager.allocate(seqs[0], prompt_len, hits)
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
        out.scheduled.append(ScheduledSeq(group, seqs[0], len(slots), slots, True, sample=False))
        out.recomputed_tokens += len(slots)
        group.awaiting_tails = True

    def _schedule_tails(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Step 2 of a shared recompute: every sequence forks the cached prompt and
        prefills its own generated tail over it (copy-on-write of a part-filled block)."""
        self.block_manager.fork_prompt(group)
        for seq in group.live_seqs():
            tail = seq.num_tokens - seq.num_cached
            slots = [self.block_manager.append_slot(seq) for _ in range(tail)]
            self._add_copies(slots, out)
            out.scheduled.append(ScheduledSeq(group, seq, tail, slots, True))
            out.recomputed_tokens += tail
        group.awaiting_tails = False

    def _schedule_decode(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        for seq in group.live_seqs():
            slot = self.block_manager.append_slot(seq)
            self._add_copies([slot], out)
            seq.status = SequenceStatus.RUNNING
            out.scheduled.append(ScheduledSeq(group, seq, 1, [slot], False))

    @staticmethod
    def _add_copies(slots: list[Slot], out: SchedulerOutput) -> None:
        out.blocks_to_copy += [s.copy for s in slots if s.copy is not None]

    def _free_for_admission(self) -> int:
        """Free blocks, less those promised to shared recomputes half way (their tails)."""
        promised = sum(self.block_manager.tail_blocks_needed(g) for g in self.running
                       if g.awaiting_tails)
        return self.block_manager.num_free_blocks - promised

    def _budget(self, out: SchedulerOutput) -> Budget:
        # prefill_first: the running sequences are not in this step but decode in the next
        num_seqs = (len(out.scheduled) if self.scheduling == "mixed"
                    else sum(len(g.live_seqs()) for g in self.running))
        return Budget(self._free_for_admission(), self.watermark_blocks, num_seqs,
                      self.max_num_seqs, out.num_batched_tokens, self.max_num_batched_tokens)

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """All or nothing: the whole group leaves the GPU pool.

        ``swap`` falls back to ``recompute`` when the CPU pool is too full to take it.
        """
        out.preempted.append(group)
        group.timeline.preempted_steps.append(self.step)
        # half way through a shared recompute only the prompt is cached: recompute again
        # a chunked prefill half way too (its table holds tokens not computed yet)
        if (self.preemption == "swap" and not group.awaiting_tails
                and not is_prefilling(group) and self.block_manager.can_swap_out(group)):
            out.swap_out += self.block_manager.swap_out(group)
            for seq in group.live_seqs():
                seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(group)
            return
        for seq in group.live_seqs():
            self.block_manager.free(seq)
            seq.num_cached = 0
            seq.status = SequenceStatus.WAITING
        group.awaiting_tails = False
        self.waiting.appendleft(group)

    # ------------------------------------------------------------------ update

    def update(self, out: SchedulerOutput, samples: list[list[tuple[int, float]]],
               eos_token_id: int | None) -> list[SequenceGroup]:
        """Append each sequence's sampled token; finish and free; return finished groups.

        ``samples[i]`` holds the (token, logprob) pairs drawn for ``out.scheduled[i]``:
        one, or ``n`` for the prefill of an ``n > 1`` group (the prompt's table is then
        forked, so the samples share its blocks).
        """
        beam_groups: dict[SequenceGroup, list[tuple[Sequence, list]]] = {}
        bs = self.block_manager.block_size
        for sched, drawn in zip(out.scheduled, samples, strict=True):
            seq, group = sched.seq, sched.group
            seq.num_cached += sched.num_new_tokens
            if seq.num_cached // bs > (seq.num_cached - sched.num_new_tokens) // bs:
                self.block_manager.cache_full_blocks(seq)  # a block filled: K/V written
            if not sched.sample:  # a shared recompute's prompt: its group draws next step
                continue
            if group.params.beam_width is not None:
                beam_groups.setdefault(group, []).append((seq, drawn))
                continue
            if len(drawn) > 1:
                fork_samples(group, seq, drawn[1:])
            seq.append(*drawn[0])
        for group, beams in beam_groups.items():
            update_beams(group, [b for b, _ in beams], [d for _, d in beams], eos_token_id,
                         self.beam_step)
        finished = []
        for group in dict.fromkeys(s.group for s in out.scheduled if s.sample):  # in order
            for seq in group.live_seqs():  # (beam search ends its beams itself)
                if is_done(seq, group, eos_token_id):
                    seq.status = SequenceStatus.FINISHED
                    self.block_manager.free(seq)
            if group.is_finished():
                group.timeline.finished_step = self.step
                finished.append(group)
        if finished:
            self.running = [g for g in self.running if not g.is_finished()]
        self.step += 1
        return finished
