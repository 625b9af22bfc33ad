"""Checks for chapter 06 (the serving engine).

* 06.1 ``build_metadata``: one step's tensors from the batch's block tables. Compared
  field by field with :func:`paged_lib.engine.model_runner.build_metadata` on hand-made
  batches (prefill and decode mixed, tables in scrambled block order, full last blocks,
  block size 1), every batch the engine builds (replayed) and random workloads; dtypes
  are part of the answer. A wrong slot is named by recomputing the typical mistakes
  (logical block, position as offset, new tokens counted from 0).
* 06.2 ``num_required_blocks`` and 06.3 ``can_admit``: how many blocks a waiting group
  takes, and whether it may join the step (:mod:`paged_lib.course.grading.ch06_admission`).
* 06.4 ``schedule_waiting``: the whole admission loop, plugged into the engine and
  compared call by call with the library's (:mod:`paged_lib.course.grading.ch06_waiting`).

:func:`run_demo` then serves the chapter's trace with the learner's three functions plugged
into :class:`~paged_lib.engine.LLMEngine` (``hooks=EngineHooks(build_metadata=...,
num_required_blocks=..., can_admit=...)``), then chapter 07's pressure trace, whose
preempted groups of two samples come back through ``num_required_blocks``, and compares
everything with the library's runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from paged_lib.course import grading
from paged_lib.course.grading import generated, replay, serving
from paged_lib.course.grading.ch06_admission import check_can_admit, check_num_required_blocks
from paged_lib.course.grading.ch06_waiting import check_schedule_waiting
from paged_lib.course.grading.generated import small_engine
from paged_lib.engine.model_runner import build_metadata as lib_build_metadata
from paged_lib.model import AttentionMetadata

__all__ = ["check_build_metadata", "check_can_admit",
           "check_num_required_blocks", "check_schedule_waiting", "run_demo"]


# ------------------------------------------------------------------ 06.1 build_metadata

#: name, block tables, seq_lens, query_lens, block size
_BATCHES: list[tuple[str, list[list[int]], list[int], list[int], int]] = [
    ("the spec's example: a decode of 6 tokens over blocks [7, 2] next to a 3-token "
     "prefill in block 5 (block size 4)", [[7, 2], [5]], [6, 3], [1, 3], 4),
    ("three decodes, tables of different widths, blocks out of order (block size 4)",
     [[3], [5, 0, 9], [8, 1]], [3, 10, 5], [1, 1, 1], 4),
    ("a prefill of 7 next to two decodes (block size 4)",
     [[2, 6], [4, 11, 1], [0]], [7, 9, 2], [7, 1, 1], 4),
    ("a re-prefill of 9 tokens whose last block is full (block size 3)",
     [[5, 1, 8], [2, 0]], [9, 5], [9, 1], 3),
    ("block size 1: one token per block", [[4, 2, 7], [1]], [3, 1], [1, 1], 1),
]


_DTYPES = {"slot_mapping": torch.int64, "block_tables": torch.int32, "seq_lens": torch.int32,
           "query_lens": torch.int32, "positions": torch.int64}
_FIELD_HINTS = {
    "seq_lens": "seq_lens[s] is the tokens in the cache after this step: the value you "
                "were given, as an int32 tensor",
    "query_lens": "query_lens[s] is the new tokens of sequence s: the value you were given",
}


def check_build_metadata(build_metadata: Callable[..., Any]) -> None:
    """``build_metadata(block_tables, seq_lens, query_lens, block_size) -> AttentionMetadata``."""
    with grading.exercise("06.1"):
        for batch in _BATCHES:
            _check_batch(build_metadata, *batch)
        for call in replay.recorded()["build_metadata"]:  # every state the engine reaches
            _check_batch(build_metadata, f"the engine's call in '{call.workload}', at engine "
                         f"step {call.step}", *call.args)
        generated.check("build_metadata", build_metadata, "every new token's slot is its "
                        "position's block in the table, at position % block_size")
        small_engine.metadata_stage(build_metadata, _check_batch)  # pools past 2**31 slots


def _check_batch(fn, name, tables, seq_lens, query_lens, block_size) -> None:
    given = [list(t) for t in tables]
    got = fn(given, list(seq_lens), list(query_lens), block_size)
    want = lib_build_metadata(tables, seq_lens, query_lens, block_size)
    where = f"batch '{name}'"
    if given != tables:
        grading.fail(f"{where}: your function changed the block tables it was given "
                     f"({tables} became {given})",
                     "the lists are the sequences' own tables: build new padded rows "
                     "instead of appending -1 to them")
    grading.expect_true(isinstance(got, AttentionMetadata),
                        f"{where}: expected an AttentionMetadata, got {type(got).__name__}",
                        "return AttentionMetadata(slot_mapping=..., block_tables=..., "
                        "seq_lens=..., query_lens=..., positions=...)")
    for field, dtype in _DTYPES.items():
        value = getattr(got, field)
        grading.expect_true(isinstance(value, torch.Tensor),
                            f"{where}: {field} is a {type(value).__name__}, not a tensor",
                            f"make {field} a torch tensor of dtype {dtype}")
        grading.expect_true(value.dtype == dtype,
                            f"{where}: {field} has dtype {value.dtype}, expected {dtype}",
                            _dtype_hint(field, dtype))
    _check_block_tables(got.block_tables, want.block_tables, tables, where)
    _check_slots(got, want, tables, seq_lens, query_lens, block_size, where)
    for field in ("seq_lens", "query_lens"):
        grading.expect_equal(getattr(got, field).tolist(), getattr(want, field).tolist(),
                             f"{where}: {field}", _FIELD_HINTS[field])


def _dtype_hint(field: str, dtype: torch.dtype) -> str:
    if field == "slot_mapping":
        return ("slot_mapping is int64: block * block_size + offset outgrows int32 in a "
                "large pool (vLLM uses int64 too)")
    if field == "positions":
        return "positions are int64 (they index the rotary embedding table)"
    return f"{field} is {dtype}, the dtype the kernels take"


def _check_block_tables(got: torch.Tensor, want: torch.Tensor, tables, where: str) -> None:
    if tuple(got.shape) != tuple(want.shape):
        grading.fail(f"{where}: block_tables has shape {tuple(got.shape)}, expected "
                     f"{tuple(want.shape)}",
                     "one row per sequence, as wide as the longest table (no wider)")
    if torch.equal(got, want):
        return
    pad = want == -1
    if pad.any() and torch.equal(got[~pad], want[~pad]):
        filler = sorted({int(v) for v in got[pad].tolist()})
        grading.fail(f"{where}: block_tables pads short rows with {filler}, expected -1",
                     "pad with -1, never with a block id such as 0: block 0 may belong to "
                     "another sequence, and -1 can never be allocated")
    grading.fail(f"{where}: block_tables is {got.tolist()}, expected {want.tolist()}",
                 "row s is the sequence's own table, in logical order, then -1 padding")


def _check_slots(got, want, tables, seq_lens, query_lens, block_size, where) -> None:
    slots, wslots = got.slot_mapping.tolist(), want.slot_mapping.tolist()
    positions, wpos = got.positions.tolist(), want.positions.tolist()
    if len(slots) != len(wslots):
        if len(slots) == sum(seq_lens):
            hint = ("only the new tokens get a slot: the last query_lens[s] positions of "
                    "sequence s (earlier tokens are in the cache already)")
        else:
            hint = "one slot per new token, sequences packed back to back: sum(query_lens)"
        grading.fail(f"{where}: slot_mapping has {len(slots)} entries, expected {len(wslots)}",
                     hint)
    if slots != wslots:
        k = next(i for i, (a, b) in enumerate(zip(slots, wslots, strict=True)) if a != b)
        physical = _physical_blocks(tables, seq_lens, query_lens, block_size)
        if slots == wpos:
            hint = ("slot = block * block_size + offset with the *physical* block: look it "
                    "up in the sequence's table (position // block_size is only the logical "
                    "block)")
        elif slots == [b * block_size + p for b, p in zip(physical, wpos, strict=True)]:
            hint = "the offset inside the block is position % block_size, not the position"
        elif slots == [t[p // block_size] * block_size + p % block_size
                       for t, q in zip(tables, query_lens, strict=True) for p in range(q)]:
            hint = ("the tokens a step computes are each sequence's newest: the ones before "
                    "them are in the cache already (a decode's one token is its last, at "
                    "position seq_lens[s] - 1, not 0)")
        else:
            hint = ("token at position p of sequence s: physical block "
                    "block_tables[s][p // block_size], offset p % block_size")
        grading.fail(f"{where}: slot_mapping[{k}] is {slots[k]}, expected {wslots[k]} "
                     f"(token at position {wpos[k]})", hint)
    grading.expect_equal(positions, wpos, f"{where}: positions",
                         "the new tokens of sequence s sit at positions "
                         "seq_lens[s] - query_lens[s] ... seq_lens[s] - 1")


def _physical_blocks(tables, seq_lens, query_lens, block_size) -> list[int]:
    """The physical block of every new token, in slot_mapping order."""
    return [t[p // block_size] for t, n, q in zip(tables, seq_lens, query_lens, strict=True)
            for p in range(n - q, n)]


# ------------------------------------------------------------------ the demo


def run_demo(build_metadata: Callable[..., Any], num_required_blocks: Callable[..., Any],
             can_admit: Callable[..., Any], model: Any = None,
             schedule_waiting: Callable[..., Any] | None = None) -> list[Any]:
    """Serve the chapter's trace with the learner's functions inside the engine (the
    three, and ``schedule_waiting`` when given).

    Prints what the run did and whether every token and every step's numbers equal the
    library engine's; then serves chapter 07's pressure trace (recompute: preempted
    groups of two samples come back with their shared prompt) with the learner's
    admission the same way. Returns the chapter's two figures drawn from the learner's run.
    """
    from paged_lib.course.demos import engine_compare as ec
    from paged_lib.course.viz import engine as viz
    from paged_lib.engine import EngineHooks
    from paged_lib.model import load_tiny_code_llama

    model = model if model is not None else load_tiny_code_llama()
    hooks = EngineHooks(can_admit=can_admit, build_metadata=build_metadata,
                        num_required_blocks=num_required_blocks,
                        **({} if schedule_waiting is None else
                           {"schedule_waiting": schedule_waiting}))

    def run():
        def said(same: bool) -> str:
            return "equal" if same else "DIFFER from"
        trace = ec.chapter_trace()
        r = serving.side_by_side(model, ec.NUM_BLOCKS, ec.BLOCK_SIZE,
                                 *ec.chapter_requests(trace), hooks)
        s = r.yours.stats
        print(f"your engine served {len(r.outs)} requests in {s.steps} steps "
              f"({s.generated_tokens} tokens, {s.preemptions} preemptions, "
              f"peak {s.peak_blocks_used} of {s.num_blocks} blocks)")
        print(f"tokens {said(r.same_tokens)} the library engine's; batch sizes and blocks "
              f"per step {said(r.same_steps)} it")
        r7 = serving.side_by_side(model, ec.PRESSURE_BLOCKS, ec.PRESSURE_BLOCK_SIZE,
                                  *ec.pressure_requests(), hooks)
        print(f"chapter 07's pressure trace ({len(r7.outs)} requests on "
              f"{r7.yours.stats.num_blocks} blocks, {r7.yours.stats.preemptions} "
              f"preemptions): tokens {said(r7.same_tokens)} the library's; steps "
              f"{said(r7.same_steps)} it")
        return [viz.plot_batching({"paged (your engine)": s,
                                   "static, max-length": ec.static_stats(trace)}),
                viz.plot_timeline(s, "your engine: requests over time")]

    return grading.on_learner_code(run, "exercises 06.1-06.4",
                                   "the engine with your functions") or []
