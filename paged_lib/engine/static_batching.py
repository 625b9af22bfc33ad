"""The "before" system: static batching with contiguous max-length reservations.

This is how FasterTransformer-era servers ran (the vLLM paper's baseline): the KV budget
is cut into ``num_slots = budget // max_len`` fixed slots, each a contiguous run of
``max_len`` tokens, reserved whole whatever the request's real length. Requests are
taken first come first served, ``num_slots`` at a time, and a batch runs until its
*longest* member finishes; a finished member keeps its slot (nobody can join a running
batch). Same model, same kernels, same sampler as :class:`~paged_lib.engine.LLMEngine`:
only the memory policy differs, so the step counts compare the policies.

Finished members are not computed again here (that would only waste time, not steps);
their slots still count in ``blocks_used``, because the memory is still reserved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_lib.engine.model_input import model_input
from paged_lib.engine.model_runner import ModelRunner
from paged_lib.engine.outputs import request_output
from paged_lib.engine.sampler import sample
from paged_lib.engine.scheduler import ScheduledSeq, SchedulerOutput
from paged_lib.engine.sequence import (
    EngineStats,
    RequestOutput,
    SamplingParams,
    Sequence,
    SequenceGroup,
)
from paged_lib.engine.stop import check_stop
from paged_lib.model import TinyLlama
from paged_lib.util import cdiv


@dataclass
class Reservation:
    """A slot's contiguous blocks (what the model runner reads as the block table)."""

    blocks: list[int]


class StaticBatchingEngine:
    """Static batching on ``num_blocks`` blocks of ``block_size`` (see the module docstring).

    ``generate`` and ``stats`` have :class:`~paged_lib.engine.LLMEngine`'s shapes, so both
    systems plot the same way.
    """

    def __init__(self, model: TinyLlama, num_blocks: int, block_size: int = 16,
                 max_len: int = 2048, attention_backend: str = "torch"):
        self.model = model.eval()
        self.num_blocks, self.block_size, self.max_len = num_blocks, block_size, max_len
        self.blocks_per_slot = cdiv(max_len, block_size)
        self.num_slots = num_blocks // self.blocks_per_slot
        if self.num_slots < 1:
            raise ValueError(f"a budget of {num_blocks} blocks x {block_size} tokens holds no "
                             f"slot of max_len={max_len}")
        self.runner = ModelRunner(model, num_blocks, block_size, 0, attention_backend)
        self.stats = EngineStats(num_blocks=num_blocks, block_size=block_size)

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            if problem := sp.problem():
                raise ValueError(f"request {i}: {problem}")
            if sp.num_seqs != 1:
                raise ValueError(f"request {i}: static batching here runs one sequence per "
                                 "request (n=1, no beams)")
            if sp.stop:
                raise ValueError(f"request {i}: static batching reads no text (no stop "
                                 "strings)")
            if not p:
                raise ValueError(f"request {i}: the prompt is empty")
        self.stats = EngineStats(num_blocks=self.num_blocks, block_size=self.block_size)
        groups = []
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            gen = torch.Generator()
            gen.manual_seed(sp.seed if sp.seed is not None else i)
            g = SequenceGroup(i, [Sequence(i, list(p))], sp, generator=gen)
            if len(p) + sp.max_tokens > self.max_len:
                g.error = (f"{len(p)} prompt + {sp.max_tokens} new tokens exceed "
                           f"max_len={self.max_len}")
            groups.append(g)
        self.stats.requests = [g.timeline for g in groups]
        runnable = [g for g in groups if g.error is None]
        for start in range(0, len(runnable), self.num_slots):
            self._run_batch(runnable[start:start + self.num_slots])
        return [request_output(g) for g in groups]

    def _run_batch(self, batch: list[SequenceGroup]) -> None:
        """Reserve a slot per member, then step until every member is done."""
        for k, g in enumerate(batch):
            first = k * self.blocks_per_slot
            g.seqs[0].block_table = Reservation(list(range(first, first + self.blocks_per_slot)))
            g.timeline.admitted_steps.append(self.stats.steps)
        reserved = len(batch) * self.blocks_per_slot
        eos = self.model.config.eos_token_id
        while live := [g for g in batch if not g.is_finished()]:
            out = SchedulerOutput(step=self.stats.steps)
            for g in live:
                seq = g.seqs[0]
                out.scheduled.append(ScheduledSeq(g, seq, seq.num_new_tokens, [],
                                                  not seq.output_token_ids))
            samples = sample(self.runner.execute(model_input(out)), out, eos)
            self.stats.record_step(out.kind, len(live), reserved, len(live),
                                   out.num_batched_tokens)
            for sched, drawn in zip(out.scheduled, samples, strict=True):
                seq, g = sched.seq, sched.group
                seq.num_cached = seq.num_tokens
                seq.append(*drawn[0])
                if check_stop(seq, g, eos):
                    seq.status = seq.status.FINISHED
                    g.timeline.finished_step = out.step
