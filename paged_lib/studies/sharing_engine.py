"""Sharing measured on the engine's own beams: the blocks a real beam search holds.

:mod:`paged_lib.studies.sharing` measures sharing on a *synthetic* beam process (random
log-probabilities). This module runs real beam searches through
:class:`~paged_lib.engine.LLMEngine` on a real model and reads the beams' block tables at
every step, at the moment every live beam has just written its token and before the
step's survivors are chosen: exactly the tables the engine's ``beam_step`` hook receives,
so :func:`engine_beam_usage` wraps that hook (and the model runner's ``execute``, to
count the step's copy-on-write copies) and changes nothing else.

The result is one :class:`~paged_lib.studies.sharing.Usage` per request, in the same shape as the
synthetic process's: blocks held with sharing (distinct blocks of the group's tables) and
without (every beam its own ``cdiv(num_tokens, block_size)`` blocks), one entry per step
in which the engine called ``beam_step`` (index 0: the prompt). The engine never writes
the last sampled token's K/V (and its last step may only finish the beams), so compare
with :func:`paged_lib.studies.sharing.beam_search_usage` for ``output_len = len(shared) - 1``.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_lib.studies.sharing import Usage, unshared_blocks
from paged_lib.util import cdiv


def engine_beam_usage(model, prompts: Sequence[list[int]], beam_width: int, max_tokens: int,
                      block_size: int = 16, ignore_eos: bool = True) -> list[Usage]:
    """Beam search of every prompt (all in one batch, on a pool that never runs short),
    and the blocks each request's beams held at every step, with and without sharing.

    ``model`` is a :class:`~paged_lib.model.TinyLlama`; ``ignore_eos=True`` (the default)
    lets every beam run ``max_tokens`` steps, like the synthetic process.
    """
    from paged_lib.engine import EngineHooks, LLMEngine, SamplingParams
    from paged_lib.engine.beam_search import beam_step

    longest = max(len(p) for p in prompts) + max_tokens
    num_blocks = len(prompts) * (beam_width + 1) * (cdiv(longest, block_size) + 1)
    shared: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    unshared: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    seen: list[tuple[int, int, set[int]]] = []  # (step, request, blocks the beams hold)
    copied: dict[int, list[int]] = {}  # step -> copy-on-write destinations

    def recording_step(tables, cum_logprobs, candidates, width):
        group = next(g for g in engine.scheduler.running
                     if any(s.block_table is tables[0] for s in g.seqs))
        blocks = {b for t in tables for b in t.blocks}
        shared[group.request_id].append(len(blocks))
        unshared[group.request_id].append(unshared_blocks(tables, block_size))
        seen.append((engine.scheduler.step, group.request_id, blocks))
        return beam_step(tables, cum_logprobs, candidates, width)

    engine = LLMEngine(model, num_blocks, block_size, watermark=0.0,
                       hooks=EngineHooks(beam_step=recording_step),
                       on_step=lambda out, stats: copied.update(
                           {out.step: [dst for _, dst in out.blocks_to_copy]}))
    params = SamplingParams(max_tokens=max_tokens, beam_width=beam_width,
                            ignore_eos=ignore_eos)
    engine.generate([list(p) for p in prompts], params)
    copies = dict.fromkeys(range(len(prompts)), 0)
    for step, request, blocks in seen:  # the copies the step's slots asked for
        copies[request] += sum(dst in blocks for dst in copied.get(step, ()))
    if engine.stats.preemptions:
        raise RuntimeError("a beam group was preempted: the pool should never run short")
    return [Usage(shared[i], unshared[i], copies[i]) for i in range(len(prompts))]


def time_averaged_saving(usages: Sequence[Usage]) -> float:
    """``1 - sum(shared) / sum(unshared)`` over every step of every request: the share of
    block-steps sharing saves (requests of equal length weigh the same)."""
    return 1.0 - sum(sum(u.shared) for u in usages) / sum(sum(u.unshared) for u in usages)
