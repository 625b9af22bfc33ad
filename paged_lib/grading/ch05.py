"""Checks for chapter 05's exercises: a Triton ramp, the paged decode kernel, slots, merge.

Kernels are launched on tiny grids (a few programs) so that each check takes about a
second in Triton's interpreter. Two kinds of evidence, because each proves something
the other cannot:

* **NaN poisoning**: every cache slot (or matrix element) the kernel must not use holds
  NaN, so poison that reaches the output shows up as NaN there;
* **the load trace** (:mod:`paged_lib.grading.load_trace`, interpreter only): every
  element each program loaded, so a read past a sequence's end fails even when
  ``tl.where`` hid its value, and the message names the program and the slot.

On a GPU (kernels compiled, not interpreted) only the first kind runs.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from paged_lib import grading
from paged_lib.grading.load_trace import LoadTrace, trace_loads
from paged_lib.kernels.cases import NAN_BLOCK, make_decode_case
from paged_lib.kernels.reference import gather_kv, ref_paged_attention
from paged_lib.util import cdiv

#: Exercise id -> the library object it re-implements (chapter 05 must not show them).
TWINS: dict[str, str] = {
    "05.5": "paged_lib.kernels.triton_decode._paged_decode_kernel",
    "05.6": "paged_lib.kernels.cache.slot_mapping_from_positions",
    "05.7": "paged_lib.kernels.triton_split.merge_splits",
}

NAN = float("nan")


# ------------------------------------------------------------------ launching and tracing

def _stub_not_done(kernel: Any) -> None:
    """A stub still holding ``raise NotImplementedError()`` is 'not attempted'.

    In the interpreter the raise would surface when the kernel runs; a compiling GPU
    backend would reject it as a compile error instead, so look at the source first.
    """
    fn = getattr(kernel, "fn", kernel)
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return
    if "raise NotImplementedError" in src:
        raise NotImplementedError


def _interpreted() -> bool:
    from paged_lib.device import interpreter_on

    return interpreter_on()


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **constants: Any) -> LoadTrace:
    """Run the learner's kernel; return its load trace (empty when compiled on a GPU).

    The interpreter wraps what a kernel raised in its own error; the learner sees theirs.
    """
    _stub_not_done(kernel)
    with trace_loads() as trace, np.errstate(all="ignore"):  # overflow: reported as such
        try:
            kernel[grid](*args, **constants)
        except Exception as err:
            cause = err.__cause__
            if isinstance(cause, NotImplementedError):
                raise NotImplementedError from err
            if cause is not None and type(err).__name__ == "InterpreterError":
                raise cause from None
            raise
    return trace


def _device() -> torch.device:
    from paged_lib import default_device

    return default_device()


def _guarded(rows: int, cols: int, row_stride: int, values: torch.Tensor,
             guard_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN matrix ``[rows + guard_rows, row_stride]`` whose top-left ``[rows, cols]``
    holds ``values``; returns (parent, the view). Reads outside the view hit NaN and the
    trace maps them to the parent's indices."""
    parent = torch.full((rows + guard_rows, row_stride), NAN, dtype=values.dtype)
    parent[:rows, :cols] = values
    return parent, parent[:rows, :cols]


def _outside_reads(trace: LoadTrace, parent: torch.Tensor, rows: int, cols: int,
                   name: str) -> str | None:
    """The first unmasked read of ``parent`` outside its top-left ``[rows, cols]``."""
    for read in trace.reads_of(parent):
        i, j = read.index[:, 0], read.index[:, 1]
        bad = read.mask & ((i >= rows) | (j >= cols))
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            return (f"program {read.program[:2]} read {name}[{int(i[k])}, {int(j[k])}], "
                    f"outside the {rows} x {cols} matrix ({int(bad.sum())} such element(s) "
                    "in that load)")
    return None


def _expect_no_nan(got: torch.Tensor, expected: torch.Tensor, what: str, hint: str) -> None:
    nan = got.isnan() & ~expected.isnan()
    if nan.any():
        where = tuple(int(i) for i in nan.nonzero()[0])
        grading.fail(f"{what}: NaN at {list(where)}: poison (memory the kernel must not use) "
                     "reached the output", hint)


