"""Checks for chapter 08 (sharing: copy-on-write, parallel sampling, beam search).

* 08.1 ``apply_slot``: the cache side of copy-on-write, on the notes' exercise 4 (four
  samples share the prompt's block 7; sample 3 writes first). The learner's function
  writes into a NaN-poisoned cache next to the library's; after every write the check
  compares the block other samples still read, the copied block, the new token, and
  every sample's K/V read back through its block table.
* 08.2 ``beam_step``: one step of beam search over block tables, replayed next to
  :func:`paged_lib.sharing.beam_step` on scripted and seeded random steps; after every
  step it compares who died, the new tables, the slots (copies), the ref counts and free
  list, and every beam's tokens read back from a toy store that applies each slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from paged_lib import grading, sharing
from paged_lib.blocks import BlockAllocator, BlockTable, OutOfBlocks, Slot
from paged_lib.kernels.reference import gather_kv

#: Exercise id -> the library object the learner's code re-implements.
TWINS: dict[str, str] = {
    "08.1": "paged_lib.sharing.apply_slot",
    "08.2": "paged_lib.sharing.beam_step",
}


def _busy_pool(num_blocks: int, free_in_order: tuple[int, ...]) -> BlockAllocator:
    allocator = BlockAllocator(num_blocks)
    for _ in range(num_blocks):
        allocator.allocate()
    for b in free_in_order:
        allocator.free(b)
    return allocator


# ------------------------------------------------------------------ 08.1 apply_slot

# name, block size, prompt length, samples, new tokens each, dtype
_COW_SCENARIOS = [
    ("notes exercise 4: 4 samples share block 7 (block size 4, prompt of 3)", 4, 3, 4, 3,
     torch.float32),
    ("2 samples, prompt of 5, block size 4, float16", 4, 5, 2, 5, torch.float16),
    ("a prompt that fills its blocks exactly (no copy needed)", 2, 4, 3, 2, torch.float32),
]
_KV_HEADS, _HEAD_DIM = 2, 8


def notes_exercise_4() -> dict[str, Any]:
    """The notes' exercise 4 with the library: the flow and the ref counts, step by step."""
    allocator = _busy_pool(12, (7, 3, 9, 10, 11))
    prompt = BlockTable(allocator, 4)
    for _ in range(3):
        prompt.append_token()
    samples = [prompt] + [prompt.fork() for _ in range(3)]
    out: dict[str, Any] = {"prompt blocks": prompt.blocks, "ref 7 after forks":
                           allocator.refcount(7)}
    slot = samples[2].append_token()
    out["sample 3 writes"] = slot
    out["refs after"] = {7: allocator.refcount(7), slot.block: allocator.refcount(slot.block)}
    return out


def check_apply_slot(apply_slot: Callable[..., Any]) -> None:
    """``apply_slot(k_cache, v_cache, slot, key, value) -> None`` (in place)."""
    with grading.exercise("08.1", "Copy-on-write in the cache"):
        for scenario in _COW_SCENARIOS:
            _run_cow_scenario(apply_slot, *scenario)


def _run_cow_scenario(apply_slot, name, block_size, prompt_len, n, new_tokens, dtype):
    g = torch.Generator().manual_seed(block_size * 100 + prompt_len)
    allocator = _busy_pool(12, (7, 3, 9, 10, 11, 4, 2, 8, 5, 6, 0, 1))
    shape = (12, block_size, _KV_HEADS, _HEAD_DIM)
    caches = {who: (torch.full(shape, float("nan"), dtype=dtype),
                    torch.full(shape, float("nan"), dtype=dtype)) for who in ("mine", "ref")}
    prompt = BlockTable(allocator, block_size)
    history: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]

    def write(i: int, table: BlockTable, what: str) -> None:
        key = torch.randn(_KV_HEADS, _HEAD_DIM, generator=g).to(dtype)
        value = torch.randn(_KV_HEADS, _HEAD_DIM, generator=g).to(dtype)
        slot = table.append_token()
        sharing.apply_slot(*caches["ref"], slot, key.clone(), value.clone())
        apply_slot(*caches["mine"], slot, key.clone(), value.clone())
        history[i].append((key, value))
        _compare(caches, slot, f"scenario '{name}', {what} (slot {_slot_str(slot)})")
        _check_readback(caches["mine"], tables, history, f"scenario '{name}', {what}")

    tables = [prompt]
    for t in range(prompt_len):
        write(0, prompt, f"prompt token {t}")
    tables += [prompt.fork() for _ in range(n - 1)]
    history += [list(history[0]) for _ in range(n - 1)]
    order = [2, 0, 1, 3][:n] if n == 4 else list(range(n))  # notes: sample 3 writes first
    for step in range(new_tokens):
        for i in order:
            write(i, tables[i], f"sample {i + 1}'s token {step}")


def _slot_str(slot: Slot) -> str:
    copy = f", copy={slot.copy}" if slot.copy else ""
    return f"Slot(block={slot.block}, offset={slot.offset}{copy})"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(torch.nan_to_num(a, nan=1e9), torch.nan_to_num(b, nan=1e9)))


