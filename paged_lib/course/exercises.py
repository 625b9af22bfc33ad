"""Every exercise of the course, once: the one table graders, ``mine/`` and chapter 13 read.

Each :class:`Exercise` says

* its id and title, as the ``### Exercise NN.k: Title`` heading of its solution notebook
  writes them (``tests/test_exercises.py`` compares the two);
* its **twins**: every library function that does the exercise's job, the top-level one
  first and then the helpers it calls that would do the job too. While the exercise's
  check runs, each refuses to be called by the learner's code
  (:func:`paged_lib.course.grading.exercise`);
* for an engine piece, the ``name`` its stub defines (what :mod:`paged_lib.course.mine`
  saves and exports, and chapter 13 loads), the ``role`` it plays in the engine, the
  :class:`paged_lib.engine.EngineHooks` field it fills (``hook``, when the engine takes it
  as a hook).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    id: str                      # "06.3"
    title: str                   # the notebook heading's title
    twins: tuple[str, ...] = ()  # dotted names of the library functions that do its job
    name: str | None = None      # the piece saved to mine/chNN.py (None: not saved)
    role: str = ""               # what the saved piece does in the engine
    hook: str | None = None      # the EngineHooks field it fills

    @property
    def chapter(self) -> str:
        """``"06"`` for 06.3: its notebook's number, its grader's ``chNN``, ``mine/chNN.py``."""
        return self.id.split(".")[0]

    @property
    def saved(self) -> bool:
        """Whether a passing check saves the learner's code to ``mine/``."""
        return self.name is not None


_BS = "paged_lib.studies.block_size."
_DEC = "paged_lib.serve.detokenize."
_ENG = "paged_lib.engine."
_FRAG = "paged_lib.fragmentation."
_PAR = "paged_lib.parallel."
_PC = "paged_lib.engine.prefix_cache."
_GR = "paged_lib.course.grading."
_WASTE = (f"{_BS}internal_waste", f"{_FRAG}request.request_slots",
          f"{_FRAG}request.reservation")
_HEADS = (f"{_PAR}kv_heads_per_rank", f"{_PAR}kv_head_replicas")


def _ex(ex_id: str, title: str, *twins: str, **piece) -> Exercise:
    return Exercise(ex_id, title, twins, **piece)


