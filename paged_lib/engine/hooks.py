"""The engine's teaching hooks: the pieces a chapter's exercise re-implements, one name each.

Each field is named after the library's own function or class, and defaults to it. Pass
your own to :class:`~paged_lib.engine.LLMEngine` as ``hooks=EngineHooks(can_admit=mine)``;
``paged_lib.course.mine`` saves your passing pieces under the same names, and chapter 13
builds an engine out of them. What each one is asked, and when:

* ``build_metadata(block_tables, seq_lens, query_lens, block_size) -> AttentionMetadata``:
  the step's tensors (chapter 06; :func:`~paged_lib.engine.model_runner.build_metadata`);
* ``num_required_blocks(group, block_size) -> int``: free blocks a waiting group takes,
  its prompt counted once for ``n`` samples, a group preempted by recompute its shared
  prompt plus each sequence's tail (chapter 06; vLLM's ``get_num_required_blocks``);
* ``can_admit(blocks_needed, num_seqs, num_tokens, budget) -> bool``: may a waiting group
  join this step (chapter 06; :func:`~paged_lib.engine.policy.can_admit`);
* ``schedule_waiting(waiting, step) -> None``: admit waiting groups into this step with
  ``step.admit`` (chapter 06; :func:`~paged_lib.engine.policy.schedule_waiting`, the step
  a :class:`~paged_lib.engine.scheduler_step.WaitingStep`);
* ``preempt_until_fits(group, step) -> bool``: preempt until a running group's blocks fit
  (chapter 07; :func:`~paged_lib.engine.policy.preempt_until_fits`, the step a
  :class:`~paged_lib.engine.scheduler_step.RunningStep`);
* ``swap_mapping(tables, allocate) -> [(src, dst), ...]``: the block copies that move a
  group to the other pool (chapter 07);
* ``choose_victim(running) -> SequenceGroup``: which group to preempt; ``running`` lists
  the candidates in admission order, and the library picks the most recently admitted
  (chapter 07; the end of vLLM's running queue);
* ``beam_step(tables, cum_logprobs, candidates, beam_width) -> [(parent, table, token,
  cum_logprob), ...]``: one beam-search step over block tables (chapter 08);
* ``block_hashes(token_ids, block_size) -> [BlockHash, ...]``, ``longest_cache_hit(hashes,
  lookup, num_tokens, block_size) -> [block, ...]`` and ``FreeBlockQueue``, the LRU free
  queue class (chapter 10; used with ``enable_prefix_caching=True``);
* ``allocate_slots(pool, token_ids, hashes, block_size, max_new_tokens) -> (blocks,
  num_computed_tokens)``: an admitted request's table in the caching pool, its cache hit
  adopted and its first chunk's blocks allocated and registered (chapter 10; vLLM v1's
  ``KVCacheManager.allocate_slots``; used with ``enable_prefix_caching=True``);
* ``write_int8_blocks(x, data, scale, slots) -> None``: one step's K (or V) into int8
  blocks with their growing per-(block, head) scales, in place (chapter 11; used with
  ``kv_cache_dtype="int8"``; :func:`~paged_lib.kernels.kv_quant.write_int8_blocks`);
* ``drop_oldest(table, num_sink_tokens) -> (table, WindowOp)``: the sliding window's
  release of one block after the sinks (chapter 11; used with ``sliding_window``;
  :func:`~paged_lib.engine.window.drop_oldest`);
* ``BlockTable``: the class of every block table, a subclass of
  :class:`~paged_lib.blocks.BlockTable` (chapter 03's ``append_token`` and ``fork``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from paged_lib.blocks import BlockTable
from paged_lib.engine.beam_search import beam_step
from paged_lib.engine.block_manager import num_required_blocks, swap_mapping
from paged_lib.engine.model_runner import build_metadata
from paged_lib.engine.policy import (
    can_admit,
    choose_victim,
    preempt_until_fits,
    schedule_waiting,
)
from paged_lib.engine.prefix_cache import (
    FreeBlockQueue,
    allocate_slots,
    block_hashes,
    longest_cache_hit,
)
from paged_lib.engine.window import drop_oldest
from paged_lib.kernels.kv_quant import write_int8_blocks


@dataclass(frozen=True)
class EngineHooks:
    """The pieces of the engine a learner may replace (module docstring), the library's
    by default."""

    build_metadata: Callable = build_metadata
    num_required_blocks: Callable = num_required_blocks
    can_admit: Callable = can_admit
    swap_mapping: Callable = swap_mapping
    choose_victim: Callable = choose_victim
    schedule_waiting: Callable = schedule_waiting
    preempt_until_fits: Callable = preempt_until_fits
    beam_step: Callable = beam_step
    block_hashes: Callable = block_hashes
    longest_cache_hit: Callable = longest_cache_hit
    allocate_slots: Callable = allocate_slots
    write_int8_blocks: Callable = write_int8_blocks
    drop_oldest: Callable = drop_oldest
    FreeBlockQueue: type = FreeBlockQueue  # noqa: N815  (the class it replaces)
    BlockTable: type = BlockTable  # noqa: N815

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("FreeBlockQueue", "BlockTable"):
                if not isinstance(value, type):
                    raise ValueError(f"EngineHooks.{f.name} must be a class, got {value!r}")
            elif not callable(value):
                raise ValueError(f"EngineHooks.{f.name} must be callable, got {value!r}")
        if not issubclass(self.BlockTable, BlockTable):
            raise ValueError(f"EngineHooks.BlockTable must be BlockTable or a subclass of it, "
                             f"got {self.BlockTable!r}")

    def replaced(self) -> list[str]:
        """The names of the hooks that are not the library's own."""
        return [f.name for f in fields(self) if getattr(self, f.name) is not f.default]