def _compare(caches, slot: Slot, where: str) -> None:
    (mk, mv), (rk, rv) = caches["mine"], caches["ref"]
    if slot.copy is not None:
        src, dst = slot.copy
        for which, mine, ref in (("K", mk, rk), ("V", mv, rv)):
            if not _same(mine[src], ref[src]):
                grading.fail(f"{where}: block {src}'s {which} changed, but the other "
                             "samples still read it",
                             f"copy goes from src to dst (cache[{dst}] = cache[{src}]), and "
                             "the new token goes into slot.block, never into the shared src")
        for which, mine, ref in (("K", mk, rk), ("V", mv, rv)):
            if not _same(mine[dst, :slot.offset], ref[dst, :slot.offset]):
                grading.fail(f"{where}: the first {slot.offset} slot(s) of block {dst} ({which}) "
                             f"do not hold the tokens copied from block {src}",
                             f"copy the whole block src into dst first, in K *and* V: the "
                             f"sample's earlier tokens must be in its new block {dst} "
                             "before it writes there")
    for which, mine, ref in (("key", mk, rk), ("value", mv, rv)):
        if not _same(mine[slot.block, slot.offset], ref[slot.block, slot.offset]):
            grading.fail(f"{where}: the new token's {which} is not at block {slot.block}, "
                         f"offset {slot.offset}",
                         "write key into k_cache[slot.block, slot.offset] and value into "
                         "v_cache[...] after copying (a copy made afterwards overwrites it)")
    for which, mine, ref in (("k_cache", mk, rk), ("v_cache", mv, rv)):
        if mine.dtype != ref.dtype or not _same(mine, ref):
            bad = sorted({int(b) for b in (~torch.isclose(
                torch.nan_to_num(mine.double(), nan=1e9), torch.nan_to_num(ref.double(), nan=1e9))
            ).nonzero()[:, 0]})
            grading.fail(f"{where}: {which} differs from the expected cache in block(s) {bad}",
                         "touch only block dst (the copy) and the slot (block, offset); "
                         "the cache is updated in place and keeps its dtype")


def _check_readback(cache, tables, history, where: str) -> None:
    for i, (table, hist) in enumerate(zip(tables, history, strict=True)):
        bt = torch.tensor(table.blocks)
        for c, (which, cache_t) in enumerate((("K", cache[0]), ("V", cache[1]))):
            got = gather_kv(cache_t, bt, table.num_tokens)
            want = torch.stack([kv[c] for kv in hist])
            grading.expect_tensor_close(got, want, f"{where}: sample {i + 1} reads back its "
                                        f"{which}", atol=0, rtol=0,
                                        hint="each sample must read its own tokens through "
                                        "its block table, and nobody else's")


# ------------------------------------------------------------------ 08.2 beam_step