# ------------------------------------------------------------------- 05.1 a 2-D masked tile

def check_scale_tile(kernel: Any) -> None:
    """05.1: ``out = 2 * x`` for an ``[M, N]`` view with row stride ``stride_x``."""
    with grading.exercise("05.1", "A 2-D masked tile"):
        g = torch.Generator().manual_seed(51)
        for m, n, stride, bm, bn in [(5, 7, 9, 4, 4), (3, 16, 16, 4, 8)]:
            parent, x = _guarded(m, n, stride, torch.randn(m, n, generator=g), guard_rows=bm)
            out_parent, _ = _guarded(m, n, n, torch.zeros(m, n), guard_rows=bm)
            what = f"M={m}, N={n}, stride_x={stride}, BLOCK_M={bm}, BLOCK_N={bn}"
            dev = _device()
            x_dev, out_dev = (parent.to(dev), out_parent.to(dev))
            trace = launch(kernel, (cdiv(m, bm), cdiv(n, bn)), x_dev, out_dev, m, n, stride,
                           BLOCK_M=bm, BLOCK_N=bn)
            if _interpreted():
                bad = _outside_reads(trace, x_dev, m, n, "x")
                if bad:
                    grading.fail(f"{what}: {bad}", hint=_tile_hint(trace, x_dev, m, n, bm, bn))
            got = out_dev.cpu()
            grading.expect_true(bool(got[m:].isnan().all()),
                                f"{what}: the kernel wrote past the last row of out",
                                hint="mask the store too, with the same (row, column) mask")
            _expect_no_nan(got[:m], 2 * x, f"{what}, out", hint="mask loads and stores with "
                           "rows < M and cols < N")
            grading.expect_tensor_close(got[:m], 2 * x, f"{what}, out",
                                        hint="element (i, j) of x is at i * stride_x + j "
                                             "(stride_x, not N); of out at i * N + j")


def _tile_hint(trace: LoadTrace, parent: torch.Tensor, m: int, n: int, bm: int, bn: int
               ) -> str:
    """Wrong mask, or right mask and wrong addresses? Count the lanes each load enabled."""
    for read in trace.reads_of(parent):
        pm, pn = read.program[:2]
        inside = (min(m, (pm + 1) * bm) - pm * bm) * (min(n, (pn + 1) * bn) - pn * bn)
        if int(read.mask.sum()) != inside:
            return ("mask the load with (rows < M)[:, None] & (cols < N)[None, :]: a tile at "
                    "the edge hangs over both the last row and the last column")
    return ("the mask is right but the addresses are not: element (i, j) of x is at "
            "i * stride_x + j (stride_x, not N: x is a view into wider rows)")


# --------------------------------------------------------------- 05.2 gather through a table

