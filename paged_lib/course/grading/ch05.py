"""Checks for chapter 05's exercises: a Triton ramp, the paged decode kernel, slots, merge.

Kernels are launched on tiny grids (a few programs) so that each check takes about a
second in Triton's interpreter. Two kinds of evidence, because each proves something
the other cannot:

* **NaN poisoning**: every cache slot (or matrix element) the kernel must not use holds
  NaN, so poison that reaches the output shows up as NaN there;
* **the load trace** (:mod:`paged_lib.instruments.load_trace`, interpreter only): every
  element each program loaded, so a read past a sequence's end fails even when
  ``tl.where`` hid its value, and the message names the program and the slot.

On a GPU (kernels compiled, not interpreted) only the first kind runs. After the fixed
cases, each check runs seeded generated cases (:mod:`~paged_lib.course.grading.generated.
numeric_decode`, :mod:`~paged_lib.course.grading.generated.small_around`), shrunk.

The kernel checks live in ``ch05_puzzles`` (05.1-05.4) and ``ch05_decode`` (05.5), on
``ch05_common``'s launcher and guarded buffers; this module is the chapter's grader
(``EQUIVALENT_MUTANTS``, every ``check_*``) and holds the checks around the kernel: the
slot mapping of the write path (05.6) and the merge of split-KV partials (05.7).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from paged_lib.course import grading
from paged_lib.course.grading.ch05_common import NAN, Guarded, launch
from paged_lib.course.grading.ch05_decode import (
    check_paged_decode_kernel,
    run_decode_kernel,
)
from paged_lib.course.grading.ch05_puzzles import (
    check_gather_rows,
    check_online_attention,
    check_row_softmax,
    check_scale_tile,
)
from paged_lib.course.grading.generated import small_around
from paged_lib.kernels.reference import gather_kv

__all__ = ["EQUIVALENT_MUTANTS", "Guarded", "check_gather_rows",
           "check_merge_partials", "check_online_attention", "check_paged_decode_kernel",
           "check_row_softmax", "check_scale_tile", "check_slot_mapping", "launch",
           "run_decode_kernel"]


#: Mutants (tools/mutants.py) of the solutions that compute the same thing.
EQUIVALENT_MUTANTS: dict[str, dict[str, str]] = {
    "05.2": {"constant: `0` -> `-1` in `rows = tl.load(idx_ptr + i, mask=live, other=0)"
             ".to(tl.int64)`": "a masked lane's row id is never used: the row load is masked "
                               "by the same condition",
             "constant: `0` -> `1` in `rows = tl.load(idx_ptr + i, mask=live, other=0)"
             ".to(tl.int64)`": "the same: any row id will do for a masked lane"},
    "05.6": {"constant: `0` -> `-1` in `pos = positions.clamp(min=0)  # a padding token's -1 "
             "must not index the table`": "a padding token's slot is replaced by -1 "
                                          "afterwards; index -1 is a valid column meanwhile"},
}


# ---------------------------------------------------------------------- 05.6 slot mapping

# Padding tokens (position -1) belong to sequences whose table is full to its last entry:
# -1 // block_size indexes that entry, so code that ignores padding gets a real slot there,
# not -1 by accident (a last entry of -1 would give -1 * bs + (bs - 1) = -1).
SLOT_CASES = [
    (4, [[7, 2, 5], [3, -1, -1], [6, 1, 4]], [0, 0, 0, 1, 2, 2, 2, 0], [3, 4, 9, 0, 5, 6, 7, -1]),
    (16, [[2, 0], [1, -1]], [0, 0, 1, 0], [15, 16, 3, -1]),
    (3, [[4, 1, 0], [2, -1, -1]], [0, 0, 1], [2, 7, 1]),
]


def _slot_slips(bt: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor,
                block_size: int, expected: torch.Tensor) -> list[tuple[list[int] | None, str]]:
    """What typical wrong slot mappings return on this case, and what each one forgot."""
    seq, pos = seq_ids.long(), positions.long()
    pad = pos < 0
    kept = pos.clamp(min=0)
    table = bt.long()

    def mapped(slots: Callable[[], torch.Tensor]) -> list[int] | None:
        try:
            return torch.where(pad, torch.full_like(slots(), -1), slots()).tolist()
        except IndexError:  # this slip would have raised on this case
            return None

    def unpadded() -> torch.Tensor:
        return table[seq, torch.div(pos, block_size, rounding_mode="floor")] * block_size \
            + pos % block_size

    slips = [
        (unpadded().tolist(), "a padding token (position -1) must map to -1: -1 // "
                              "block_size is -1, which silently indexes the last entry of "
                              "the table"),
        ((table[seq, kept // block_size] * block_size + kept % block_size).tolist(),
         "a padding token (position -1) must map to -1: you returned a real slot for it "
         "(the slot of position 0), so the cache write would overwrite a token"),
        (mapped(lambda: kept % block_size), "the slot is in the token's block: "
                                            "block_tables[seq, pos // block_size] * "
                                            "block_size + pos % block_size, not just the "
                                            "offset pos % block_size"),
        (mapped(lambda: table[seq, kept // block_size] * block_size),
         "add the offset inside the block, pos % block_size"),
        (mapped(lambda: table[seq, kept // block_size]),
         "a block id is not a slot: multiply by block_size and add pos % block_size"),
        (mapped(lambda: table[0, kept // block_size] * block_size + kept % block_size),
         "each token uses its own sequence's row: block_tables[seq_ids[i], ...]"),
        (mapped(lambda: table[seq, kept % block_size] * block_size + kept // block_size),
         "// and % swapped: the block is pos // block_size, the offset pos % block_size"),
    ]
    for bs in (4, 16):  # a hard-coded block size
        if bs != block_size:
            slips.append((mapped(lambda bs=bs: table[seq, kept // bs] * bs + kept % bs),
                          f"use the block_size you are given ({block_size} here), not a "
                          f"constant {bs}"))
    right = expected.tolist()
    return [(slots, hint) for slots, hint in slips if slots != right]


SLOT_HINT = ("slot = block_tables[seq, pos // block_size] * block_size + pos % block_size, "
             "with the block_size you are given (not a constant); position -1 (padding) maps "
             "to -1 and must not index the table")


def check_slot_mapping(slot_mapping: Callable[..., torch.Tensor]) -> None:
    """05.6: slot of each new token from its sequence's block table (int64, -1 padding)."""
    from paged_lib.kernels import reshape_and_cache, slot_mapping_from_positions

    with grading.exercise("05.6"):
        for block_size, tables, seqs, poss in SLOT_CASES:
            bt = torch.tensor(tables, dtype=torch.int32)
            seq_ids, positions = torch.tensor(seqs), torch.tensor(poss)
            what = f"block_size {block_size}, block_tables {tables}, positions {poss}"
            try:
                got = slot_mapping(bt, seq_ids, positions, block_size)
            except IndexError as err:
                grading.fail(f"{what}: your code raised IndexError: {err}", hint=SLOT_HINT)
            grading.expect_true(isinstance(got, torch.Tensor),
                                f"{what}: expected a torch.Tensor, got {type(got).__name__}")
            grading.expect_true(got.dtype == torch.int64,
                                f"{what}: expected dtype torch.int64, got {got.dtype}",
                                hint="slots index a cache of num_blocks x block_size entries, "
                                     "which can exceed 2**31: compute in int64 (.long())")
            expected = slot_mapping_from_positions(bt, seq_ids, positions, block_size)
            named = [hint for slots, hint in _slot_slips(bt, seq_ids, positions, block_size,
                                                         expected) if slots == got.tolist()]
            grading.expect_equal(got.tolist(), expected.tolist(), f"{what}: slot_mapping",
                                 hint=named[0] if named else SLOT_HINT)
        # Round trip: write with the learner's slots, read back through the block table.
        g = torch.Generator().manual_seed(0)
        k_cache = torch.full((8, 4, 1, 2), NAN)
        v_cache = k_cache.clone()
        bt, seqs, poss = (torch.tensor(SLOT_CASES[0][1], dtype=torch.int32),
                          torch.tensor(SLOT_CASES[0][2]), torch.tensor(SLOT_CASES[0][3]))
        key = torch.randn(len(poss), 1, 2, generator=g)
        reshape_and_cache(key, key, k_cache, v_cache, slot_mapping(bt, seqs, poss, 4).long(),
                          backend="torch")
        read = gather_kv(k_cache, bt[2], 8)[5:8]
        grading.expect_tensor_close(read, key[4:7], "sequence 2's positions 5-7 read back "
                                    "through its block table")
        small_around.slot_stage(slot_mapping)  # generated: pools past 2**31 slots


