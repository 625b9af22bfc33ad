"""Checks for chapter 05: the Triton ramp (05.1-05.4), the paged decode kernel (05.5), slot
mapping (05.6) and merging split-KV partials (05.7), on seeded generated cases shrunk at the
first failure. A kernel's evidence: NaN poisoning (every tensor sits in a :class:`Guarded`
buffer) and, in Triton's interpreter, the load trace (:mod:`paged_lib.instruments.load_trace`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from paged_lib.course import grading
from paged_lib.course.grading import slips
from paged_lib.course.grading.generated import numeric, numeric_decode, small_attention
from paged_lib.course.grading.generated.numeric import Contrast, Named
from paged_lib.device import interpreter_on as interpreted
from paged_lib.instruments.load_trace import LoadTrace, trace_loads
from paged_lib.kernels.reference import ref_paged_attention
from paged_lib.util import cdiv

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
OUT_GUARD = -7777.0  #: what surrounds an output: a kernel that stores there changes it
MIN_DOT = 16  #: the smallest tile dimension ``tl.dot`` accepts on NVIDIA GPUs


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **constants: Any) -> LoadTrace:
    """Run the learner's kernel; return its load trace (empty when compiled on a GPU). A stub
    still holding ``raise NotImplementedError`` (read in its source: a GPU backend would not
    compile it) is 'not attempted'; what the kernel raised is shown unwrapped."""
    try:
        if "raise NotImplementedError" in inspect.getsource(getattr(kernel, "fn", kernel)):
            raise NotImplementedError
    except (OSError, TypeError):
        pass
    with trace_loads() as trace, np.errstate(all="ignore"):  # overflow: reported as such
        try:
            kernel[grid](*args, **constants)
        except Exception as err:
            cause = err.__cause__
            if isinstance(cause, NotImplementedError) and str(cause):  # Triton's, not a stub's
                grading.fail(f"Triton raised NotImplementedError: {cause}", hint="this Triton "
                             "does not have it: address memory as ptr + offsets, with masks")
            if isinstance(cause, NotImplementedError):
                raise NotImplementedError from err
            if cause is not None and type(err).__name__ == "InterpreterError":
                raise cause from None
            raise
    for dot in trace.dots:  # the interpreter runs it, no NVIDIA GPU compiles it
        if min(dot.a_shape[-2:] + dot.b_shape[-2:]) < MIN_DOT:
            grading.fail(f"program {dot.program[:2]} called tl.dot on a {list(dot.a_shape)} x "
                         f"{list(dot.b_shape)} tile: the interpreter runs it, but a GPU needs "
                         f"every dimension of a tl.dot to be at least {MIN_DOT}",
                         hint="for tiles this small use tl.sum(a[:, :, None] * b[None, :, :], "
                              "axis=1); or pad the tile to 16 rows (masked) before tl.dot")
    return trace


class Guarded:
    """A tensor in the middle of a flat buffer with ``pad`` (at least its size) poisoned
    elements on each side: a load or store a little outside touches the guard, not memory
    nobody owns; the trace and the guard's values show it."""

    def __init__(self, values: torch.Tensor, pad: int, fill: float | int = NAN):
        from paged_lib import default_device

        self.pad = pad = max(pad, values.numel())
        buffer = torch.full((values.numel() + 2 * pad,), fill, dtype=values.dtype)
        buffer[pad:pad + values.numel()] = values.reshape(-1)
        self.buffer, self.fill = buffer.to(default_device()), fill
        self.view = self.buffer[pad:pad + values.numel()].view(values.shape)

    def reads(self, trace: LoadTrace) -> list[tuple[tuple, np.ndarray, np.ndarray]]:
        """Per load touching the buffer: (program, flat index relative to the view, mask)."""
        return [(r.program, r.index[:, 0] - self.pad, r.mask)
                for r in trace.reads_of(self.buffer)]

    def guard_intact(self) -> bool:
        buf = self.buffer.cpu()
        guard = torch.cat([buf[:self.pad], buf[self.pad + self.view.numel():]])
        return bool(((guard == self.fill) | (guard.isnan() & (self.fill != self.fill))).all())