def check_gather_rows(kernel: Any) -> None:
    """05.2: ``out[i] = x[idx[i]]`` for ``i < n``; row ids int32, offsets int64."""
    with grading.exercise("05.2", "Gather rows through a table"):
        g = torch.Generator().manual_seed(52)
        for num_rows, n, d, block in [(9, 5, 8, 4), (12, 3, 16, 2)]:
            x = torch.full((num_rows + 1, d), NAN)  # row num_rows: NaN, nobody's row
            x[:num_rows] = torch.randn(num_rows, d, generator=g)
            idx_parent = torch.full((n + 4,), num_rows, dtype=torch.int32)  # past n: garbage
            idx_parent[:n] = torch.randperm(num_rows, generator=g)[:n].to(torch.int32)
            out = torch.full((cdiv(n, block) * block + 1, d), NAN)
            what = f"{num_rows} rows of {d}, n={n}, BLOCK_I={block}"
            dev = _device()
            x_dev, idx_dev, out_dev = x.to(dev), idx_parent.to(dev), out.to(dev)
            trace = launch(kernel, (cdiv(n, block),), x_dev, idx_dev, out_dev, n,
                           D=d, BLOCK_I=block)
            if _interpreted():
                for read in trace.reads_of(idx_dev):
                    bad = read.mask & (read.index[:, 0] >= n)
                    if bad.any():
                        grading.fail(f"{what}: program {read.program[0]} read idx["
                                     f"{int(read.index[bad][0, 0])}], past its n={n} entries",
                                     hint="mask the load of idx with i < n (other=0)")
                if trace.narrow_offsets(x_dev, reach=d):
                    grading.fail(f"{what}: the offsets into x (row id x D) were computed in "
                                 "32 bits",
                                 hint="cast the row ids to tl.int64 before multiplying: "
                                      "beyond 2**31 elements a 32-bit offset wraps and reads "
                                      "the wrong row")
            got = out_dev.cpu()
            grading.expect_true(bool(got[n:].isnan().all()),
                                f"{what}: the kernel wrote rows of out at i >= n",
                                hint="mask the store with i < n")
            grading.expect_tensor_close(got[:n], x[idx_parent[:n].long()], f"{what}, out",
                                        atol=0, rtol=0,
                                        hint="row i of out is row idx[i] of x (load idx[i] "
                                             "first), at offset idx[i] * D + d")


# ---------------------------------------------------------------------- 05.3 row softmax

def check_row_softmax(kernel: Any) -> None:
    """05.3: ``out = softmax(x, dim=1)``, one program per row, large and negative values."""
    with grading.exercise("05.3", "Row softmax"):
        g = torch.Generator().manual_seed(53)
        for rows, n, block in [(3, 5, 8), (2, 16, 16), (2, 3, 4)]:
            x = torch.randn(rows, n, generator=g) * 3
            x[0] += 500.0  # exp(500) overflows float32: subtract the row max first
            x[-1] -= 50.0  # all negative: padding lanes must weigh 0, not exp(0 - max)
            parent, view = _guarded(rows, n, n, x)
            out = torch.full((rows + 1, n), NAN)
            what = f"{rows} rows of N={n}, BLOCK_N={block}"
            dev = _device()
            x_dev, out_dev = parent.to(dev), out.to(dev)
            trace = launch(kernel, (rows,), x_dev, out_dev, n, BLOCK_N=block)
            if _interpreted():
                for read in trace.reads_of(x_dev):
                    row = read.program[0]
                    flat = read.index[:, 0] * n + read.index[:, 1]
                    bad = read.mask & ((flat < row * n) | (flat >= (row + 1) * n))
                    if bad.any():
                        grading.fail(f"{what}: program {row} read x{list(read.index[bad][0])}"
                                     f", outside its row {row}",
                                     hint="mask the load with cols < N (other=-inf)")
            got = out_dev.cpu()
            expected = torch.softmax(x.double(), 1).float()
            if got[0].isnan().any() or got[0].isinf().any():
                grading.fail(f"{what}: row 0 (values around 500) came out NaN or inf",
                             hint="subtract the row's max before tl.exp: exp(500) overflows")
            grading.expect_tensor_close(
                got[:rows], expected, f"{what}, out", atol=1e-5, rtol=1e-4,
                hint="padding lanes (cols >= N) must get weight 0: load them with "
                     "other=-inf (exp(-inf) = 0), not 0")
            grading.expect_true(bool(got[rows:].isnan().all()),
                                f"{what}: the kernel wrote past the last row",
                                hint="mask the store with cols < N")


# ----------------------------------------------- 05.4 online softmax over contiguous K/V

