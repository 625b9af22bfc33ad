"""Serving a chapter-02 trace with the real engine, and what chapter 02's simulator predicts.

:func:`trace_requests` turns a :mod:`paged_lib.workloads` trace (lengths only) into token
prompts and ``SamplingParams(max_tokens=output_len, ignore_eos=True)``, so the engine
produces exactly the trace's lengths.

:func:`simulated_blocks` runs :func:`paged_lib.fragmentation.simulate_timeline` with the
``"paged"`` policy on the same trace and returns its blocks in use per step and its
preemption count. The engine and the simulator agree exactly, under one rule:

    **The simulator gives the token being generated a slot in the step that generates
    it; the engine writes a token's K/V one step later, when the token is fed back in.**
    So at every step the engine holds what the simulator holds for the same trace with
    every prompt one token shorter.

:func:`simulated_blocks` applies that shift, so its numbers are comparable one for one
with ``LLMEngine.stats.blocks_used`` and ``stats.preemptions``, for an engine that
admits like the simulator: recompute preemption, no watermark, no limits on sequences
or tokens per step, requests arriving at step 0 or at :func:`arrival_steps`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from paged_lib.engine.sequence import SamplingParams
from paged_lib.fragmentation import simulate_timeline
from paged_lib.workloads import Request


def trace_requests(requests: Sequence[Request], vocab_size: int, seed: int = 0
                   ) -> tuple[list[list[int]], list[SamplingParams]]:
    """Random prompts of the trace's prompt lengths and params for its output lengths."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab_size, r.prompt_len).tolist() for r in requests]
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in requests]
    return prompts, params


def arrival_steps(requests: Sequence[Request]) -> list[int]:
    """The step each request joins the queue: the first whole step at or after its
    arrival, as in the simulator (``LLMEngine.generate(..., arrival_steps=...)``)."""
    return [max(0, math.ceil(r.arrival)) for r in requests]


def simulated_blocks(requests: Sequence[Request], num_blocks: int, block_size: int,
                     with_arrivals: bool = False) -> tuple[list[int], int]:
    """(blocks in use at each step, preemptions) the simulator predicts for the engine.

    Prompts are taken one token shorter (the rule in the module docstring), so they must
    be at least 2 tokens long. Every request arrives at step 0 unless ``with_arrivals``
    (then compare with an engine given :func:`arrival_steps`).
    """
    shifted = []
    for i, r in enumerate(requests):
        if r.prompt_len < 2:
            raise ValueError(f"request {i}: the comparison needs prompts of >= 2 tokens, "
                             f"got {r.prompt_len}")
        shifted.append(Request(r.prompt_len - 1, r.output_len,
                               r.arrival if with_arrivals else 0.0))
    tl = simulate_timeline(shifted, "paged", num_blocks * block_size, block_size,
                           max_len=max(r.final_len for r in requests), record=True)
    per_step = np.zeros(tl.num_steps, dtype=np.int64)
    for a in tl.allocations:
        per_step[a.start:a.end] += a.size // block_size
    return per_step.tolist(), tl.preemptions


def preemption_tradeoff(model, requests: Sequence[Request], kv_tokens: int,
                        block_sizes: Sequence[int], num_cpu_blocks_factor: int = 4,
                        seed: int = 0) -> list[dict]:
    """Swap vs recompute on one trace and one KV budget, for each block size (paper §7.3).

    For every block size the same requests run twice on ``kv_tokens // block_size``
    blocks: once preempting by ``"swap"`` (CPU pool ``num_cpu_blocks_factor`` times
    bigger), once by ``"recompute"``. Each row: ``block_size``, ``mode``, ``steps``,
    ``preemptions``, ``swapped_blocks``, ``swapped_bytes`` (K and V, all layers, both
    directions), ``recomputed_tokens`` and ``seconds`` (wall clock: varies by machine).
    """
    from time import perf_counter

    from paged_lib.accounting import kv_bytes_per_token
    from paged_lib.engine.llm_engine import LLMEngine

    prompts, params = trace_requests(requests, model.config.vocab_size, seed)
    rows = []
    for bs in block_sizes:
        num_blocks = kv_tokens // bs
        for mode in ("swap", "recompute"):
            engine = LLMEngine(model, num_blocks, bs, preemption=mode,
                               num_cpu_blocks=num_cpu_blocks_factor * num_blocks
                               if mode == "swap" else 0)
            start = perf_counter()
            engine.generate(prompts, params)
            s = engine.stats
            rows.append({"block_size": bs, "mode": mode, "steps": s.steps,
                         "preemptions": s.preemptions, "swapped_blocks": s.swapped_blocks,
                         "swapped_bytes": s.swapped_blocks * bs * kv_bytes_per_token(model.config),
                         "recomputed_tokens": s.recomputed_tokens,
                         "seconds": perf_counter() - start})
    return rows
