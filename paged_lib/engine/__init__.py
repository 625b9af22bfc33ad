"""A small paged serving engine (chapters 06-10), laid out like nano-vllm.

A request flows one way through one step (:meth:`LLMEngine.step`)::

    Scheduler.schedule()      pure Python: who runs, which blocks (BlockManager)
      -> SchedulerOutput      sequences, their new tokens, block copies / swaps
    ModelRunner.execute()     the only place with tensors: AttentionMetadata, the model
      -> sample()             greedy, temperature (per-request generator), beam candidates
    Scheduler.update()        append tokens, fork samples, pick beams, finish, free blocks

Files: ``sampling_params.py`` (:class:`SamplingParams`, :class:`BeamSearchParams`: vLLM's
keywords and defaults), ``sequence.py`` (request state, outputs, :class:`EngineStats`),
``stop.py`` (when a sequence is done and why), ``detokenize.py`` (tokens to text,
with stop strings: the engine's check and the server's stream), ``outputs.py`` (vLLM's
output shapes),
``block_manager.py``, ``policy.py`` (admission and victim choice), ``scheduler.py``,
``scheduler_output.py``, ``prefill.py`` (chunked prefill), ``prefix_cache.py`` (hashed
full blocks and the LRU free queue, chapter 10), ``model_runner.py``, ``sampler.py``,
``beam_search.py``, ``llm_engine.py``, ``llm.py`` (text in, text out: vLLM's ``LLM``);
``static_batching.py`` is the "before" system,
``trace.py`` serves chapter 02's traces and compares with its simulator. The engine's
benchmark is :mod:`paged_lib.bench.engine` (``python -m paged_lib.bench engine``).

The teaching hooks are the pieces a chapter's exercise re-implements, each under the
library's own name, gathered in one :class:`~paged_lib.engine.hooks.EngineHooks` (its
docstring lists what each is asked and when)::

    LLMEngine(model, num_blocks, hooks=EngineHooks(build_metadata=..., can_admit=...,
              num_required_blocks=..., swap_mapping=..., choose_victim=..., beam_step=...,
              block_hashes=..., longest_cache_hit=..., FreeBlockQueue=..., BlockTable=...))

Each step's input to the model runner is one flat, picklable
:class:`~paged_lib.engine.model_input.ModelInput` (the same on every tensor-parallel rank),
and ``LLMEngine(..., on_step=fn)`` calls ``fn(out, stats)`` after every step.

Options: ``preemption="recompute" | "swap"``, ``scheduling="mixed" | "prefill_first"``
(Orca's iteration-level batching, or vLLM v0's prefills-then-decodes steps),
``enable_prefix_caching=True`` (full blocks named by a hash of their prefix, reused across
requests; ``stats.prefix_cache_hit_tokens``), ``enable_chunked_prefill=True`` (long prompts
prefilled in chunks of the step's ``max_num_batched_tokens``, alongside decodes),
``sliding_window=W, num_sink_tokens=S`` (chapter 11, ``window.py``: a stream keeps its
first ``S`` tokens and its last ``W`` to ``W + block_size - 1``, at positions within the
cache, as StreamingLLM does; the blocks that leave go back to the pool),
``tensor_parallel_size=T`` (chapter 12, ``tensor_parallel.py``: one worker process per
rank holds its heads' share of every block; the scheduler stays in the driver and sends
each step's block tables to every rank; ``engine.close()`` stops the workers). The
options may also be given as one :class:`~paged_lib.engine.config.EngineConfig`
(``LLMEngine(model, config=...)``), checked once; the server's flags are made from it.
"""

from paged_lib.engine.beam_search import beam_step
from paged_lib.engine.block_manager import BlockManager, num_required_blocks, swap_mapping
from paged_lib.engine.config import EngineConfig
from paged_lib.engine.hooks import EngineHooks
from paged_lib.engine.llm import LLM
from paged_lib.engine.llm_engine import LLMEngine
from paged_lib.engine.model_input import ModelInput, model_input
from paged_lib.engine.model_runner import ModelRunner, build_metadata
from paged_lib.engine.outputs import BeamSearchOutput, BeamSearchSequence
from paged_lib.engine.policy import Budget, can_admit, choose_victim
from paged_lib.engine.requests import worst_case_blocks
from paged_lib.engine.sampling_params import BeamSearchParams
from paged_lib.engine.scheduler import Scheduler
from paged_lib.engine.scheduler_output import SchedulerOutput
from paged_lib.engine.sequence import (
    CompletionOutput,
    EngineStats,
    Logprob,
    RequestOutput,
    RequestTimeline,
    SamplingParams,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from paged_lib.engine.static_batching import StaticBatchingEngine

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "BlockManager",
           "Budget", "CompletionOutput", "EngineConfig", "EngineHooks", "EngineStats",
           "LLMEngine", "Logprob", "ModelInput", "ModelRunner", "RequestOutput",
           "RequestTimeline", "SamplingParams", "Scheduler", "SchedulerOutput", "Sequence",
           "SequenceGroup", "SequenceStatus", "StaticBatchingEngine", "beam_step",
           "build_metadata", "can_admit", "choose_victim", "model_input", "num_required_blocks",
           "swap_mapping", "worst_case_blocks"]