def check_online_attention(kernel: Any) -> None:
    """05.4: ``out[b] = softmax(k[b] @ q[b] * scale) @ v[b]``, TILE keys per iteration."""
    with grading.exercise("05.4", "Online softmax over contiguous K"):
        g = torch.Generator().manual_seed(54)
        for batch, n, d, tile in [(2, 13, 8, 4), (2, 8, 16, 8), (1, 3, 8, 4)]:
            q = torch.randn(batch, d, generator=g)
            q[0] *= 40.0  # scores in the hundreds: exp without the max overflows
            k = torch.randn(batch, n, d, generator=g)
            v = torch.randn(batch, n, d, generator=g)
            k_parent = torch.full((batch + 1, n, d), NAN)
            v_parent = k_parent.clone()
            k_parent[:batch], v_parent[:batch] = k, v
            out = torch.full((batch, d), NAN)
            scale = d ** -0.5
            what = f"batch {batch}, N={n}, D={d}, TILE={tile}"
            dev = _device()
            args = [t.to(dev) for t in (q, k_parent, v_parent, out)]
            trace = launch(kernel, (batch,), *args, n, scale, D=d, TILE=tile)
            if _interpreted():
                _check_tiles(trace, args[1], "K", n, d, tile, what)
                _check_tiles(trace, args[2], "V", n, d, tile, what)
            got = args[3].cpu()
            expected = (torch.softmax(torch.einsum("bnd,bd->bn", k.double(), q.double())
                                      * scale, 1)[..., None] * v.double()).sum(1).float()
            if got[0].isnan().any() or got[0].isinf().any():
                grading.fail(f"{what}: scores in the hundreds gave NaN or inf",
                             hint="exponentiate s - m_new, never s itself: exp(200) overflows")
            grading.expect_tensor_close(
                got, expected, f"{what}, out", atol=1e-4, rtol=1e-4,
                hint="when the max grows, rescale l and acc by alpha = exp(m_old - m_new) "
                     "before adding the new tile; the last tile is partial (N % TILE)")


def _check_tiles(trace: LoadTrace, parent: torch.Tensor, name: str, n: int, d: int,
                 tile: int, what: str) -> None:
    """Each program reads its own ``n`` rows of K (or V), each element once, ``tile`` at a time."""
    seen: dict[int, np.ndarray] = {}
    for read in trace.reads_of(parent):
        b = read.program[0]
        rows = read.index[:, 0] * n + read.index[:, 1]
        bad = read.mask & (read.index[:, 0] != b)
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            grading.fail(f"{what}: program {b} loaded {name} at token {int(rows[j]) - b * n} "
                         f"(N={n}) without a mask", hint=f"load {name} with mask=(tokens < N)"
                         "[:, None]: tl.where on the scores hides the NaN but not the read "
                         "past the end")
        counts = seen.setdefault(b, np.zeros(n * d, dtype=np.int64))
        own = read.index[read.mask]
        np.add.at(counts, own[:, 1] * d + own[:, 2], 1)
        if read.mask.sum() > tile * d:
            grading.fail(f"{what}: program {b} loaded {int(read.mask.sum()) // d} tokens of "
                         f"{name} at once, more than TILE={tile}",
                         hint="loop over the keys TILE at a time")
    for b, counts in seen.items():
        if counts.max() > 1:
            grading.fail(f"{what}: program {b} read {name} {int(counts.max())} times over",
                         hint="one pass is enough: keep a running max m, sum l and acc, "
                              "rescaled by exp(m_old - m_new) when m grows")


# -------------------------------------------------------------- 05.5 the paged decode kernel

def decode_case(seq_lens: tuple[int, ...], num_heads: int, num_kv_heads: int, head_dim: int,
                block_size: int, seed: int = 0):
    """A decode batch for the grader: distinct blocks, padding through an all-NaN block 0."""
    return make_decode_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                            seed=seed, shared=False, pad=NAN_BLOCK)


def run_decode_kernel(kernel: Any, case) -> tuple[torch.Tensor, LoadTrace, tuple]:
    """Launch the exercise kernel, one program per (sequence, KV head); output on the CPU."""
    q, k_cache, v_cache, block_tables, seq_lens, scale = case.to(_device())
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.full_like(q, NAN)
    trace = launch(kernel, (num_seqs, num_kv_heads), out, q, k_cache, v_cache, block_tables,
                   seq_lens, scale, block_tables.shape[1], NUM_KV_HEADS=num_kv_heads,
                   GROUP=group, GROUP_PAD=max(1, 1 << (group - 1).bit_length()),
                   HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1])
    return out.cpu(), trace, (k_cache, v_cache)


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


