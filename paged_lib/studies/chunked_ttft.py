"""What chunked prefill costs the prompt it chunks: time to first token, measured.

Chunked prefill (vLLM v1's one token budget per step, ``max_num_batched_tokens``) caps
every step, so requests that are decoding keep getting tokens while a long prompt is
prefilled. The price falls on the long prompt: its first token comes only after its last
chunk, several steps after it arrived, and each chunk's queries read the chunks before
it back from the cache. :func:`measure_ttft` serves one trace under several engine
configurations and reports, per configuration, each request's **time to first token**
(TTFT) twice:

* in **engine steps**, from the step it arrived in to the step that sampled its first
  token, both counted (a prompt prefilled in the step it arrives in: 1 step) -
  deterministic;
* in **seconds** of wall clock over those steps (:attr:`EngineStats.step_seconds`:
  scheduler, model and sampler) - this machine's, noisy: with ``repeats=k`` the trace is
  served ``k`` times (the same schedule each time) and each step's median is kept.

With the step's largest token count and the longest step, which is what chunking
buys. The engine is the library's; nothing is changed, an ``on_step`` callback watches.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TTFTRun:
    """One configuration's run of the trace."""

    name: str
    ttft_steps: list[int]        # per request, in prompt order
    ttft_seconds: list[float]    # per request, wall clock over the same steps
    max_step_tokens: int         # the most tokens any step computed
    step_seconds: list[float]    # every step's wall clock
    tokens: list[list[int]]      # every request's generated tokens (they must not change)

    def mean_ttft_steps(self, requests: Sequence[int]) -> float:
        return sum(self.ttft_steps[i] for i in requests) / len(requests)

    def mean_ttft_seconds(self, requests: Sequence[int]) -> float:
        return sum(self.ttft_seconds[i] for i in requests) / len(requests)


def serve_and_time(model, prompts: Sequence[list[int]], params, arrival_steps: Sequence[int],
                   name: str = "", num_blocks: int = 64, block_size: int = 8,
                   repeats: int = 1, **engine_options) -> TTFTRun:
    """Serve the trace ``repeats`` times, each on a fresh
    :class:`~paged_lib.engine.LLMEngine` (``engine_options`` such as
    ``enable_chunked_prefill=True, max_num_batched_tokens=48``), and time every request's
    first token (each step's median wall clock over the repeats)."""
    from paged_lib.engine import LLMEngine

    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    timings = []
    for _ in range(repeats):
        first: dict[int, int] = {}  # request id -> step that sampled its first token

        def watch(out, stats, first=first) -> None:
            for sc in out.scheduled:
                rid = sc.group.request_id
                if rid not in first and any(s.output_token_ids for s in sc.group.seqs):
                    first[rid] = out.step

        engine = LLMEngine(model, num_blocks, block_size, on_step=watch, **engine_options)
        outs = engine.generate([list(p) for p in prompts], params, list(arrival_steps))
        timings.append(engine.stats.step_seconds)
    if len({len(t) for t in timings}) != 1:
        raise RuntimeError("the repeats ran different numbers of steps")
    seconds = [statistics.median(step) for step in zip(*timings, strict=True)]
    steps, wall = [], []
    for i, arrival in enumerate(arrival_steps):
        if i not in first:
            raise RuntimeError(f"request {i} never produced a token: {outs[i].error}")
        steps.append(first[i] - arrival + 1)
        wall.append(sum(seconds[arrival:first[i] + 1]))
    return TTFTRun(name, steps, wall, max(engine.stats.computed_tokens), seconds,
                   [o.outputs[0].token_ids for o in outs])


def measure_ttft(model, prompts: Sequence[list[int]], params, arrival_steps: Sequence[int],
                 configs: Mapping[str, dict], num_blocks: int = 64, block_size: int = 8,
                 repeats: int = 1) -> dict[str, TTFTRun]:
    """:func:`serve_and_time` for every ``{name: engine options}`` in ``configs``; the
    generated tokens must be the same in all (a ``RuntimeError`` otherwise: a
    configuration that changes tokens is a bug, not a trade-off)."""
    runs = {name: serve_and_time(model, prompts, params, arrival_steps, name, num_blocks,
                                 block_size, repeats, **options)
            for name, options in configs.items()}
    first = next(iter(runs.values()))
    for run in runs.values():
        if run.tokens != first.tokens:
            raise RuntimeError(f"{run.name!r} generated other tokens than {first.name!r}")
    return runs


def budget_configs(budgets: Sequence[int]) -> dict[str, dict]:
    """The engine's default (whole prompts in mixed steps) and chunked prefill at each
    token budget, as :func:`measure_ttft`'s ``configs``."""
    configs: dict[str, dict] = {"whole prompts": {}}
    for b in budgets:
        configs[f"chunks of {b}"] = dict(enable_chunked_prefill=True,
                                         max_num_batched_tokens=b, max_num_seqs=b)
    return configs
