"""Serving on the engine with some of the learner's hooks: a grader serves a
:class:`Workload` (:func:`serve`); a demo serves a chapter's trace with the learner's hooks
and with the library's and says whether they agree (:func:`side_by_side`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from paged_lib.engine import EngineHooks, LLMEngine


def tokens_of(outs: list) -> list[list[list[int]]]:
    """Each request's completions' token ids."""
    return [[c.token_ids for c in o.outputs] for o in outs]


def schedule_of(out: Any) -> list[tuple[int, int, int]]:
    """One step's schedule: (request, sequence, tokens) of each scheduled sequence."""
    return [(s.group.request_id, s.seq.seq_id, s.num_new_tokens) for s in out.scheduled]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Tiny matrices: a second torch thread only adds overhead (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class Workload:
    name: str
    options: dict  # the engine's keywords, num_blocks and block_size among them
    prompts: list
    params: list
    arrivals: list


def beam_workload() -> Workload:
    """Beams of 3 and 4 next to parallel samples, with swaps and chunks."""
    from paged_lib.engine import SamplingParams as P

    return Workload("beams of 3 and 4 and samples, swap, chunks of 8, 14 blocks of 2", dict(
        num_blocks=14, block_size=2, watermark=0, preemption="swap", num_cpu_blocks=64,
        enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=8),
        [[66, 76, 113, 114, 49], [95, 106, 91], [44, 107, 40, 61, 122, 114, 102, 63, 48],
         [92, 85, 44, 47]],
        [P(max_tokens=7, beam_width=4), P(max_tokens=6, beam_width=3),
         P(max_tokens=5, temperature=1.0, n=3, seed=3), P(max_tokens=8, beam_width=3)],
        [0, 0, 1, 3])


def serve(model: Any, workload: Any, hooks: EngineHooks | None = None,
          ready: Callable[[LLMEngine], None] | None = None, **kw: Any) -> tuple[list, LLMEngine]:
    """(tokens of every completion, the engine) of ``workload`` (``options`` with
    ``num_blocks`` and ``block_size``, ``prompts``, ``params``, ``arrivals``) served on the
    torch backend with ``hooks``; ``ready(engine)`` runs before the first step."""
    opts = {**workload.options, **kw}
    engine = LLMEngine(model, opts.pop("num_blocks"), opts.pop("block_size"),
                       attention_backend="torch", hooks=hooks, **opts)
    if ready is not None:
        ready(engine)
    outs = engine.generate(workload.prompts, workload.params, arrival_steps=workload.arrivals)
    return tokens_of(outs), engine


@dataclass
class SideBySide:
    yours: LLMEngine      # served with the learner's hooks
    library: LLMEngine    # the same requests, every piece the library's
    outs: list            # the learner's engine's outputs
    same_tokens: bool

    @property
    def same_steps(self) -> bool:
        """Batch sizes, blocks in use and preemptions equal at every step."""
        s, r = self.yours.stats, self.library.stats
        return (s.batch_sizes, s.blocks_used, s.preemptions) == \
            (r.batch_sizes, r.blocks_used, r.preemptions)


def side_by_side(model: Any, num_blocks: int, block_size: int, prompts: list, params: Any,
                 hooks: EngineHooks, **kw: Any) -> SideBySide:
    """``prompts`` served by an engine with ``hooks`` and by the library's (the engine's
    default backend, ``kw`` for both)."""
    yours = LLMEngine(model, num_blocks, block_size, hooks=hooks, **kw)
    outs = yours.generate(prompts, params)
    library = LLMEngine(model, num_blocks, block_size, **kw)
    ref = library.generate(prompts, params)
    return SideBySide(yours, library, outs, tokens_of(outs) == tokens_of(ref))
