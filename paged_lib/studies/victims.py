"""Which group the engine preempts, recorded as it serves (chapter 07).

:func:`record_victims` serves requests with the engine's own victim rule
(:func:`paged_lib.engine.policy.choose_victim`) wrapped so that every question and answer
is written down: the groups offered (oldest admitted first, each with the step of its
latest admission) and the one chosen. :func:`follows_rule` checks each answer against the
rule the chapter teaches, vLLM's: the **latest admitted** goes first, the end of the
running queue (``self.running.pop()`` in vLLM v1's scheduler; the paper's §4.5: "the
latest requests are preempted first"); among groups admitted in the same step, the one
that came later in the queue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from paged_lib.engine import EngineHooks, LLMEngine
from paged_lib.engine.policy import choose_victim


class Offered(NamedTuple):
    request_id: int
    admitted_step: int  # the step of its latest admission


class VictimChoice(NamedTuple):
    """One question to ``choose_victim``: the step, the groups offered, the answer."""

    step: int
    offered: tuple[Offered, ...]
    chosen: int


def record_victims(model, prompts: Sequence[Sequence[int]], params, num_blocks: int,
                   block_size: int, **engine_options):
    """Serve ``prompts`` and return ``(outputs, stats, choices)``: every victim choice
    the scheduler made, in order (:class:`VictimChoice`)."""
    choices: list[VictimChoice] = []
    holder: dict = {}

    def recording(running):
        chosen = choose_victim(running)
        step = getattr(holder["engine"].scheduler, "step", -1)
        offered = tuple(Offered(g.request_id, g.timeline.admitted_steps[-1])
                        for g in running)
        choices.append(VictimChoice(step, offered, chosen.request_id))
        return chosen

    engine = LLMEngine(model, num_blocks, block_size,
                       hooks=EngineHooks(choose_victim=recording), **engine_options)
    holder["engine"] = engine
    outputs = engine.generate([list(p) for p in prompts], params)
    return outputs, engine.stats, choices


def follows_rule(choice: VictimChoice) -> bool:
    """Was the chosen group the latest admitted of those offered (the later in the queue
    on a tie)? The offered groups come oldest admitted first."""
    latest = max(range(len(choice.offered)),
                 key=lambda i: (choice.offered[i].admitted_step, i))
    return choice.offered[latest].request_id == choice.chosen
