"""Chapter 06's comparison timed: static batching, Orca's reservations and paging, served
for real by the same model on the same KV budget.

:func:`serve_timed` serves one set of requests with each system and reports, per system,
the steps (what chapter 02's simulator predicts from lengths alone) and the wall-clock
time and tokens per second (what the steps cost on this machine):

* ``"static"``: :class:`~paged_lib.engine.static_batching.StaticBatchingEngine`, batches
  of ``max_len`` reservations, each batch as long as its longest request (the
  FasterTransformer-style baseline);
* ``"orca-max"``, ``"orca-pow2"``, ``"orca-oracle"``: :class:`~paged_lib.engine.LLMEngine`
  with ``reservation=`` (:mod:`paged_lib.engine.reservation`): iteration-level batching
  with each request's blocks reserved when it is admitted. No watermark: a reserving
  engine never preempts, so blocks kept free at admission would only be wasted (chapter
  02's simulator admits without one too);
* ``"paged"``: the engine as every chapter runs it, blocks taken on demand.

Every system runs the same attention backend (the one ``"auto"`` picks here) and must
give every request the tokens the paged engine gives it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from paged_lib.engine import LLMEngine
from paged_lib.engine.sequence import EngineStats
from paged_lib.engine.static_batching import StaticBatchingEngine

#: The systems in the order the chapter shows them.
SYSTEMS = ("static", "orca-max", "orca-pow2", "orca-oracle", "paged")


@dataclass(frozen=True)
class TimedRun:
    """One system serving the requests: its engine and stats, and the wall time of
    ``generate``."""

    system: str
    engine: object
    stats: EngineStats
    generated_tokens: int
    seconds: float

    @property
    def steps(self) -> int:
        return self.stats.steps

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds

    @property
    def tokens_per_step(self) -> float:
        return self.generated_tokens / self.stats.steps

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / self.stats.steps


def make_engine(system: str, model, num_blocks: int, block_size: int, max_len: int,
                backend: str = "auto"):
    """The engine that serves as ``system`` (one of :data:`SYSTEMS`)."""
    if system == "static":
        if backend == "auto":
            backend = LLMEngine(model, 1, block_size, max_model_len=max_len,
                                max_num_batched_tokens=max(max_len, 256)).attention_backend
        return StaticBatchingEngine(model, num_blocks, block_size, max_len=max_len,
                                    attention_backend=backend)
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")
    reservation = "paged" if system == "paged" else system
    return LLMEngine(model, num_blocks, block_size, attention_backend=backend,
                     max_model_len=max_len, reservation=reservation,
                     watermark=0.01 if system == "paged" else 0.0)


def serve_timed(model, prompts: Sequence[Sequence[int]], params, num_blocks: int,
                block_size: int, max_len: int, systems: Sequence[str] = SYSTEMS,
                backend: str = "auto") -> dict[str, TimedRun]:
    """Serve ``prompts`` with each of ``systems`` on ``num_blocks`` blocks of
    ``block_size`` tokens; raise if a system's tokens differ from the first system's."""
    runs, first = {}, None
    for system in systems:
        engine = make_engine(system, model, num_blocks, block_size, max_len, backend)
        start = time.perf_counter()
        outs = engine.generate([list(p) for p in prompts], params)
        seconds = time.perf_counter() - start
        tokens = [[c.token_ids for c in o.outputs] for o in outs]
        if first is None:
            first = (system, tokens)
        elif tokens != first[1]:
            bad = next(i for i, (a, b) in enumerate(zip(tokens, first[1], strict=True)) if a != b)
            raise RuntimeError(f"{system}: request {bad}'s tokens differ from {first[0]}'s")
        generated = sum(len(t) for r in tokens for t in r)
        runs[system] = TimedRun(system, engine, engine.stats, generated, seconds)
    return runs
