"""Sharing measured on the engine: the blocks real samples and real beams hold.

:mod:`paged_lib.studies.sharing` measures sharing on block tables alone (a synthetic beam
process with random log-probabilities, samples that all run to the same length). This
module serves real requests through :class:`~paged_lib.engine.LLMEngine` on a real model
(chapter 08 uses SmolLM2-135M-Instruct on chat prompts) and reads every request's block
tables at every step, changing nothing the engine does:

* **parallel sampling** (``SamplingParams(n=...)``): after each step (``on_step``), the
  live samples' tables; a sample that ends at EOS frees its blocks, as in the engine;
* **beam search** (``SamplingParams(beam_width=...)``): the tables the engine's
  ``beam_step`` hook receives, at the moment every live beam has just written its token and
  before the step's survivors are chosen (the wrapper calls the library's ``beam_step``).

Each request gives one :class:`~paged_lib.studies.sharing.Usage`: blocks held with sharing
(distinct blocks of its tables) and without (every sequence its own
``cdiv(num_tokens, block_size)`` blocks), index 0 the prompt, then one entry per step,
and the copy-on-write copies its step asked for. The engine never writes the last sampled
token's K/V, so compare with :func:`paged_lib.studies.sharing.beam_search_usage` for
``output_len = len(shared) - 1``. :func:`engine_savings` turns a batch of them into the
:class:`~paged_lib.studies.sharing.Savings` that :func:`~paged_lib.studies.sharing.savings_table`
gives for a synthetic trace.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paged_lib.studies.sharing import Savings, Usage, unshared_blocks
from paged_lib.util import cdiv


def engine_usage(model, prompts: Sequence[list[int]], params, block_size: int = 16,
                 tokenizer=None) -> tuple[list[Usage], list]:
    """Serve every prompt in one batch, on a pool that never runs short, and read each
    request's blocks at every step, with and without sharing.

    ``model`` is a :class:`~paged_lib.model.TinyLlama`; ``params`` one
    :class:`~paged_lib.engine.SamplingParams` for all or one per prompt, each with
    ``n > 1`` (parallel sampling) or a ``beam_width``; ``tokenizer`` (optional) fills in the
    outputs' text. Returns (one :class:`Usage` per request, the engine's
    :class:`~paged_lib.engine.sequence.RequestOutput` list).
    """
    from paged_lib.engine import EngineHooks, LLMEngine
    from paged_lib.engine.beam_search import beam_step

    params = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
    for i, p in enumerate(params):
        if p.beam_width is None and p.n < 2:
            raise ValueError(f"request {i} has n=1 and no beam_width: nothing to share")
    longest = max(len(p) for p in prompts) + max(p.max_tokens for p in params)
    num_blocks = sum((p.num_seqs + 1) * (cdiv(longest, block_size) + 1) for p in params)
    shared: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    unshared: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    seen: list[tuple[int, int, set[int]]] = []  # (step, request, blocks its tables hold)

    def record(step: int, request: int, tables) -> None:
        blocks = {b for t in tables for b in t.blocks}
        shared[request].append(len(blocks))
        unshared[request].append(unshared_blocks(tables, block_size))
        seen.append((step, request, blocks))

    def recording_beam_step(tables, cum_logprobs, candidates, width):
        group = next(g for g in engine.scheduler.running
                     if any(s.block_table is tables[0] for s in g.seqs))
        record(engine.scheduler.step, group.request_id, tables)
        return beam_step(tables, cum_logprobs, candidates, width)

    copied: dict[int, list[int]] = {}  # step -> copy-on-write destinations

    def watch(out, stats) -> None:
        copied[out.step] = [dst for _, dst in out.blocks_to_copy]
        for group in engine.scheduler.running:  # samples: after the step, live ones only
            if group.params.beam_width is None and not group.awaiting_tails:
                record(out.step, group.request_id,
                       [s.block_table for s in group.live_seqs() if s.block_table])

    engine = LLMEngine(model, num_blocks, block_size, watermark=0.0, tokenizer=tokenizer,
                       max_model_len=longest, on_step=watch,
                       hooks=EngineHooks(beam_step=recording_beam_step))
    outputs = engine.generate([list(p) for p in prompts], params)
    if engine.stats.preemptions:
        raise RuntimeError("a group was preempted: the pool should never run short")
    copies = dict.fromkeys(range(len(prompts)), 0)
    for step, request, blocks in seen:  # the copies the step's slots asked for
        copies[request] += sum(dst in blocks for dst in copied.get(step, ()))
    usages = [Usage(shared[i], unshared[i], copies[i]) for i in range(len(prompts))]
    return usages, outputs


def engine_beam_usage(model, prompts: Sequence[list[int]], beam_width: int, max_tokens: int,
                      block_size: int = 16, ignore_eos: bool = True) -> list[Usage]:
    """:func:`engine_usage` for a beam search of every prompt with one width;
    ``ignore_eos=True`` (the default) lets every beam run ``max_tokens`` steps, like the
    synthetic process."""
    from paged_lib.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, beam_width=beam_width,
                            ignore_eos=ignore_eos)
    return engine_usage(model, prompts, params, block_size)[0]


def time_averaged_saving(usages: Sequence[Usage]) -> float:
    """``1 - sum(shared) / sum(unshared)`` over every step of every request: the share of
    block-steps sharing saves (requests of equal length weigh the same)."""
    return 1.0 - sum(sum(u.shared) for u in usages) / sum(sum(u.unshared) for u in usages)


def engine_savings(mode: str, width: int, usages: Sequence[Usage]) -> Savings:
    """The requests of one :func:`engine_usage` batch (all admitted at step 0) overlaid
    step by step, as :func:`paged_lib.studies.sharing.trace_savings` overlays a trace:
    peak and time-averaged blocks over the whole batch, with and without sharing, and the
    mean of each request's own saving. A request that has finished holds nothing."""
    if not usages:
        raise ValueError("engine_savings needs at least one request's usage")
    horizon = max(len(u.shared) for u in usages)
    shared, unshared = np.zeros(horizon, np.int64), np.zeros(horizon, np.int64)
    for u in usages:
        shared[:len(u.shared)] += u.shared
        unshared[:len(u.unshared)] += u.unshared
    own = np.mean([1.0 - sum(u.shared) / sum(u.unshared) for u in usages])
    return Savings(mode, width, int(shared.max()), int(unshared.max()), float(shared.mean()),
                   float(unshared.mean()), sum(u.copies for u in usages), float(own))
