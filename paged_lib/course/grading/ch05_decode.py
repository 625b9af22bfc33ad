"""Chapter 05's paged decode kernel (05.5): the learner's kernel on poisoned caches and
under the load trace, which names the first program and slot it should not have read."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from paged_lib.course import grading
from paged_lib.course.grading.ch05_common import (
    NAN,
    OUT_GUARD,
    Guarded,
    expect_no_nan,
    first_outside,
    interpreted,
    launch,
)
from paged_lib.course.grading.generated import numeric, numeric_decode
from paged_lib.course.grading.slips import decode_slips, name_slip
from paged_lib.instruments.load_trace import LoadTrace
from paged_lib.kernels.reference import ref_paged_attention
from paged_lib.util import cdiv

# -------------------------------------------------------------- 05.5 the paged decode kernel

def run_decode_kernel(kernel: Any, case) -> tuple[torch.Tensor, LoadTrace, tuple]:
    """Launch the exercise kernel, one program per (sequence, KV head); output on the CPU.

    Every tensor sits inside a poisoned guard as large as itself (:class:`Guarded`), so a
    wrong offset reads or writes the guard instead of crashing the notebook's kernel.
    Returns the output, the load trace and the two cache views (for the trace).
    """
    q, k_cache, v_cache, block_tables, seq_lens, scale = case
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    q_g, k_g, v_g = Guarded(q, q.numel()), Guarded(k_cache, k_cache.numel()), \
        Guarded(v_cache, v_cache.numel())
    out_g = Guarded(torch.full_like(q, NAN), q.numel(), fill=OUT_GUARD)
    bt_g = Guarded(block_tables, block_tables.numel(), fill=0)  # block 0: all NaN
    lens_g = Guarded(seq_lens, seq_lens.numel(), fill=0)
    trace = launch(kernel, (num_seqs, num_kv_heads), out_g.view, q_g.view, k_g.view, v_g.view,
                   bt_g.view, lens_g.view, scale, block_tables.shape[1],
                   NUM_KV_HEADS=num_kv_heads, GROUP=group,
                   GROUP_PAD=max(1, 1 << (group - 1).bit_length()), HEAD_DIM=head_dim,
                   BLOCK_SIZE=k_cache.shape[1])
    if not out_g.guard_intact():
        grading.fail("the kernel wrote outside out (padded query heads stored?)",
                     hint="store only the GROUP real rows of the tile: mask=(g < GROUP)[:, None]"
                          "; out[seq, head] is at (seq * num_heads + head) * HEAD_DIM")
    for name, g in (("K", k_g), ("V", v_g)):
        if not interpreted():
            break
        size = g.view.numel()
        bad = first_outside(g, trace, lambda f, n=size: (f >= 0) & (f < n))
        if bad:
            grading.fail(f"program {bad[0][:2]} read {name} outside the cache ({bad[2]} "
                         "element(s) in one load)",
                         hint="element (block, slot, head, dim) is at ((block * BLOCK_SIZE + "
                              "slot) * NUM_KV_HEADS + head) * HEAD_DIM + dim")
    if interpreted():
        _check_iterations(trace, bt_g, k_g, seq_lens, k_cache.shape[1])
    if interpreted() and trace.narrow_products(bt_g.buffer):
        grading.fail("a block id loaded from the block table was multiplied in 32 bits "
                     "(casting the sum to int64 afterwards is too late: the product has "
                     "already wrapped)", hint=NARROW_HINT)
    return out_g.view.cpu(), trace, (k_g.view, v_g.view)


NARROW_HINT = ("cast the block id to tl.int64 right after loading it, before any multiply: "
               "in int32, block * (BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM) wraps once the "
               "cache passes 2**31 elements (a few GB), and .to(tl.int64) on the result "
               "cannot undo that")


def _check_iterations(trace: LoadTrace, bt_g: Guarded, k_g: Guarded, seq_lens: torch.Tensor,
                      block_size: int) -> None:
    """Each program visits its own sequence's blocks only: no block-table entry past them
    is read, and no K tile is loaded with every lane masked off (an iteration past the
    end: looping over the widest table instead of cdiv(seq_len, BLOCK_SIZE))."""
    lens = seq_lens.tolist()
    width = bt_g.view.shape[1]
    hint = ("loop over range(cdiv(seq_len, BLOCK_SIZE)) with this program's own seq_len, not "
            "over the table's width: on a GPU every program then waits as long as the "
            "batch's longest sequence, and the extra iterations load memory for nothing")
    for program, flat, mask in bt_g.reads(trace):
        seq, head = program[:2]
        own = cdiv(int(lens[seq]), block_size)
        cols = flat - seq * width
        bad = mask & (cols >= own) & (cols < width)
        if bad.any():
            grading.fail(f"program (seq {seq}, kv_head {head}) read block-table entry "
                         f"{int(cols[np.flatnonzero(bad)[0]])} of its row, but its "
                         f"{lens[seq]} tokens occupy {own} block(s)", hint=hint)
    idle: dict[tuple, int] = {}
    for program, _, mask in k_g.reads(trace):
        if not mask.any():
            idle[program[:2]] = idle.get(program[:2], 0) + 1
    if idle:
        (seq, head), count = next(iter(idle.items()))
        grading.fail(f"program (seq {seq}, kv_head {head}) loaded K {count} time(s) with every "
                     f"lane masked off: it iterates past its own "
                     f"{cdiv(int(lens[seq]), block_size)} block(s) (over the widest block "
                     "table?)", hint=hint)


def _allowed_slots(case, seq: int) -> dict[tuple[int, int], int]:
    """(physical block, slot) -> token position, for sequence ``seq``'s tokens."""
    bs = case.k_cache.shape[1]
    table = case.block_tables[seq].tolist()
    return {(table[p // bs], p % bs): p for p in range(int(case.seq_lens[seq]))}


def _check_decode_reads(trace: LoadTrace, caches: tuple, case, what: str) -> None:
    bs, num_kv_heads, head_dim = case.k_cache.shape[1:]
    for name, cache in zip("KV", caches, strict=True):
        seen: dict[tuple, np.ndarray] = {}
        for read in trace.reads_of(cache):
            seq, kv_head = read.program[:2]
            allowed = _allowed_slots(case, seq)
            n = int(case.seq_lens[seq])
            for blk, slot, head, dim in read.index[read.mask]:
                if head != kv_head:
                    grading.fail(f"{what}: program (seq {seq}, kv_head {kv_head}) read {name} "
                                 f"of KV head {head}",
                                 hint="the KV head is program_id(1): element (block, slot, "
                                      "head, dim) is at ((block * BLOCK_SIZE + slot) * "
                                      "NUM_KV_HEADS + head) * HEAD_DIM + dim")
                if (int(blk), int(slot)) not in allowed:
                    grading.fail(f"{what}: program (seq {seq}, kv_head {kv_head}) read {name} "
                                 f"at block {blk}, slot {slot}: "
                                 + _why_not(case, seq, int(blk), int(slot), n),
                                 hint=f"load {name} with mask=valid[:, None], valid = "
                                      "position < seq_len; tl.where on the scores hides the "
                                      "NaN but the read still happens (on a GPU: a fault or "
                                      "another sequence's data)")
                count = seen.setdefault((seq, kv_head), np.zeros(
                    (case.k_cache.shape[0], bs, head_dim), dtype=np.int64))
                count[blk, slot, dim] += 1
        for (seq, kv_head), count in seen.items():
            if count.max() > 1:
                grading.fail(f"{what}: program (seq {seq}, kv_head {kv_head}) read the same "
                             f"{name} element {int(count.max())} times",
                             hint="load each K/V tile once and score it for all GROUP query "
                                  "heads at once: a [GROUP_PAD, HEAD_DIM] query tile")
    reach = bs * num_kv_heads * head_dim
    for cache in caches:
        if trace.narrow_offsets(cache, reach):
            grading.fail(f"{what}: offsets into the cache (block id x block stride) were "
                         "computed in 32 bits",
                         hint="cast the block id loaded from the block table with "
                              ".to(tl.int64) before multiplying: a cache of more than 2**31 "
                              "elements (a few GB) would wrap around")


def _why_not(case, seq: int, blk: int, slot: int, n: int) -> str:
    bs = case.k_cache.shape[1]
    table = case.block_tables[seq].tolist()
    used = table[:cdiv(n, bs)]
    if blk in used:
        pos = used.index(blk) * bs + slot
        return f"position {pos} >= seq_len {n}, past the sequence's end"
    return (f"block {blk} is not one of sequence {seq}'s blocks {used} (a padding entry of "
            "its block table?)")


# (seq_lens, heads, KV heads, head_dim, block_size, q scale). The second case's scores run
# in the hundreds (q x 40): exp of a raw score overflows float32 past 88, so a kernel with
# no running max (or one that never lets it grow) fails there, as 05.4's does.
DECODE_CASES = [((1, 4, 9), 4, 2, 16, 4, 1.0), ((3, 8, 17), 6, 2, 16, 8, 40.0)]


def check_decode_case(kernel: Any, case, what: str, loud: bool = False) -> None:
    """One decode batch: the learner's kernel under the trace, next to the reference."""
    got, trace, caches = run_decode_kernel(kernel, case)
    if interpreted():
        _check_decode_reads(trace, caches, case, what)
    expected = ref_paged_attention(*case)
    if loud and not got.isfinite().all():
        where = "" if interpreted() else " (or a read past seq_len)"
        grading.fail(f"{what}: scores in the hundreds gave NaN or inf{where}",
                     hint="exp of a raw score overflows float32 beyond 88: keep a "
                          "running max m and exponentiate s - m_new, rescaling l and "
                          "acc by exp(m_old - m_new) when m grows")
    expect_no_nan(got, expected, f"{what}, out",
                  hint="visit only cdiv(seq_len, BLOCK_SIZE) blocks, and mask K and V "
                       "loads (other=0.0) and scores (-inf) past seq_len")
    named = None
    if got.shape == expected.shape and not torch.allclose(got, expected.float(),
                                                          atol=1e-4, rtol=1e-4):
        named = name_slip(got, expected, decode_slips(
            case.q, case.k_cache, case.v_cache, case.block_tables.tolist(),
            case.seq_lens.tolist(), case.scale))
    grading.expect_tensor_close(
        got, expected, f"{what}, out [seq, head, dim]", atol=1e-4, rtol=1e-4,
        hint=named or "compare with the spec: query head h = kv_head * GROUP + g "
                      "attends with its own softmax over the sequence's seq_len keys")


def check_paged_decode_kernel(kernel: Any) -> None:
    """05.5: the paged decode kernel, one program per (sequence, KV head)."""
    with grading.exercise("05.5"):
        for seed, (lens, heads, kv_heads, d, bs, q_scale) in enumerate(DECODE_CASES):
            p = numeric_decode.Ramp("05.5", seed, (
                ("lens", lens), ("kv_heads", kv_heads), ("heads", heads), ("head_dim", d),
                ("ties", False), ("loud", q_scale), ("scale", "head"), ("block_size", bs)))
            check_decode_case(kernel, p.build(), p.what(), loud=q_scale > 1)
        numeric.check("05.5", numeric_decode.decode_cases(), lambda p: check_decode_case(
            kernel, p.build(), p.what(), loud=p.loud > 1), numeric_decode.DECODE_CONTRASTS)