_ALL = [
    # 00.1, 01.2: every ceil division a learner can call (Triton's host-side one too)
    _ex("00.1", "Ceil division", "paged_lib.util.cdiv", "paged_lib.accounting.num_blocks",
        "triton.cdiv"),
    # 01.1: every library function whose number for one token (one rank, one block of
    # one token) is the bytes per token
    _ex("01.1", "KV bytes per token", "paged_lib.accounting.kv_bytes_per_token",
        "paged_lib.accounting.kv_bytes", f"{_PAR}kv_bytes_per_rank",
        "paged_lib.studies.tp_layout.kv_bytes_per_rank",
        "paged_lib.studies.kv_quant_eval.kv_bytes_per_token_quant",
        "paged_lib.course.demos.engine_compare.kv_bytes_per_block",
        "paged_lib.bench.floor.kv_bytes_per_token"),
    _ex("01.2", "Logical blocks", "paged_lib.accounting.num_blocks", "paged_lib.util.cdiv",
        "triton.cdiv"),
    # (a grader's own reference is a twin too: the learner can import it)
    _ex("01.3", "Last-block fill", f"{_GR}generated.small_ints.fill"),
    _ex("01.4", "Requests that fit in a KV budget"),
    _ex("02.1", "Which waste does each mechanism remove?"),
    _ex("02.2", "Orca (Max) accounting", f"{_FRAG}request_slots"),
    _ex("02.3", "Both fragmentations, derived with numbers", f"{_GR}ch02.derivation_answers"),
    _ex("02.4", "A batch snapshot", f"{_GR}ch02.batch_snapshot"),
    _ex("02.5", "A time-stepped paged simulator", f"{_FRAG}simulate_timeline",
        f"{_FRAG}simulators._run_paged", f"{_GR}generated.small_sim.reference_paged"),
    _ex("03.1", "`append_token`, with copy-on-write", "paged_lib.blocks.BlockTable.append_token",
        f"{_ENG}block_manager.BlockManager.append_slot",
        name="append_token", role="block table: a token's slot, copy-on-write"),
    _ex("03.2", "`fork`", "paged_lib.blocks.BlockTable.fork",
        name="fork", role="block table: fork, sharing every block"),
    _ex("03.3", "Free with reference counts", "paged_lib.blocks.BlockAllocator.free",
        "paged_lib.blocks.BlockTable.free",
        name="free_block", role="allocator: free with reference counts"),
    _ex("03.4", "Predict the reference counts", f"{_GR}ch03.prediction_scenario"),
    _ex("04.1", "Merge two partial softmax states", "paged_lib.attention.merge",
        "paged_lib.attention.merge_states"),
    _ex("04.2", "Attention through a block table, one block at a time",
        "paged_lib.attention.paged_blockwise_attention"),
    _ex("04.3", "FlashAttention vs PagedAttention"),
    _ex("05.1", "A 2-D masked tile"),
    _ex("05.2", "Gather rows through a table"),
    _ex("05.3", "Row softmax"),
    _ex("05.4", "Online softmax over contiguous K"),
    _ex("05.5", "Paged decode kernel", "paged_lib.kernels.triton_decode._paged_decode_kernel",
        name="paged_decode_kernel", role="Triton decode kernel through block tables"),
    _ex("05.6", "Slot mapping", "paged_lib.kernels.slot_mapping_from_positions",
        name="slot_mapping", role="slot mapping: where each new token's K/V goes"),
    _ex("05.7", "Merge split-KV partials", "paged_lib.attention.merge_partials",
        "paged_lib.attention.merge_states", "paged_lib.kernels.torch_backend.merge_segments"),
    _ex("06.1", "`slot_mapping` and padded block tables", f"{_ENG}model_runner.build_metadata",
        "paged_lib.kernels.slot_mapping_from_positions",
        name="build_metadata", role="attention metadata: slots, padded tables",
        hook="build_metadata"),
    _ex("06.2", "Blocks a waiting group needs", f"{_ENG}block_manager.num_required_blocks",
        f"{_ENG}block_manager.shared_prompt_blocks",
        name="num_required_blocks", role="admission: blocks a waiting group needs",
        hook="num_required_blocks"),
    _ex("06.3", "The admission check", f"{_ENG}policy.can_admit",
        name="can_admit", role="admission: may a group join this step",
        hook="can_admit"),
    _ex("06.4", "Admitting the waiting queue", f"{_ENG}policy.schedule_waiting",
        f"{_ENG}policy.can_admit", f"{_ENG}policy.seqs_to_come",
        name="schedule_waiting", role="admission: the waiting queue, in order",
        hook="schedule_waiting"),
    _ex("07.1", "The swap mapping", f"{_ENG}block_manager.swap_mapping",
        name="swap_mapping", role="preemption: swap mapping", hook="swap_mapping"),
    _ex("07.2", "Which group to preempt", f"{_ENG}policy.choose_victim",
        name="choose_victim", role="preemption: which group to preempt", hook="choose_victim"),
    # (07.3 asks step.hooks.choose_victim: the library's rule, or another the engine was given)
    _ex("07.3", "Preempting until the blocks fit", f"{_ENG}policy.preempt_until_fits",
        f"{_ENG}policy.preempt",
        name="preempt_until_fits", role="preemption: victims until the step fits",
        hook="preempt_until_fits"),
    # 08.1: the library's block copy does the copy-on-write half of the exercise
    _ex("08.1", "Copy-on-write in the cache", "paged_lib.studies.sharing.apply_slot",
        "paged_lib.kernels.copy_blocks.copy_blocks",
        "paged_lib.kernels.cache_ops.copy_blocks_in_pool"),
    _ex("08.2", "One step of beam search over block tables", f"{_ENG}beam_search.beam_step",
        name="beam_step", role="beam search: one step over block tables", hook="beam_step"),
    _ex("09.1", "Internal waste of a trace", *_WASTE),
    _ex("09.2", "Choosing a block size", f"{_BS}choose_block_size", *_WASTE),
    # (chapter 04 shows the torch backend's decode and the reference's gather: reading
    # whole segments or sequences at once, they fail the check's reads rule anyway)
    _ex("09.3", "Tiles that are not blocks", "paged_lib.kernels.paged_attention",
        "paged_lib.kernels.paged_prefill", "paged_lib.kernels.torch_backend.paged_prefill_torch",
        "paged_lib.kernels.torch_backend.merge_segments",
        "paged_lib.kernels.reference.flex_paged_attention",
        "paged_lib.attention.paged_blockwise_attention", "paged_lib.attention.blockwise_attention",
        "paged_lib.attention.merge_partials", "paged_lib.attention.merge_states",
        "paged_lib.attention.merge", "paged_lib.kernels.cpu_decode.paged_attention_cpu"),
    _ex("10.1", "A prompt's block hashes", f"{_PC}block_hashes",
        name="block_hashes", role="prefix cache: chained block hashes", hook="block_hashes"),
    _ex("10.2", "The cache hit", f"{_PC}longest_cache_hit",
        name="longest_cache_hit", role="prefix cache: the cached blocks a prompt reuses",
        hook="longest_cache_hit"),
    # (10.3's class has two methods: its check refuses FreeBlockQueue.popleft itself)
    _ex("10.3", "The LRU free queue's popleft and remove", f"{_PC}FreeBlockQueue.remove",
        name="LRUFreeQueue", role="prefix cache: the LRU free queue", hook="FreeBlockQueue"),
    # 10.4: the pool's own methods do the steps the exercise asks for
    _ex("10.4", "A new request's table in the caching pool", f"{_PC}allocate_slots",
        f"{_PC}longest_cache_hit", f"{_PC}PrefixCachingAllocator.touch",
        f"{_PC}PrefixCachingAllocator.allocate", f"{_PC}PrefixCachingAllocator.cache_block",
        f"{_PC}PrefixCachingAllocator._evict",
        name="allocate_slots", role="prefix cache: a new request's table, hit and chunk",
        hook="allocate_slots"),
    _ex("11.1", "Three levels of saving, combined",
        "paged_lib.course.grading.ch11.reference_levels"),
    _ex("11.2", "KV bytes per token, MLA included", "paged_lib.accounting.kv_bytes_per_token",
        "paged_lib.accounting.kv_bytes", f"{_PAR}kv_bytes_per_rank",
        "paged_lib.studies.tp_layout.kv_bytes_per_rank",
        "paged_lib.studies.kv_quant_eval.kv_bytes_per_token_quant",
        "paged_lib.course.demos.engine_compare.kv_bytes_per_block",
        "paged_lib.bench.floor.kv_bytes_per_token"),
    _ex("11.3", "The int8 block write, with a scale that grows",
        "paged_lib.kernels.kv_quant.write_int8_blocks",
        "paged_lib.kernels.kv_quant.write_quantized",
        "paged_lib.course.grading.ch11_quant.reference_write",
        name="write_int8_blocks", role="int8 KV cache: the block write, its scale grows",
        hook="write_int8_blocks"),
    _ex("11.4", "The sliding window's block release, with sinks", f"{_ENG}window.drop_oldest",
        f"{_ENG}window.SlidingWindow.slide", "paged_lib.course.grading.ch11.reference_drop",
        name="drop_oldest", role="sliding window: release a block after the sinks",
        hook="drop_oldest"),
    _ex("12.1", "KV bytes per rank", f"{_PAR}kv_bytes_per_rank", *_HEADS),
    _ex("12.2", "Which rank owns which head", f"{_PAR}rank_heads", *_HEADS),
    _ex("12.3", "One rank's attention, all-reduced", f"{_PAR}rank_attention",
        f"{_PAR}heads_attention", f"{_PAR}rank_heads", f"{_PAR}shard_state_dict",
        f"{_ENG}tensor_parallel.use_rank_attention", *_HEADS,
        name="rank_attention", role="tensor parallel: one rank's attention, all-reduced"),
    _ex("14.1", "Streaming text with stop strings", f"{_DEC}IncrementalDetokenizer.add",
        f"{_DEC}IncrementalDetokenizer._release"),
]

#: exercise id -> :class:`Exercise`, in the course's order
EXERCISES: dict[str, Exercise] = {e.id: e for e in _ALL}
#: the engine pieces a passing check saves to ``mine/`` (chapter 13's engine is built of them)
SAVED: dict[str, Exercise] = {k: e for k, e in EXERCISES.items() if e.saved}
#: the engine pieces the engine takes as hooks: exercise id -> ``EngineHooks`` field
HOOKS: dict[str, str] = {k: e.hook for k, e in EXERCISES.items() if e.hook}


def get(ex_id: str) -> Exercise:
    """The exercise ``ex_id`` (``KeyError`` for an id the course does not have)."""
    return EXERCISES[ex_id]


def title_text(ex_id: str) -> str:
    """The title as a verdict line prints it: the heading's, without Markdown backticks."""
    return EXERCISES[ex_id].title.replace("`", "")
