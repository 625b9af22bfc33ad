"""Chapter 05's ramp (05.1-05.4): a masked tile, a gather through a table, a row softmax,
an online softmax over contiguous K/V."""

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
from paged_lib.course.grading.slips import contiguous_slips, name_slip
from paged_lib.instruments.load_trace import LoadTrace
from paged_lib.util import cdiv

# ------------------------------------------------------------------- 05.1 a 2-D masked tile

def check_scale_tile(kernel: Any) -> None:
    """05.1: ``out = 2 * x`` for an ``[M, N]`` view with row stride ``stride_x``."""
    with grading.exercise("05.1"):
        g = torch.Generator().manual_seed(51)
        for m, n, stride, bm, bn in [(5, 7, 9, 4, 4), (3, 16, 16, 4, 8)]:
            _tile_case(kernel, torch.randn(m, n, generator=g), stride, bm, bn)
        _ramp_stage("05.1", lambda p: _tile_case(kernel, *p.build()))


def _ramp_stage(ex: str, run: Any) -> None:
    """The generated stage of 05.1-05.4 (:mod:`~paged_lib.course.grading.generated.numeric`)."""
    numeric.check(ex, numeric_decode.ramp_cases(ex), run, numeric_decode.RAMP_CONTRASTS[ex])


def _tile_case(kernel: Any, x: torch.Tensor, stride: int, bm: int, bn: int) -> None:
    m, n = x.shape
    rows = torch.full((m, stride), NAN)
    rows[:, :n] = x
    x_g = Guarded(rows, pad=bm * stride + bn)
    out_g = Guarded(torch.full((m, n), NAN), pad=bm * n + bn, fill=OUT_GUARD)
    what = f"M={m}, N={n}, stride_x={stride}, BLOCK_M={bm}, BLOCK_N={bn}"
    trace = launch(kernel, (cdiv(m, bm), cdiv(n, bn)), x_g.view, out_g.view, m, n,
                   stride, BLOCK_M=bm, BLOCK_N=bn)
    if interpreted():
        bad = first_outside(x_g, trace, lambda f: (f >= 0) & (f < m * stride) & (f % stride < n))
        if bad:
            (pm, pn, _), flat, count = bad
            i, j = divmod(flat, stride)
            grading.fail(f"{what}: program ({pm}, {pn}) read x[{i}, {j}], outside the "
                         f"{m} x {n} matrix ({count} such element(s) in that load)",
                         hint=_tile_hint(x_g, trace, m, n, bm, bn))
    if not out_g.guard_intact():
        _fail_store_outside(out_g, 2 * x, stride, what)
    got = out_g.view.cpu()
    unwritten = got.isnan()
    if interpreted() and unwritten.any():  # every load was inside: never stored
        i, j = (int(v) for v in unwritten.nonzero()[0])
        grading.fail(f"{what}: {int(unwritten.sum())} element(s) of out were never "
                     f"written, the first out[{i}, {j}]",
                     hint="every element must fall in one program's tile: program "
                          "(pid_m, pid_n) = (program_id(0), program_id(1)) covers "
                          "rows pid_m * BLOCK_M + arange(BLOCK_M) and columns "
                          "pid_n * BLOCK_N + arange(BLOCK_N)")
    expect_no_nan(got, 2 * x, f"{what}, out", hint="mask loads and stores with "
                  "rows < M and cols < N; and every element must fall in one "
                  "program's tile (rows from program_id(0), columns from "
                  "program_id(1))")
    grading.expect_tensor_close(got, 2 * x, f"{what}, out",
                                hint=_rounded_hint(got, 2 * x, "out = 2 * x") or
                                "element (i, j) of x is at i * stride_x + j "
                                "(stride_x, not N); of out at i * N + j")


def _fail_store_outside(out_g: Guarded, want: torch.Tensor, stride: int, what: str) -> None:
    """The store reached out's guard: rows stride_x apart, or lanes left unmasked."""
    m, n = want.shape
    flat = out_g.buffer.cpu()[out_g.pad:]
    at_stride = (torch.arange(m)[:, None] * stride + torch.arange(n)[None, :]).reshape(-1)
    if stride != n and at_stride.max() < flat.numel() and \
            torch.allclose(flat[at_stride], want.reshape(-1)):
        grading.fail(f"{what}: the kernel wrote row i of the result at out + i * stride_x, "
                     "past the end of out",
                     hint="out is a new contiguous [M, N] tensor: element (i, j) of out is at "
                          "i * N + j; stride_x is x's row stride only")
    grading.fail(f"{what}: the kernel wrote outside out (past its last row or column)",
                 hint="mask the store too, with the same (row, column) mask")


