"""Serving on the engine with some of the learner's hooks: a demo serves a chapter's trace
with the learner's hooks and with the library's and says whether they agree
(:func:`side_by_side`); graders serve tiny models on :func:`one_thread`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from paged_lib.engine import EngineHooks, LLMEngine


def tokens_of(outs: list) -> list[list[list[int]]]:
    """Each request's completions' token ids."""
    return [[c.token_ids for c in o.outputs] for o in outs]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Tiny matrices: a second torch thread only adds overhead (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