DECODE_CASES = [((1, 4, 9), 4, 2, 16, 4), ((3, 8, 17), 6, 2, 16, 8)]


def check_paged_decode_kernel(kernel: Any) -> None:
    """05.5: the paged decode kernel, one program per (sequence, KV head)."""
    with grading.exercise("05.5", "Paged decode kernel"):
        for seed, (lens, heads, kv_heads, d, bs) in enumerate(DECODE_CASES):
            case = decode_case(lens, heads, kv_heads, d, bs, seed=seed)
            what = f"seq_lens {list(lens)}, heads {heads}/{kv_heads}, block_size {bs}"
            got, trace, caches = run_decode_kernel(kernel, case)
            if _interpreted():
                _check_decode_reads(trace, caches, case, what)
            expected = ref_paged_attention(*case)
            _expect_no_nan(got, expected, f"{what}, out",
                           hint="visit only cdiv(seq_len, BLOCK_SIZE) blocks, and mask K and V "
                                "loads (other=0.0) and scores (-inf) past seq_len")
            grading.expect_tensor_close(
                got, expected, f"{what}, out [seq, head, dim]", atol=1e-4, rtol=1e-4,
                hint="query head h = kv_head * GROUP + g; rescale l and acc by "
                     "exp(m_old - m_new); store only the GROUP real rows")


# ---------------------------------------------------------------------- 05.6 slot mapping

SLOT_CASES = [
    (4, [[7, 2, 5], [3, -1, -1], [6, 1, 4]], [0, 0, 0, 1, 2, 2, 2, 1], [3, 4, 9, 0, 5, 6, 7, -1]),
    (16, [[2, 0], [1, -1]], [0, 0, 1, 1], [15, 16, 3, -1]),
    (3, [[4, 1, 0], [2, -1, -1]], [0, 0, 1], [2, 7, 1]),
]


SLOT_HINT = ("slot = block_tables[seq, pos // block_size] * block_size + pos % block_size, "
             "with the block_size you are given (not a constant); position -1 (padding) maps "
             "to -1 and must not index the table")


def check_slot_mapping(slot_mapping: Callable[..., torch.Tensor]) -> None:
    """05.6: slot of each new token from its sequence's block table (int64, -1 padding)."""
    from paged_lib.kernels import reshape_and_cache
    from paged_lib.kernels.cache import slot_mapping_from_positions

    with grading.exercise("05.6", "Slot mapping"):
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
            grading.expect_equal(got.tolist(), expected.tolist(), f"{what}: slot_mapping",
                                 hint=SLOT_HINT)
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
    with grading.exercise("05.7", "Merge split-KV partials"):
        g = torch.Generator().manual_seed(0)
        for shift, cuts in [(0.0, [(0, 5), (5, 9), (9, 12), (12, 12)]),
                            (1000.0, [(0, 2), (2, 12)]), (-1000.0, [(0, 7), (7, 12)])]:
            scores = (torch.randn(12, generator=g) * 3).double() + shift
            v = torch.randn(12, 4, generator=g).double()
            full = torch.softmax(scores, 0) @ v
            out, lse = _partials(scores, v, cuts)
            got = merge_partials(out, lse)
            what = f"segments {cuts}, log-sum-exps around {shift:g}"
            if isinstance(got, torch.Tensor) and got.isnan().any():
                grading.fail(f"{what}: the merged output is NaN",
                             hint="exp(lse) overflows (or underflows to 0/0) for log-sum-exps "
                                  "far from 0: weight by exp(lse_j - max lse)")
            grading.expect_tensor_close(
                got, full, f"{what}: merged output", atol=1e-9, rtol=1e-9,
                hint="weight each partial by exp(lse_j - max lse) (an empty segment, lse = "
                     "-inf, weighs 0) and divide by the sum of the weights")
