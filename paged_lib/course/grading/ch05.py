"""Checks for chapter 05's exercises: a Triton ramp, the paged decode kernel, slots, merge.

Kernels are launched on tiny grids (a few programs) so that each check takes about a
second in Triton's interpreter. Two kinds of evidence, because each proves something
the other cannot:

* **NaN poisoning**: every cache slot (or matrix element) the kernel must not use holds
  NaN, so poison that reaches the output shows up as NaN there;
* **the load trace** (:mod:`paged_lib.instruments.load_trace`, interpreter only): every
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

from paged_lib.course import grading
from paged_lib.instruments.load_trace import LoadTrace, trace_loads
from paged_lib.kernels.cases import NAN_BLOCK, make_decode_case
from paged_lib.kernels.reference import gather_kv, ref_paged_attention
from paged_lib.util import cdiv

#: Exercise id -> the library object it re-implements (chapter 05 must not show them).
TWINS: dict[str, str] = {
    "05.5": "paged_lib.kernels.triton_decode._paged_decode_kernel",
    "05.6": "paged_lib.kernels.cache.slot_mapping_from_positions",
    "05.7": "paged_lib.kernels.triton_split.merge_splits",
}

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

NAN = float("nan")
#: What surrounds an output: a kernel that stores there (even NaN) changes it.
OUT_GUARD = -7777.0


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


class Guarded:
    """A tensor in the middle of a flat buffer with ``pad`` poisoned elements on each side.

    A learner's kernel that loads or stores a little outside the tensor (a tile hanging
    over the edge, a negative offset) touches the guard, not memory nobody owns (which
    could crash the notebook's kernel); the trace and the guard's values show it.
    """

    def __init__(self, values: torch.Tensor, pad: int, fill: float | int = NAN):
        pad = max(pad, values.numel())  # a sign error in an offset stays in the guard
        self.pad, self.shape, self.fill = pad, tuple(values.shape), fill
        buffer = torch.full((values.numel() + 2 * pad,), fill, dtype=values.dtype)
        buffer[pad:pad + values.numel()] = values.reshape(-1)
        self.buffer = buffer.to(_device())
        self.view = self.buffer[pad:pad + values.numel()].view(self.shape)

    def reads(self, trace: LoadTrace) -> list[tuple[tuple, np.ndarray, np.ndarray]]:
        """Per load touching the buffer: (program, flat index relative to the view, mask)."""
        return [(r.program, r.index[:, 0] - self.pad, r.mask)
                for r in trace.reads_of(self.buffer)]

    def guard_intact(self) -> bool:
        buf = self.buffer.cpu()
        guard = torch.cat([buf[:self.pad], buf[self.pad + self.view.numel():]])
        return bool(guard.isnan().all()) if isinstance(self.fill, float) and \
            math.isnan(self.fill) else bool((guard == self.fill).all())


def _first_outside(guarded: Guarded, trace: LoadTrace, inside: Callable[[np.ndarray], np.ndarray]
                   ) -> tuple[tuple, int, int] | None:
    """(program, flat index, count) of the first load with unmasked lanes outside."""
    for program, flat, mask in guarded.reads(trace):
        bad = mask & ~inside(flat)
        if bad.any():
            return program, int(flat[np.flatnonzero(bad)[0]]), int(bad.sum())
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
            x = torch.randn(m, n, generator=g)
            rows = torch.full((m, stride), NAN)
            rows[:, :n] = x
            x_g = Guarded(rows, pad=bm * stride + bn)
            out_g = Guarded(torch.full((m, n), NAN), pad=bm * n + bn, fill=OUT_GUARD)
            what = f"M={m}, N={n}, stride_x={stride}, BLOCK_M={bm}, BLOCK_N={bn}"
            trace = launch(kernel, (cdiv(m, bm), cdiv(n, bn)), x_g.view, out_g.view, m, n,
                           stride, BLOCK_M=bm, BLOCK_N=bn)
            if _interpreted():
                bad = _first_outside(x_g, trace, lambda f, m=m, s=stride, n=n: (f >= 0)
                                     & (f < m * s) & (f % s < n))
                if bad:
                    (pm, pn, _), flat, count = bad
                    i, j = divmod(flat, stride)
                    grading.fail(f"{what}: program ({pm}, {pn}) read x[{i}, {j}], outside the "
                                 f"{m} x {n} matrix ({count} such element(s) in that load)",
                                 hint=_tile_hint(x_g, trace, m, n, bm, bn))
            grading.expect_true(out_g.guard_intact(),
                                f"{what}: the kernel wrote outside out (past its last row or "
                                "column)", hint="mask the store too, with the same (row, "
                                "column) mask")
            got = out_g.view.cpu()
            _expect_no_nan(got, 2 * x, f"{what}, out", hint="mask loads and stores with "
                           "rows < M and cols < N")
            grading.expect_tensor_close(got, 2 * x, f"{what}, out",
                                        hint="element (i, j) of x is at i * stride_x + j "
                                             "(stride_x, not N); of out at i * N + j")


def _tile_hint(x_g: Guarded, trace: LoadTrace, m: int, n: int, bm: int, bn: int) -> str:
    """Wrong mask, or right mask and wrong addresses? Count the lanes each load enabled."""
    for (pm, pn, _), _, mask in x_g.reads(trace):
        inside = (min(m, (pm + 1) * bm) - pm * bm) * (min(n, (pn + 1) * bn) - pn * bn)
        if int(mask.sum()) != inside:
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
            x = torch.randn(num_rows, d, generator=g)
            x_g = Guarded(x, pad=d * (block + 1))
            idx = torch.full((n + block,), num_rows, dtype=torch.int32)  # past n: garbage,
            idx[:n] = torch.randperm(num_rows, generator=g)[:n].to(torch.int32)  # row "num_rows"
            idx_g = Guarded(idx, pad=block, fill=num_rows)
            out_g = Guarded(torch.full((n, d), NAN), pad=d * (block + 1), fill=OUT_GUARD)
            what = f"{num_rows} rows of {d}, n={n}, BLOCK_I={block}"
            trace = launch(kernel, (cdiv(n, block),), x_g.view, idx_g.view[:n], out_g.view, n,
                           D=d, BLOCK_I=block)
            if _interpreted():
                bad = _first_outside(idx_g, trace, lambda f, n=n: (f >= 0) & (f < n))
                if bad:
                    grading.fail(f"{what}: program {bad[0][0]} read idx[{bad[1]}], outside its "
                                 f"n={n} entries", hint="mask the load of idx with i < n "
                                 "(other=0)")
                if trace.narrow_offsets(x_g.buffer, reach=d):
                    grading.fail(f"{what}: the offsets into x (row id x D) were computed in "
                                 "32 bits",
                                 hint="cast the row ids to tl.int64 before multiplying: "
                                      "beyond 2**31 elements a 32-bit offset wraps and reads "
                                      "the wrong row")
            grading.expect_true(out_g.guard_intact(),
                                f"{what}: the kernel wrote rows of out at i >= n (or < 0)",
                                hint="mask the store with i < n")
            grading.expect_tensor_close(out_g.view.cpu(), x[idx[:n].long()], f"{what}, out",
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
            x_g = Guarded(x, pad=block)
            out_g = Guarded(torch.full((rows, n), NAN), pad=block, fill=OUT_GUARD)
            what = f"{rows} rows of N={n}, BLOCK_N={block}"
            trace = launch(kernel, (rows,), x_g.view, out_g.view, n, BLOCK_N=block)
            if _interpreted():
                for (row, _, _), flat, mask in x_g.reads(trace):
                    bad = mask & ((flat < row * n) | (flat >= (row + 1) * n))
                    if bad.any():
                        f = int(flat[np.flatnonzero(bad)[0]])
                        grading.fail(f"{what}: program {row} read element {f - row * n} of "
                                     f"its row {row}, which has {n}",
                                     hint="mask the load with cols < N (other=-inf)")
            got = out_g.view.cpu()
            expected = torch.softmax(x.double(), 1).float()
            if got[0].isnan().any() or got[0].isinf().any():
                grading.fail(f"{what}: row 0 (values around 500) came out NaN or inf",
                             hint="subtract the row's max before tl.exp: exp(500) overflows")
            grading.expect_tensor_close(
                got, expected, f"{what}, out", atol=1e-5, rtol=1e-4,
                hint="padding lanes (cols >= N) must get weight 0: load them with "
                     "other=-inf (exp(-inf) = 0), not 0")
            grading.expect_true(out_g.guard_intact(),
                                f"{what}: the kernel wrote outside out",
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
            q_g, k_g, v_g = (Guarded(t, pad=tile * d) for t in (q, k, v))
            out_g = Guarded(torch.full((batch, d), NAN), pad=tile * d, fill=OUT_GUARD)
            scale = d ** -0.5
            what = f"batch {batch}, N={n}, D={d}, TILE={tile}"
            trace = launch(kernel, (batch,), q_g.view, k_g.view, v_g.view, out_g.view, n, scale,
                           D=d, TILE=tile)
            if _interpreted():
                _check_tiles(trace, k_g, "K", n, d, tile, what)
                _check_tiles(trace, v_g, "V", n, d, tile, what)
            grading.expect_true(out_g.guard_intact(), f"{what}: the kernel wrote outside out",
                                hint="program b writes out[b, :D] only")
            got = out_g.view.cpu()
            expected = (torch.softmax(torch.einsum("bnd,bd->bn", k.double(), q.double())
                                      * scale, 1)[..., None] * v.double()).sum(1).float()
            if got[0].isnan().any() or got[0].isinf().any():
                grading.fail(f"{what}: scores in the hundreds gave NaN or inf",
                             hint="exponentiate s - m_new, never s itself: exp(200) overflows")
            grading.expect_tensor_close(
                got, expected, f"{what}, out", atol=1e-4, rtol=1e-4,
                hint="when the max grows, rescale l and acc by alpha = exp(m_old - m_new) "
                     "before adding the new tile; the last tile is partial (N % TILE)")


def _check_tiles(trace: LoadTrace, kv: Guarded, name: str, n: int, d: int, tile: int,
                 what: str) -> None:
    """Each program reads its own ``n`` rows of K (or V), each element once, ``tile`` at a time."""
    seen: dict[int, np.ndarray] = {}
    for (b, _, _), flat, mask in kv.reads(trace):
        bad = mask & ((flat < b * n * d) | (flat >= (b + 1) * n * d))
        if bad.any():
            token = int(flat[np.flatnonzero(bad)[0]]) // d - b * n
            grading.fail(f"{what}: program {b} loaded {name} at token {token} (it has N={n}) "
                         "without a mask", hint=f"load {name} with mask=(tokens < N)[:, None]: "
                         "tl.where on the scores hides the NaN but not the read past the end")
        counts = seen.setdefault(b, np.zeros(n * d, dtype=np.int64))
        np.add.at(counts, flat[mask] - b * n * d, 1)
        if mask.sum() > tile * d:
            grading.fail(f"{what}: program {b} loaded {int(mask.sum()) // d} tokens of "
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
        if not _interpreted():
            break
        size = g.view.numel()
        bad = _first_outside(g, trace, lambda f, n=size: (f >= 0) & (f < n))
        if bad:
            grading.fail(f"program {bad[0][:2]} read {name} outside the cache ({bad[2]} "
                         "element(s) in one load)",
                         hint="element (block, slot, head, dim) is at ((block * BLOCK_SIZE + "
                              "slot) * NUM_KV_HEADS + head) * HEAD_DIM + dim")
    return out_g.view.cpu(), trace, (k_g.view, v_g.view)


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
