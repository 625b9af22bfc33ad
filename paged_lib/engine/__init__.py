"""A small paged serving engine (chapters 06-08), laid out like nano-vllm.

A request flows one way through one step (:meth:`LLMEngine.step`)::

    Scheduler.schedule()      pure Python: who runs, which blocks (BlockManager)
      -> SchedulerOutput      sequences, their new tokens, block copies / swaps
    ModelRunner.execute()     the only place with tensors: AttentionMetadata, the model
      -> sample()             greedy, temperature (per-request generator), beam candidates
    Scheduler.update()        append tokens, fork samples, pick beams, finish, free blocks

Files: ``sequence.py`` (request state, outputs, :class:`EngineStats`),
``block_manager.py``, ``scheduler.py``, ``model_runner.py``, ``sampler.py``,
``beam_search.py``, ``llm_engine.py``; ``static_batching.py`` is the "before" system,
``trace.py`` serves chapter 02's traces and compares with its simulator. The engine's
benchmark is :mod:`paged_lib.bench.engine` (``python -m paged_lib.bench engine``).

The teaching hooks are small pure functions a chapter's exercise re-implements; the
engine takes a replacement for each as a keyword argument::

    LLMEngine(model, num_blocks, build_metadata=..., admission=..., swap_mapping=...,
              beam_step=...)
"""

from paged_lib.engine.beam_search import beam_step
from paged_lib.engine.block_manager import BlockManager, swap_mapping
from paged_lib.engine.llm_engine import LLMEngine, worst_case_blocks
from paged_lib.engine.model_runner import ModelRunner, build_metadata
from paged_lib.engine.scheduler import Budget, Scheduler, SchedulerOutput, can_admit
from paged_lib.engine.sequence import (
    CompletionOutput,
    EngineStats,
    RequestOutput,
    RequestTimeline,
    SamplingParams,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from paged_lib.engine.static_batching import StaticBatchingEngine

__all__ = ["BlockManager", "Budget", "CompletionOutput", "EngineStats", "LLMEngine",
           "ModelRunner", "RequestOutput", "RequestTimeline", "SamplingParams", "Scheduler",
           "SchedulerOutput", "Sequence", "SequenceGroup", "SequenceStatus",
           "StaticBatchingEngine", "beam_step", "build_metadata", "can_admit", "swap_mapping",
           "worst_case_blocks"]