def first_outside(guarded: Guarded, trace: LoadTrace, inside: Callable[[np.ndarray], np.ndarray]
                  ) -> tuple[tuple, int, int] | None:
    """(program, flat index, count) of the first load with unmasked lanes outside."""
    for program, flat, mask in guarded.reads(trace):
        bad = mask & ~inside(flat)
        if bad.any():
            return program, int(flat[np.flatnonzero(bad)[0]]), int(bad.sum())
    return None


def _ramp(ex: str, case: Callable, kernel: Any) -> None:
    """05.1-05.4: their generated cases, ``case(kernel, *built)`` each."""
    with grading.exercise(ex):
        numeric.check(ex, numeric_decode.ramp_cases(ex), lambda p: case(kernel, *p.build()),
                      numeric_decode.RAMP_CONTRASTS[ex])


def _expect_wide(trace: LoadTrace, ids: Guarded, what: str, name: str) -> None:
    """An id loaded from ``ids`` (a row id, a block id) is widened before any multiply."""
    if interpreted() and trace.narrow_products(ids.buffer):
        grading.fail(f"{what}: a {name} loaded from the table was multiplied in 32 bits (a cast to "
                     "int64 after the multiply is too late: the product has already wrapped)",
                     hint=f"cast the {name} to tl.int64 right after loading it, before any "
                          "multiply: in int32 the product wraps once the tensor passes 2**31 "
                          "elements (a few GB), and .to(tl.int64) on the result cannot undo it")


def _outputs(shape: tuple[int, ...], pad: int) -> Guarded:
    return Guarded(torch.full(shape, NAN), pad=pad, fill=OUT_GUARD)


# ------------------------------------------------------------------- 05.1 a 2-D masked tile

def check_scale_tile(kernel: Any) -> None:
    """05.1: ``out = 2 * x`` for an ``[M, N]`` view with row stride ``stride_x``."""
    _ramp("05.1", _tile_case, kernel)


def _tile_case(kernel: Any, x: torch.Tensor, stride: int, bm: int, bn: int) -> None:
    m, n = x.shape
    rows = torch.full((m, stride), NAN)
    rows[:, :n] = x
    x_g, out_g = Guarded(rows, pad=bm * stride + bn), _outputs((m, n), bm * n + bn)
    what = f"M={m}, N={n}, stride_x={stride}, BLOCK_M={bm}, BLOCK_N={bn}"
    trace = launch(kernel, (cdiv(m, bm), cdiv(n, bn)), x_g.view, out_g.view, m, n,
                   stride, BLOCK_M=bm, BLOCK_N=bn)
    addresses = ("element (i, j) of x is at i * stride_x + j (stride_x, not N: x is a view "
                 "into wider rows); of out at i * N + j")
    bad = interpreted() and first_outside(
        x_g, trace, lambda f: (f >= 0) & (f < m * stride) & (f % stride < n))
    if bad:
        (pm, pn, _), flat, count = bad
        i, j = divmod(flat, stride)
        grading.fail(f"{what}: program ({pm}, {pn}) read x[{i}, {j}], outside the "
                     f"{m} x {n} matrix ({count} such element(s) in that load)",
                     hint=Named("mask the load with (rows < M)[:, None] & (cols < N)[None, :] "
                                "(a tile at the edge hangs over the last row and column); "
                                + addresses))
    grading.expect_true(out_g.guard_intact(), f"{what}: the kernel wrote outside out",
                        hint=Named("mask the store with the same (row, column) mask; out[i, j] "
                                   "is at i * N + j (stride_x is x's row stride only)"))
    got = out_g.view.cpu()
    unwritten = got.isnan()
    if unwritten.any():  # never stored (in the interpreter every load was inside), or poison
        i, j = (int(v) for v in unwritten.nonzero()[0])
        grading.fail(f"{what}: {int(unwritten.sum())} element(s) of out were never "
                     f"written (or NaN), the first out[{i}, {j}]",
                     hint="every element must fall in one program's tile: program (pid_m, pid_n) = "
                          "(program_id(0), program_id(1)) covers rows pid_m * BLOCK_M + "
                          "arange(BLOCK_M) and columns pid_n * BLOCK_N + arange(BLOCK_N); loads "
                          "and stores masked with rows < M and cols < N")
    grading.expect_tensor_close(got, 2 * x, f"{what}, out",
                                hint=slips.rounded(got, 2 * x) or addresses)