class _Store:
    """Token ids by slot: what each beam would read from the cache."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}

    def write(self, slot: Slot, token: int) -> None:
        if slot.copy is not None:
            src, dst = slot.copy
            for off in range(self.block_size):
                self.slots.pop((dst, off), None)
                if (src, off) in self.slots:
                    self.slots[dst, off] = self.slots[src, off]
        self.slots[slot.block, slot.offset] = token

    def read(self, table: BlockTable) -> list[int | None]:
        bs = self.block_size
        return [self.slots.get((table.blocks[t // bs], t % bs))
                for t in range(table.num_tokens)]


def _beam_scenarios() -> list[tuple[str, int, int, int, list[list[int]]]]:
    """name, block size, prompt length, pool size, parents per step."""
    out = [
        ("three children of the prompt, then beam 1 dies and beam 0 forks twice", 4, 6, 16,
         [[0, 0, 0], [0, 0, 2], [2, 2, 1], [0, 1, 2]]),
        ("block size 1 (every token takes a new block)", 1, 3, 24,
         [[0, 0], [1, 1], [0, 1], [1, 0]]),
        ("a pool of 3 blocks: the dead beam's block must serve this step's copy", 4, 5, 3,
         [[0, 0], [1, 1]]),
    ]
    scorer = sharing.RandomBeamScorer(seed=8, vocab=6, sigma=2.0)
    scores, steps, live = np.zeros(1), [], 1
    for _ in range(10):
        parents, _, scores = sharing.select_beams(scores, scorer(live), 4)
        steps.append(parents)
        live = len(parents)
    out.append(("a seeded random beam search (width 4, 10 steps)", 4, 7, 60, steps))
    return out


def check_beam_step(beam_step: Callable[..., Any]) -> None:
    """``beam_step(tables, parents) -> sharing.BeamStep``."""
    with grading.exercise("08.2", "One step of beam search over block tables"):
        for scenario in _beam_scenarios():
            _run_beam_scenario(beam_step, *scenario)


def _prefilled(block_size: int, prompt_len: int, num_blocks: int):
    allocator = BlockAllocator(num_blocks)
    store = _Store(block_size)
    table = BlockTable(allocator, block_size)
    for t in range(prompt_len):
        store.write(table.append_token(), t)
    return allocator, store, [table], [list(range(prompt_len))]


def _run_beam_scenario(beam_step, name, block_size, prompt_len, num_blocks, steps):
    ref_alloc, ref_store, ref_tables, _ = _prefilled(block_size, prompt_len, num_blocks)
    alloc, store, tables, seqs = _prefilled(block_size, prompt_len, num_blocks)
    for k, parents in enumerate(steps, start=1):
        where = f"scenario '{name}', step {k} (parents {parents})"
        old = list(tables)
        expected = sharing.beam_step(ref_tables, list(parents))
        try:
            got = beam_step(tables, list(parents))
        except OutOfBlocks as err:
            grading.fail(f"{where}: your step ran out of blocks ({err}), the library's did "
                         "not", "free the dead beams' tables first: their blocks go back to "
                         "the pool before this step takes any")
        _check_result_shape(got, parents, where)
        grading.expect_equal(list(got.freed), expected.freed, f"{where}: freed beams",
                             "every old beam that is nobody's parent dies: free its table "
                             "(list them in increasing order)")
        _check_tables(got, old, parents, expected, alloc, ref_alloc, where)
        seqs = [seqs[p] + [1000 * k + i] for i, p in enumerate(parents)]
        for i, slot in enumerate(got.slots):
            store.write(slot, seqs[i][-1])
        for i, table in enumerate(got.tables):
            grading.expect_equal(store.read(table), seqs[i], f"{where}: beam {i} reads back",
                                 "fork every extra child *before* any child appends: a fork "
                                 "made after a sibling wrote sees the sibling's token")
        tables, ref_tables = list(got.tables), list(expected.tables)


def _check_result_shape(got, parents, where: str) -> None:
    if not isinstance(got, sharing.BeamStep):
        grading.fail(f"{where}: expected a BeamStep, got {type(got).__name__}",
                     "return sharing.BeamStep(tables=..., slots=..., freed=...)")
    grading.expect_true(len(got.tables) == len(parents) == len(got.slots),
                        f"{where}: {len(got.tables)} tables and {len(got.slots)} slots "
                        f"for {len(parents)} new beams",
                        "one new table and one slot per entry of parents, in that order")


def _check_tables(got, old, parents, expected, alloc, ref_alloc, where: str) -> None:
    seen: set[int] = set()
    for i, p in enumerate(parents):
        first = p not in seen
        seen.add(p)
        if first and got.tables[i] is not old[p]:
            grading.fail(f"{where}: new beam {i} is the first child of beam {p} but got a new "
                         "table", "the first child continues its parent's own table (the "
                         "same object); only the further children fork it")
        if not first and any(got.tables[i] is t for t in old):
            grading.fail(f"{where}: new beam {i} is a further child of beam {p} but reuses "
                         "an old table", "each child after the first gets parent.fork()")
    for i, (table, ref) in enumerate(zip(got.tables, expected.tables, strict=True)):
        if table.num_tokens != ref.num_tokens:
            grading.fail(f"{where}: new beam {i} holds {table.num_tokens} tokens, expected "
                         f"{ref.num_tokens}", "fork before any child appends, and append "
                         "exactly one token to every new beam")
    n_copies, ref_copies = sum(s.copy is not None for s in got.slots), len(expected.copies)
    if n_copies > ref_copies:
        grading.fail(f"{where}: {n_copies} block copies, expected {ref_copies}",
                     "a parent's table counts as a holder until it is freed or continued: "
                     "forking *every* child (even the first) while the parent lives makes "
                     "one copy too many per parent; let the first child take the parent's "
                     "table")
    if alloc.num_free < ref_alloc.num_free:
        grading.fail(f"{where}: {alloc.num_free} free blocks afterwards, expected "
                     f"{ref_alloc.num_free}: blocks leaked",
                     "free the table of every beam that has no child this step (and keep "
                     "no extra table alive)")
    got_slots = [(s.block, s.offset, s.copy) for s in got.slots]
    want_slots = [(s.block, s.offset, s.copy) for s in expected.slots]
    grading.expect_equal(got_slots, want_slots, f"{where}: slots (block, offset, copy)",
                         "free the dead beams first (their blocks go back to the pool before "
                         "this step takes any), then fork, then append in the order of "
                         "parents")
    grading.expect_equal([t.blocks for t in got.tables], [t.blocks for t in expected.tables],
                         f"{where}: block tables", "append one token to each new beam with "
                         "table.append_token()")
    grading.expect_equal((list(alloc.ref_counts), list(alloc.free_block_ids)),
                         (list(ref_alloc.ref_counts), list(ref_alloc.free_block_ids)),
                         f"{where}: (ref counts, free list)",
                         "free each dead beam's table exactly once; fork, do not incref "
                         "by hand")


def run_beam_search(beam_step: Callable[..., Any], **kw) -> list[sharing.BeamFrame]:
    """A whole (synthetic) beam search driven by the learner's step, recorded."""
    frames, _ = sharing.record_beam_search(step_fn=beam_step, **kw)
    return frames