def _rounded_hint(got: torch.Tensor, want: torch.Tensor, what: str) -> str | None:
    """A hint when ``got`` is ``want`` rounded to a 16-bit float (a cast on the way)."""
    if got.shape != want.shape or not got.isfinite().all():
        return None
    right = (got.double() - want.double()).abs().max().item()
    for dtype in (torch.float16, torch.bfloat16):
        if (got.double() - want.to(dtype).double()).abs().max().item() < right / 8:
            return (f"{what} came out rounded to {str(dtype).split('.')[1]}: a value was "
                    "cast to a 16-bit float on the way; keep float32 from load to store")
    return None


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
    with grading.exercise("05.2"):
        g = torch.Generator().manual_seed(52)
        for num_rows, n, d, block in [(9, 5, 8, 4), (12, 3, 16, 2)]:
            _gather_case(kernel, torch.randn(num_rows, d, generator=g),
                         torch.randperm(num_rows, generator=g)[:n].to(torch.int32), block)
        _ramp_stage("05.2", lambda p: _gather_case(kernel, *p.build()))


def _gather_case(kernel: Any, x: torch.Tensor, ids: torch.Tensor, block: int) -> None:
    (num_rows, d), n = x.shape, len(ids)
    x_g = Guarded(x, pad=d * (block + 1))
    idx = torch.full((n + block,), num_rows, dtype=torch.int32)  # past n: garbage, row
    idx[:n] = ids                                                # "num_rows"
    idx_g = Guarded(idx, pad=block, fill=num_rows)
    out_g = Guarded(torch.full((n, d), NAN), pad=d * (block + 1), fill=OUT_GUARD)
    what = f"{num_rows} rows of {d}, n={n}, BLOCK_I={block}"
    trace = launch(kernel, (cdiv(n, block),), x_g.view, idx_g.view[:n], out_g.view, n,
                   D=d, BLOCK_I=block)
    if interpreted():
        bad = first_outside(idx_g, trace, lambda f: (f >= 0) & (f < n))
        if bad:
            grading.fail(f"{what}: program {bad[0][0]} read idx[{bad[1]}], outside its "
                         f"n={n} entries", hint="mask the load of idx with i < n (other=0)")
        if trace.narrow_products(idx_g.buffer):
            grading.fail(f"{what}: a row id loaded from idx was multiplied in 32 bits "
                         "(a cast to int64 after the multiply is too late: the "
                         "product has already wrapped)",
                         hint="cast the row ids to tl.int64 right after loading them, "
                              "before multiplying by D: beyond 2**31 elements an "
                              "int32 product wraps and reads the wrong row")
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
    with grading.exercise("05.3"):
        g = torch.Generator().manual_seed(53)
        for rows, n, block in [(3, 5, 8), (2, 16, 16), (2, 3, 4)]:
            x = torch.randn(rows, n, generator=g) * 3
            x[0] += 500.0  # exp(500) overflows float32: subtract the row max first
            x[-1] -= 50.0  # all negative: padding lanes must weigh 0, not exp(0 - max)
            _softmax_case(kernel, x, block)
        _ramp_stage("05.3", lambda p: _softmax_case(kernel, *p.build()))


def _softmax_case(kernel: Any, x: torch.Tensor, block: int) -> None:
    rows, n = x.shape
    x_g = Guarded(x, pad=block)
    out_g = Guarded(torch.full((rows, n), NAN), pad=block, fill=OUT_GUARD)
    what = f"{rows} rows of N={n}, BLOCK_N={block}"
    trace = launch(kernel, (rows,), x_g.view, out_g.view, n, BLOCK_N=block)
    if interpreted():
        for (row, _, _), flat, mask in x_g.reads(trace):
            bad = mask & ((flat < row * n) | (flat >= (row + 1) * n))
            if bad.any():
                f = int(flat[np.flatnonzero(bad)[0]])
                grading.fail(f"{what}: program {row} read element {f - row * n} of "
                             f"its row {row}, which has {n}",
                             hint="the mask is right (N lanes) but the row starts "
                                  "at x_ptr + row * N: rows are N apart, not "
                                  "BLOCK_N" if int(mask.sum()) == n else
                                  "mask the load with cols < N (other=-inf)")
    got = out_g.view.cpu()
    expected = torch.softmax(x.double(), 1).float()
    for r in range(rows):
        if not got[r].isfinite().all():
            grading.fail(f"{what}: row {r} (values around {x[r].mean().item():.3g}) came "
                         "out NaN or inf",
                         hint="subtract the row's max before tl.exp: exp(500) overflows")
    grading.expect_tensor_close(
        got, expected, f"{what}, out", atol=1e-5, rtol=1e-4,
        hint=_softmax_slip(got, x, block) or "compare with torch.softmax(x, dim=1): "
             "exp(x - the row's max) over the row's N values, divided by their sum")
    grading.expect_true(out_g.guard_intact(), f"{what}: the kernel wrote outside out",
                        hint="mask the store with cols < N")