# --------------------------------------------------------------- 05.2 gather through a table

def check_gather_rows(kernel: Any) -> None:
    """05.2: ``out[i] = x[idx[i]]`` for ``i < n``; row ids int32, offsets int64."""
    _ramp("05.2", _gather_case, kernel)


def _gather_case(kernel: Any, x: torch.Tensor, ids: torch.Tensor, block: int) -> None:
    (num_rows, d), n = x.shape, len(ids)
    idx = torch.full((n + block,), num_rows, dtype=torch.int32)  # past n: garbage, row
    idx[:n] = ids                                                # "num_rows"
    x_g, idx_g = Guarded(x, pad=d * (block + 1)), Guarded(idx, pad=block, fill=num_rows)
    out_g = _outputs((n, d), d * (block + 1))
    what = f"{num_rows} rows of {d}, n={n}, BLOCK_I={block}"
    trace = launch(kernel, (cdiv(n, block),), x_g.view, idx_g.view[:n], out_g.view, n,
                   D=d, BLOCK_I=block)
    bad = interpreted() and first_outside(idx_g, trace, lambda f: (f >= 0) & (f < n))
    if bad:
        grading.fail(f"{what}: program {bad[0][0]} read idx[{bad[1]}], outside its "
                     f"n={n} entries", hint="mask the load of idx with i < n (other=0)")
    _expect_wide(trace, idx_g, what, "row id")
    rows: dict[tuple, int] = {}  # per program: x rows loaded minus row ids loaded
    for sign, g, width in ((1, x_g, d), (-1, idx_g, 1)) if interpreted() else ():
        for program, _, mask in g.reads(trace):
            rows[program] = rows.get(program, 0) + sign * int(mask.sum()) // width
    extra = max(rows.values(), default=0)
    if extra > 0:
        grading.fail(f"{what}: a program loaded {extra} row(s) of x for lanes i >= n",
                     hint=Named("mask the load of x with (i < n)[:, None] too: a lane past n "
                                "is no row of out, and without other its row id is undefined"))
    grading.expect_true(out_g.guard_intact(),
                        f"{what}: the kernel wrote rows of out at i >= n (or < 0)",
                        hint="mask the store with i < n")
    got = out_g.view.cpu()
    unwritten = got.isnan().any(1).nonzero()[:, 0].tolist()
    grading.expect_true(not unwritten, f"{what}: row(s) {unwritten} of out were never written",
                        hint="every row i < n belongs to one program: program pid covers "
                             "rows pid * BLOCK_I + arange(BLOCK_I)")
    grading.expect_tensor_close(got, x[ids.long()], f"{what}, out", atol=0, rtol=0,
                                hint="row i of out is row idx[i] of x (load idx[i] "
                                     "first), at offset idx[i] * D + d")


# ---------------------------------------------------------------------- 05.3 row softmax

def check_row_softmax(kernel: Any) -> None:
    """05.3: ``out = softmax(x, dim=1)``, one program per row, large and negative values."""
    _ramp("05.3", _softmax_case, kernel)