# ------------------------------------------------------------ 05.7 merge split-KV partials

def _partials(scores: torch.Tensor, v: torch.Tensor, cuts: list[tuple[int, int]]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    outs, lses = [], []
    for a, b in cuts:
        if a == b:  # an empty segment
            outs.append(torch.zeros(v.shape[1], dtype=torch.float64))
            lses.append(-math.inf)
            continue
        s = scores[a:b]
        outs.append(torch.softmax(s, 0) @ v[a:b])
        lses.append(torch.logsumexp(s, 0).item())
    return torch.stack(outs), torch.tensor(lses, dtype=torch.float64)


def check_merge_partials(merge_partials: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                         ) -> None:
    """05.7: merge split-KV partial outputs with their log-sum-exps."""
    with grading.exercise("05.7"):
        g = torch.Generator().manual_seed(0)
        for shift, cuts in [(0.0, [(0, 5), (5, 9), (9, 12), (12, 12)]),
                            (1000.0, [(0, 2), (2, 12)]), (-1000.0, [(0, 7), (7, 12)])]:
            scores = (torch.randn(12, generator=g) * 3).double() + shift
            v = torch.randn(12, 4, generator=g).double()
            full = torch.softmax(scores, 0) @ v
            out, lse = _partials(scores, v, cuts)
            got = merge_partials(out, lse)
            what = f"segments {cuts}, log-sum-exps around {shift:g}"
            if isinstance(got, torch.Tensor) and got.dtype != out.dtype:
                grading.fail(f"{what}: expected dtype {out.dtype} (the partials' dtype), got "
                             f"{got.dtype}", hint="compute in the dtype of out and lse: "
                             "float32 rounds at about 1e-7, far above this check's 1e-9")
            if isinstance(got, torch.Tensor) and got.isnan().any():
                grading.fail(f"{what}: the merged output is NaN",
                             hint="exp(lse) overflows (or underflows to 0/0) for log-sum-exps "
                                  "far from 0: weight by exp(lse_j - max lse)")
            rounded = isinstance(got, torch.Tensor) and got.shape == full.shape and \
                torch.allclose(got.double(), full, rtol=1e-5, atol=1e-6)
            grading.expect_tensor_close(
                got, full, f"{what}: merged output", atol=1e-9, rtol=1e-9,
                hint="right to about 1e-7 but not beyond: something was rounded to float32 "
                     "on the way (a .float(), a float32 tensor); stay in float64" if rounded
                else "weight each partial by exp(lse_j - max lse) (an empty segment, lse = "
                     "-inf, weighs 0) and divide by the sum of the weights")
        small_around.partials_stage(merge_partials)  # generated: empties anywhere
