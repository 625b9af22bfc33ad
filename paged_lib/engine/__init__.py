"""A small paged serving engine (chapters 06-10), laid out like nano-vllm.

A request flows one way through one step (:meth:`LLMEngine.step`)::

    Scheduler.schedule()      pure Python: who runs, which blocks (BlockManager)
      -> SchedulerOutput      sequences, their new tokens, block copies / swaps
    ModelRunner.execute()     the only place with tensors: AttentionMetadata, the model
      -> sample()             greedy, temperature (per-request generator), beam candidates
    Scheduler.update()        append tokens, fork samples, pick beams, finish, free blocks

Files: ``sequence.py`` (request state, outputs, :class:`EngineStats`),
``block_manager.py``, ``policy.py`` (admission and victim choice), ``scheduler.py``,
``scheduler_output.py``, ``prefill.py`` (chunked prefill), ``prefix_cache.py`` (hashed
full blocks and the LRU free queue, chapter 10), ``model_runner.py``, ``sampler.py``,
``beam_search.py``, ``llm_engine.py``, ``llm.py`` (text in, text out: vLLM's ``LLM``);
``static_batching.py`` is the "before" system,
``trace.py`` serves chapter 02's traces and compares with its simulator. The engine's
benchmark is :mod:`paged_lib.bench.engine` (``python -m paged_lib.bench engine``).

The teaching hooks are small pure functions a chapter's exercise re-implements; the
engine takes a replacement for each as a keyword argument (default: the library's)::

    LLMEngine(model, num_blocks, build_metadata=..., admission=..., swap_mapping=...,
              beam_step=..., num_required_blocks=..., choose_victim=...,
              block_hashes=..., longest_cache_hit=..., free_queue_cls=...,
              block_table_cls=...)

* ``build_metadata(block_tables, seq_lens, query_lens, block_size) -> AttentionMetadata``
  (:func:`~paged_lib.engine.model_runner.build_metadata`, chapter 06);
* ``admission(blocks_needed, num_seqs, num_tokens, budget) -> bool``: may a waiting group
  join this step? (:func:`~paged_lib.engine.policy.can_admit`, chapter 06);
* ``num_required_blocks(group, block_size) -> int``: free blocks a waiting group takes,
  its prompt counted once for ``n`` samples, a group preempted by recompute its shared
  prompt plus each sequence's tail (:func:`~paged_lib.engine.block_manager.
  num_required_blocks`; vLLM's ``get_num_required_blocks``); ``admission`` gets its answer;
* ``choose_victim(running: list[SequenceGroup]) -> SequenceGroup``: which group to
  preempt, among those offered, oldest first (:func:`~paged_lib.engine.policy.
  choose_victim`: the most recently admitted, chapter 07); a group not offered is a
  ``ValueError``;
* ``swap_mapping(tables, allocate) -> [(src, dst), ...]``
  (:func:`~paged_lib.engine.block_manager.swap_mapping`, chapter 07);
* ``beam_step(tables, cum_logprobs, candidates, beam_width) -> [(parent, table, token,
  cum_logprob), ...]`` (:func:`~paged_lib.engine.beam_search.beam_step`, chapter 08): the
  engine calls it every step with each beam's ``beam_width`` best candidates that are not
  EOS (EOS ones among the best ``beam_width`` become finished hypotheses first); at
  ``max_tokens`` the beams it picks all finish;
* with ``enable_prefix_caching=True`` (chapter 10): ``block_hashes(token_ids, block_size)
  -> [BlockHash, ...]``, one chained hash per full block
  (:func:`~paged_lib.engine.prefix_cache.block_hashes`); ``longest_cache_hit(hashes,
  lookup, num_tokens, block_size) -> [block, ...]``, the cached blocks a prompt reuses, the
  last token always computed (:func:`~paged_lib.engine.prefix_cache.longest_cache_hit`);
  ``free_queue_cls``, the LRU free queue of cached blocks
  (:class:`~paged_lib.engine.prefix_cache.FreeBlockQueue`);
* ``block_table_cls``: a subclass of :class:`~paged_lib.blocks.BlockTable` (its
  ``append_token`` and ``fork``, chapter 03), the class of every table the block manager
  makes (chapter 13 serves the learner's).

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
each step's block tables to every rank; ``engine.close()`` stops the workers).
"""

from paged_lib.engine.beam_search import beam_step
from paged_lib.engine.block_manager import BlockManager, num_required_blocks, swap_mapping
from paged_lib.engine.llm import LLM
from paged_lib.engine.llm_engine import LLMEngine, worst_case_blocks
from paged_lib.engine.model_runner import ModelRunner, build_metadata
from paged_lib.engine.policy import Budget, can_admit, choose_victim
from paged_lib.engine.scheduler import Scheduler
from paged_lib.engine.scheduler_output import SchedulerOutput
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

__all__ = ["LLM", "BlockManager", "Budget", "CompletionOutput", "EngineStats", "LLMEngine",
           "ModelRunner", "RequestOutput", "RequestTimeline", "SamplingParams", "Scheduler",
           "SchedulerOutput", "Sequence", "SequenceGroup", "SequenceStatus",
           "StaticBatchingEngine", "beam_step", "build_metadata", "can_admit", "choose_victim",
           "num_required_blocks", "swap_mapping", "worst_case_blocks"]