def _softmax_case(kernel: Any, x: torch.Tensor, block: int) -> None:
    rows, n = x.shape
    x_g, out_g = Guarded(x, pad=block), _outputs((rows, n), block)
    what = f"{rows} rows of N={n}, BLOCK_N={block}"
    trace = launch(kernel, (rows,), x_g.view, out_g.view, n, BLOCK_N=block)
    for (row, _, _), flat, mask in x_g.reads(trace) if interpreted() else []:
        bad = mask & ((flat < row * n) | (flat >= (row + 1) * n))
        if bad.any():
            f = int(flat[np.flatnonzero(bad)[0]])
            grading.fail(f"{what}: program {row} read element {f - row * n} of "
                         f"its row {row}, which has {n}",
                         hint=Named("the mask is right (N lanes) but the row starts "
                                    "at x_ptr + row * N: rows are N apart, not BLOCK_N"
                                    if int(mask.sum()) == n else
                                    "mask the load with cols < N (other=-inf)"))
    got, x64 = out_g.view.cpu(), x.double()
    for r in range(rows):
        if not got[r].isfinite().all():
            grading.fail(f"{what}: row {r} (values around {x[r].mean().item():.3g}) came "
                         "out NaN or inf",
                         hint="subtract the row's max before tl.exp: exp(500) overflows")
    want = torch.softmax(x64, 1)
    padded = torch.cat([x64, torch.zeros(rows, block - n, dtype=torch.float64)], 1)
    wrong = {"padding lanes (cols >= N) must get weight 0: load them with other=-inf (exp(-inf) "
             "= 0), not 0": torch.softmax(padded, 1)[:, :n], "each row must sum to 1: divide "
             "exp(x - max) by the row's sum of it": torch.exp(x64 - x64.amax(1, keepdim=True)),
             slips.SLIPS["exp2"]: torch.softmax(x64 * slips.LN2, 1),
             **{f"x was rounded to {name} on the way (float16's spacing near 500 is 0.25): "
                "keep float32 from load to store": torch.softmax(x.to(dt).double(), 1)
                for name, dt in (("float16", torch.float16), ("bfloat16", torch.bfloat16))}}
    grading.expect_tensor_close(
        got, want.float(), f"{what}, out", atol=1e-5, rtol=1e-4,
        hint=slips.rounded(got, want, "out", wrong) or "compare with torch.softmax(x, dim=1): "
        "exp(x - the row's max) over the row's N values, divided by their sum")
    grading.expect_true(out_g.guard_intact(), f"{what}: the kernel wrote outside out",
                        hint=Named("mask the store with cols < N"))


# ----------------------------------------------- 05.4 online softmax over contiguous K/V

def check_online_attention(kernel: Any) -> None:
    """05.4: ``out[b] = softmax(k[b] @ q[b] * scale) @ v[b]``, TILE keys per iteration."""
    _ramp("05.4", _attention_case, kernel)


def _attention_case(kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float, tile: int) -> None:
    batch, n, d = k.shape
    q_g, k_g, v_g = (Guarded(t, pad=tile * d) for t in (q, k, v))
    out_g = _outputs((batch, d), tile * d)
    what = f"batch {batch}, N={n}, D={d}, TILE={tile}"
    trace = launch(kernel, (batch,), q_g.view, k_g.view, v_g.view, out_g.view, n, scale,
                   D=d, TILE=tile)
    for name, kv in (("K", k_g), ("V", v_g)) if interpreted() else ():
        _check_tiles(trace, kv, name, n, d, tile, what)
    grading.expect_true(out_g.guard_intact(), f"{what}: the kernel wrote outside out",
                        hint="program b writes out[b, :D] only")
    got = out_g.view.cpu()
    expected = (torch.softmax(torch.einsum("bnd,bd->bn", k.double(), q.double())
                              * scale, 1)[..., None] * v.double()).sum(1).float()
    slips.expect_attention(
        got, expected, f"{what}, out", 1e-4, lambda: slips.contiguous_slips(q, k, v, scale, tile),
        "compare with the spec: one softmax over all N scores; the last tile is partial "
        "(N % TILE), its missing keys weigh 0",
        loud="exponentiate s - m_new, never s itself: exp(200) overflows")


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
    for b in range(kv.view.shape[0]):
        counts = seen.get(b, np.zeros(n * d, dtype=np.int64))
        if counts.min() == 0:
            grading.fail(f"{what}: program {b} never read {name} at token "
                         f"{int(np.flatnonzero(counts == 0)[0]) // d}",
                         hint="every key counts: loop over range(0, N, TILE), the last tile "
                              "masked (N need not be a multiple of TILE)")
        if counts.max() > 1:
            grading.fail(f"{what}: program {b} read {name} {int(counts.max())} times over",
                         hint="one pass is enough: keep a running max m, sum l and acc, "
                              "rescaled by exp(m_old - m_new) when m grows")


# -------------------------------------------------------------- 05.5 the paged decode kernel

_ADDRESS = ("element (block, slot, head, dim) is at ((block * BLOCK_SIZE + slot) * "
            "NUM_KV_HEADS + head) * HEAD_DIM + dim")


