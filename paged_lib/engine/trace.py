"""Serving a chapter-02 trace with the real engine, and what chapter 02's simulator predicts.

:func:`trace_requests` turns a :mod:`paged_lib.workloads` trace (lengths only) into token
prompts (random ids, or the bytes of a text) and greedy
``SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)``, so the engine
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


def trace_requests(requests: Sequence[Request], vocab_size: int | None = None, seed: int = 0,
                   *, text: str | None = None, bos_id: int | None = None
                   ) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of the trace's prompt lengths, and params for exactly its output lengths.

    Prompt ``i`` is ``prompt_len`` random ids below ``vocab_size`` (drawn from ``seed``), or,
    given ``text``, ``prompt_len`` of its UTF-8 bytes starting at a line start (line
    ``7 * i`` modulo the number of lines; the text repeats when a prompt is longer), so a
    byte-level model continues readable text. With ``bos_id`` the prompt starts with it (one
    token longer than ``prompt_len``). Params: greedy, ``max_tokens=output_len``,
    ``ignore_eos=True``.
    """
    if text is None:
        if vocab_size is None:
            raise ValueError("random prompts need vocab_size (or pass text)")
        rng = np.random.default_rng(seed)
        bodies = [rng.integers(0, vocab_size, r.prompt_len).tolist() for r in requests]
    else:
        bodies = _text_prompts(requests, text.encode())
    prompts = bodies if bos_id is None else [[bos_id] + body for body in bodies]
    if vocab_size is not None and any(t >= vocab_size for p in prompts for t in p):
        raise ValueError(f"a prompt token is outside the vocabulary of {vocab_size} ids")
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
              for r in requests]
    return prompts, params


def _text_prompts(requests: Sequence[Request], data: bytes) -> list[list[int]]:
    if not data:
        raise ValueError("text must not be empty")
    starts = [0] + [k + 1 for k, b in enumerate(data[:-1]) if b == ord("\n")]
    prompts = []
    for i, r in enumerate(requests):
        start = starts[(7 * i) % len(starts)]
        body = (data[start:] + data) * (1 + r.prompt_len // len(data))
        prompts.append(list(body[:r.prompt_len]))
    return prompts


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