_SOFTMAX_SLIPS = {
    "other=0": "padding lanes (cols >= N) must get weight 0: load them with other=-inf "
               "(exp(-inf) = 0), not 0",
    "no sum": "each row must sum to 1: divide exp(x - max) by the row's sum of it",
    "float16": "x was rounded to float16 on the way (its spacing near 500 is 0.25): keep "
               "float32 from load to store",
    "bfloat16": "x was rounded to bfloat16 on the way: keep float32 from load to store",
}


def _softmax_slip(got: torch.Tensor, x: torch.Tensor, block: int) -> str | None:
    """The hint of the typical wrong softmax that explains ``got`` (see slips.name_slip)."""
    x64 = x.double()
    padded = torch.cat([x64, torch.zeros(x.shape[0], block - x.shape[1],
                                         dtype=torch.float64)], 1)
    slips = {"other=0": torch.softmax(padded, 1)[:, :x.shape[1]],
             "no sum": torch.exp(x64 - x64.amax(1, keepdim=True)),
             "float16": torch.softmax(x.half().double(), 1),
             "bfloat16": torch.softmax(x.bfloat16().double(), 1)}
    rounded = _rounded_hint(got, torch.softmax(x64, 1), "out")
    if rounded:
        return rounded
    return name_slip(got, torch.softmax(x64, 1), slips, _SOFTMAX_SLIPS)


# ----------------------------------------------- 05.4 online softmax over contiguous K/V

def check_online_attention(kernel: Any) -> None:
    """05.4: ``out[b] = softmax(k[b] @ q[b] * scale) @ v[b]``, TILE keys per iteration."""
    with grading.exercise("05.4"):
        g = torch.Generator().manual_seed(54)
        for batch, n, d, tile in [(2, 13, 8, 4), (2, 8, 16, 8), (1, 3, 8, 4)]:
            q = torch.randn(batch, d, generator=g)
            q[0] *= 40.0  # scores in the hundreds: exp without the max overflows
            k = torch.randn(batch, n, d, generator=g)
            _attention_case(kernel, q, k, torch.randn(batch, n, d, generator=g), d ** -0.5,
                            tile)
        _ramp_stage("05.4", lambda p: _attention_case(kernel, *p.build()))


def _attention_case(kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float, tile: int) -> None:
    batch, n, d = k.shape
    q_g, k_g, v_g = (Guarded(t, pad=tile * d) for t in (q, k, v))
    out_g = Guarded(torch.full((batch, d), NAN), pad=tile * d, fill=OUT_GUARD)
    what = f"batch {batch}, N={n}, D={d}, TILE={tile}"
    trace = launch(kernel, (batch,), q_g.view, k_g.view, v_g.view, out_g.view, n, scale,
                   D=d, TILE=tile)
    if interpreted():
        _check_tiles(trace, k_g, "K", n, d, tile, what)
        _check_tiles(trace, v_g, "V", n, d, tile, what)
    grading.expect_true(out_g.guard_intact(), f"{what}: the kernel wrote outside out",
                        hint="program b writes out[b, :D] only")
    got = out_g.view.cpu()
    expected = (torch.softmax(torch.einsum("bnd,bd->bn", k.double(), q.double())
                              * scale, 1)[..., None] * v.double()).sum(1).float()
    if not got.isfinite().all():
        grading.fail(f"{what}: scores in the hundreds gave NaN or inf",
                     hint="exponentiate s - m_new, never s itself: exp(200) overflows")
    named = None
    if got.shape == expected.shape and not torch.allclose(got, expected, atol=1e-4, rtol=1e-4):
        named = name_slip(got, expected.double(), contiguous_slips(q, k, v, scale, tile))
    grading.expect_tensor_close(
        got, expected, f"{what}, out", atol=1e-4, rtol=1e-4,
        hint=named or "compare with the spec: one softmax over all N scores; the "
                      "last tile is partial (N % TILE), its missing keys weigh 0")


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