def run_decode_kernel(kernel: Any, case) -> tuple[torch.Tensor, LoadTrace, tuple]:
    """Launch the exercise kernel, one program per (sequence, KV head), every tensor in a
    :class:`Guarded` buffer; return the output (on the CPU), the trace and the cache views."""
    q, k_cache, v_cache, block_tables, seq_lens, scale = case
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    q_g, k_g, v_g = (Guarded(t, 0) for t in (q, k_cache, v_cache))
    out_g = Guarded(torch.full_like(q, NAN), 0, fill=OUT_GUARD)
    bt_g, lens_g = (Guarded(t, 0, fill=0) for t in (block_tables, seq_lens))  # block 0: all NaN
    trace = launch(kernel, (num_seqs, num_kv_heads), out_g.view, q_g.view, k_g.view, v_g.view,
                   bt_g.view, lens_g.view, scale, block_tables.shape[1],
                   NUM_KV_HEADS=num_kv_heads, GROUP=group,
                   GROUP_PAD=max(1, 1 << (group - 1).bit_length()), HEAD_DIM=head_dim,
                   BLOCK_SIZE=k_cache.shape[1])
    if not out_g.guard_intact():
        grading.fail("the kernel wrote outside out (padded query heads stored?)",
                     hint="store only the GROUP real rows of the tile: mask=(g < GROUP)[:, None]"
                          "; out[seq, head] is at (seq * num_heads + head) * HEAD_DIM")
    for name, g in (("K", k_g), ("V", v_g)) if interpreted() else ():
        bad = first_outside(g, trace, lambda f, g=g: (f >= 0) & (f < g.view.numel()))
        if bad:
            grading.fail(f"program {bad[0][:2]} read {name} outside the cache ({bad[2]} "
                         "element(s) in one load)", hint=_ADDRESS)
    bad = interpreted() and first_outside(q_g, trace, lambda f: (f >= 0) & (f < q.numel()))
    if bad:
        grading.fail(f"program {bad[0][:2]} read q past its end ({bad[2]} element(s) in one "
                     "load)", hint=Named("load q with mask=(g < GROUP)[:, None]: the tile's "
                                         "GROUP_PAD - GROUP padding rows are no query heads"))
    if interpreted():
        _check_iterations(trace, bt_g, k_g, seq_lens, k_cache.shape[1])
    _expect_wide(trace, bt_g, "this batch", "block id")
    return out_g.view.cpu(), trace, (k_g.view, v_g.view)


def _check_iterations(trace: LoadTrace, bt_g: Guarded, k_g: Guarded, seq_lens: torch.Tensor,
                      block_size: int) -> None:
    """Each program reads no block-table entry past its own sequence's blocks and loads no K
    tile with every lane masked off (looping over the widest table, not cdiv(seq_len, bs))."""
    lens, width = seq_lens.tolist(), bt_g.view.shape[1]
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
    idle = [program[:2] for program, _, mask in k_g.reads(trace) if not mask.any()]
    if idle:
        seq, head = idle[0]
        own = cdiv(int(lens[seq]), block_size)
        past = sum(p[:2] == idle[0] for p, _, _ in k_g.reads(trace)) > own
        grading.fail(f"program (seq {seq}, kv_head {head}) loaded K {idle.count(idle[0])} "
                     f"time(s) with every lane masked off, in {own} block(s) of its own"
                     + ": it iterates past them (over the widest block table?)" * past,
                     hint=hint if past else "a full last block (seq_len % BLOCK_SIZE == 0) "
                     "has BLOCK_SIZE slots in use, not 0: valid = j * BLOCK_SIZE + t < seq_len")


