"""A small paged serving engine (chapters 06-08), laid out like nano-vllm.

A request flows one way through one step (:meth:`LLMEngine.step`)::

    Scheduler.schedule()      pure Python: who runs, which blocks (BlockManager)
      -> SchedulerOutput      sequences, their new tokens, block copies / swaps
    ModelRunner.execute()     the only place with tensors: AttentionMetadata, the model
      -> Sampler              greedy, temperature (per-request generator), beams
    Scheduler.update()        append tokens, finish, free blocks

The teaching hooks are small pure functions a chapter's exercise re-implements; the
engine takes a replacement for each as a keyword argument (see :class:`LLMEngine`).
"""

from paged_lib.engine.llm_engine import LLMEngine
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

__all__ = ["LLMEngine", "CompletionOutput", "EngineStats", "RequestOutput", "RequestTimeline",
           "SamplingParams", "Sequence", "SequenceGroup", "SequenceStatus"]