def _check_decode_reads(trace: LoadTrace, caches: tuple, case, what: str) -> None:
    """Each program reads its own KV head's slots of its own sequence, each element once."""
    bs, _, head_dim = case.k_cache.shape[1:]
    for name, cache in zip("KV", caches, strict=True):
        seen: dict[tuple, np.ndarray] = {}
        for read in trace.reads_of(cache):
            seq, kv_head = read.program[:2]
            n = int(case.seq_lens[seq])
            used = case.block_tables[seq].tolist()[:cdiv(n, bs)]
            who = f"{what}: program (seq {seq}, kv_head {kv_head}) read {name}"
            count = seen.setdefault((seq, kv_head), np.zeros(
                (case.k_cache.shape[0], bs, head_dim), dtype=np.int64))
            for blk, slot, head, dim in read.index[read.mask].tolist():
                if head != kv_head:
                    grading.fail(f"{who} of KV head {head}",
                                 hint="the KV head is program_id(1): " + _ADDRESS)
                pos = used.index(blk) * bs + slot if blk in used else None
                if pos is None or pos >= n:
                    grading.fail(f"{who} at block {blk}, slot {slot}: " + (
                        f"block {blk} is not one of sequence {seq}'s blocks {used} (a padding "
                        "entry of its block table?)" if pos is None else
                        f"position {pos} >= seq_len {n}, past the sequence's end"),
                                 hint=f"load {name} with mask=valid[:, None], valid = "
                                      "position < seq_len; tl.where on the scores hides the "
                                      "NaN but the read still happens (on a GPU: a fault or "
                                      "another sequence's data)")
                count[blk, slot, dim] += 1
        for (seq, kv_head), count in seen.items():
            if count.max() > 1:
                grading.fail(f"{what}: program (seq {seq}, kv_head {kv_head}) read the same "
                             f"{name} element {int(count.max())} times",
                             hint="load each K/V tile once and score it for all GROUP query "
                                  "heads at once: a [GROUP_PAD, HEAD_DIM] query tile")


def check_paged_decode_kernel(kernel: Any) -> None:
    """05.5: the paged decode kernel, one program per (sequence, KV head)."""
    def run(p: Any) -> None:
        case, what = p.build(), "this batch"
        got, trace, caches = run_decode_kernel(kernel, case)
        if interpreted():
            _check_decode_reads(trace, caches, case, what)
        gpu = "" if interpreted() else " (on a GPU, a read past seq_len gives NaN too)"
        slips.expect_attention(
            got, ref_paged_attention(*case), f"{what}, out [seq, head, dim]", 1e-4,
            lambda: slips.decode_slips(case.q, case.k_cache, case.v_cache,
                                 case.block_tables.tolist(), case.seq_lens.tolist(), case.scale),
            "compare with the spec: query head h = kv_head * GROUP + g attends with its own "
            "softmax over the sequence's seq_len keys",
            loud="exp of a raw score overflows float32 beyond 88: keep a running max m and "
                 "exponentiate s - m_new, rescaling l and acc by exp(m_old - m_new) when m "
                 "grows" + gpu if p.loud > 1 else None,
            poison=small_attention.BELOW_HINT if p.below else "visit only cdiv(seq_len, "
            "BLOCK_SIZE) blocks, mask K and V loads (other=0.0) and scores (-inf) past seq_len; "
            "a full last block (seq_len % BLOCK_SIZE == 0) has BLOCK_SIZE slots in use, not 0")

    with grading.exercise("05.5"):
        numeric.check("05.5", numeric_decode.decode_cases(), run, numeric_decode.DECODE_CONTRASTS)


# ------------------------------------------------------------------ 05.6 and 05.7

def check_slot_mapping(slot_mapping: Callable[..., torch.Tensor]) -> None:
    """05.6: slot of each new token from its sequence's block table (int64, -1 padding)."""
    with grading.exercise("05.6"):
        numeric.check("05.6", small_attention.slot_cases(), lambda p: small_attention.run_slots(
            slot_mapping, p), (Contrast(lambda p: replace(p, block_size=32) if p.block_size & (
                p.block_size - 1) else None, "it passes with block sizes that are powers of two "
                "and fails with others: use // and %, not shifts and bit masks"),
                               *small_attention.SLOT_CONTRASTS))


def check_merge_partials(merge_partials: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                         ) -> None:
    """05.7: merge split-KV partial outputs with their log-sum-exps."""
    with grading.exercise("05.7"):
        cases = [*small_attention.partials_cases(),
                 small_attention.Partials(30, (1, 1, 1), 2, 1.0, 0.0, None),
                 # lse -821, 820, -98: centred on their mean, not their max, exp(853) overflows
                 small_attention.Partials(52, (1, 1, 1), 2, 600.0, 0.0, None)]
        numeric.check("05.7", cases, lambda p: small_attention.run_partials(
            merge_partials, p), (*small_attention.PARTIALS_CONTRASTS, Contrast(
                lambda p: replace(p, shift=30.0) if p.shift == 0 else None, "it passes when "
                "every log-sum-exp is positive: lse <= 0 is a segment like any other (only "
                "-inf marks an empty one)")))
