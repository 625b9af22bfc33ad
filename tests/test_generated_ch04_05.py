"""The generated stage of chapter 05's ramp (05.1-05.4), in
paged_lib.course.grading.generated.numeric_decode.

For each exercise: the cases are seeded and reach states no fixed case does; a plausible
wrong kernel that every fixed case lets through gets ❌ from the generated stage, shrunk,
with a hint that names the mistake; and a right kernel written another way gets ✅.

(04.3 is a quiz whose answer takes no input: its check already reads every statement, so
there is nothing for a generated input to reach.)
"""

import pytest
import triton
import triton.language as tl
from stage_verdicts import verdict

import paged_lib  # noqa: F401  # isort: split
from paged_lib.course.grading import ch05
from paged_lib.course.grading.generated import numeric, numeric_decode
from paged_lib.device import interpreter_on

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not interpreter_on(), reason="the ramp's cases run in "
                                 "Triton's interpreter here (a GPU compiles each shape)")]


def test_cases_are_seeded_and_reach_states_the_fixed_cases_do_not():
    for ex in ("05.1", "05.2", "05.3", "05.4"):
        assert numeric_decode.ramp_cases(ex) == numeric_decode.ramp_cases(ex)
    tile = numeric.states(numeric_decode.ramp_cases("05.1"))
    assert tile["more than two programs along an axis"]
    assert tile["BLOCK_M != BLOCK_N over several rows of programs"]
    gather = numeric.states(numeric_decode.ramp_cases("05.2"))
    assert gather["more than two programs"] and gather["repeated row ids"]
    softmax = numeric.states(numeric_decode.ramp_cases("05.3"))
    assert softmax["a row far below 0 with lanes past N"] and softmax["tied values"]
    assert softmax["tiny differences"]
    attention = numeric.states(numeric_decode.ramp_cases("05.4"))
    assert attention["every score far below 0"] and attention["tied scores"]
    assert attention["a scale that is not 1 / sqrt(D)"] and attention["N <= TILE"]


# ------------------------------------------------------------------ 05.1 a 2-D masked tile

@triton.jit
def tile_rows_by_pid(x_ptr, out_ptr, M, N, stride_x, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) + tl.arange(0, BLOCK_M)  # the program id not times BLOCK_M
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=inside)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], 2 * x, mask=inside)


@triton.jit
def tile_rows_by_block_n(x_ptr, out_ptr, M, N, stride_x, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_M)  # BLOCK_N for the rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=inside)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], 2 * x, mask=inside)


@triton.jit
def tile_other_shape(x_ptr, out_ptr, M, N, stride_x, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """Right: the tile as one flat range of BLOCK_M * BLOCK_N lanes, x + x."""
    lane = tl.arange(0, BLOCK_M * BLOCK_N)
    rows = tl.program_id(0) * BLOCK_M + lane // BLOCK_N
    cols = tl.program_id(1) * BLOCK_N + lane % BLOCK_N
    ok = (rows < M) & (cols < N)
    x = tl.load(x_ptr + rows.to(tl.int64) * stride_x + cols, mask=ok, other=0.0)
    tl.store(out_ptr + rows * N + cols, x + x, mask=ok)


# --------------------------------------------------------------- 05.2 gather through a table

@triton.jit
def gather_by_pid(x_ptr, idx_ptr, out_ptr, n, D: tl.constexpr, BLOCK_I: tl.constexpr):
    i = tl.program_id(0) + tl.arange(0, BLOCK_I)  # the program id not times BLOCK_I
    d = tl.arange(0, D)
    live = i < n
    rows = tl.load(idx_ptr + i, mask=live, other=0).to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * D + d[None, :], mask=live[:, None])
    tl.store(out_ptr + i[:, None] * D + d[None, :], x, mask=live[:, None])


@triton.jit
def gather_other_shape(x_ptr, idx_ptr, out_ptr, n, D: tl.constexpr, BLOCK_I: tl.constexpr):
    """Right: one row at a time, its id loaded as a scalar."""
    d = tl.arange(0, D)
    for r in tl.static_range(BLOCK_I):
        i = tl.program_id(0) * BLOCK_I + r
        if i < n:
            row = tl.load(idx_ptr + i).to(tl.int64)
            tl.store(out_ptr + i * D + d, tl.load(x_ptr + row * D + d))


# ---------------------------------------------------------------------- 05.3 row softmax

@triton.jit
def softmax_padding_in_max(x_ptr, out_ptr, N, BLOCK_N: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    inside = cols < N
    x = tl.load(x_ptr + tl.program_id(0) * N + cols, mask=inside, other=0.0)
    e = tl.where(inside, tl.exp(x - tl.max(x, axis=0)), 0.0)  # the max saw the 0s
    tl.store(out_ptr + tl.program_id(0) * N + cols, e / tl.sum(e, axis=0), mask=inside)


@triton.jit
def softmax_other_shape(x_ptr, out_ptr, N, BLOCK_N: tl.constexpr):
    """Right: padding masked after the load, log-sum-exp form."""
    cols = tl.arange(0, BLOCK_N)
    inside = cols < N
    x = tl.load(x_ptr + tl.program_id(0) * N + cols, mask=inside, other=0.0)
    x = tl.where(inside, x, float("-inf"))
    m = tl.max(x, axis=0)
    lse = m + tl.log(tl.sum(tl.exp(x - m), axis=0))
    tl.store(out_ptr + tl.program_id(0) * N + cols, tl.exp(x - lse), mask=inside)


# ------------------------------------------------ 05.4 online softmax over contiguous K/V

@triton.jit
def attention(q_ptr, k_ptr, v_ptr, out_ptr, N, scale, D: tl.constexpr, TILE: tl.constexpr,
              BUG: tl.constexpr = 0):
    b = tl.program_id(0)
    d = tl.arange(0, D)
    t = tl.arange(0, TILE)
    q = tl.load(q_ptr + b * D + d)
    m_i = tl.max(tl.full([TILE], float("-inf"), tl.float32), axis=0)
    if BUG == 1:  # the running max starts at 0
        m_i = tl.sum(tl.zeros([TILE], tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([TILE], tl.float32), axis=0)
    acc = tl.zeros([D], tl.float32)
    for start in range(0, N, TILE):
        tok = start + t
        valid = tok < N
        offs = (b * N + tok[:, None]) * D + d[None, :]
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
        s = tl.sum(k * q[None, :], axis=1)
        if BUG == 2:  # 1 / sqrt(D), as the fixed cases pass it, not the scale argument
            s = s / tl.sqrt(D * 1.0)
        elif BUG == 3:  # right: log2-based, the scale folded into the exponent
            s = s * (scale * 1.4426950408889634)
        else:
            s = s * scale
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        if BUG == 3:
            alpha, p = tl.exp2(m_i - m_new), tl.exp2(s - m_new)
        else:
            alpha, p = tl.exp(m_i - m_new), tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    tl.store(out_ptr + b * D + d, acc / l_i)


class Bugged:
    def __init__(self, kernel, bug: int):
        self.kernel, self.bug = kernel, bug

    def __getitem__(self, grid):
        return lambda *a, **kw: self.kernel[grid](*a, BUG=self.bug, **kw)


# ------------------------------------------------------------------ the verdicts

WRONG = [
    ("05.1", ch05.check_scale_tile, tile_rows_by_pid, "were never written",
     "program pid_m's first row is pid_m * BLOCK_M, not pid_m"),
    ("05.1", ch05.check_scale_tile, tile_rows_by_block_n, "were never written",
     "fails when BLOCK_M != BLOCK_N: rows step by BLOCK_M"),
    ("05.2", ch05.check_gather_rows, gather_by_pid, "were never written",
     "pid * BLOCK_I + arange(BLOCK_I) of out, not pid + arange(BLOCK_I)"),
    ("05.3", ch05.check_row_softmax, softmax_padding_in_max, "came out NaN or inf",
     "a padding lane must not raise the row's max (load it with other=-inf, not 0)"),
    ("05.4", ch05.check_online_attention, Bugged(attention, 1), "NaN or inf",
     "start the running max at -inf, not 0"),
    ("05.4", ch05.check_online_attention, Bugged(attention, 2), "out",
     "multiply the scores by the kernel's scale argument"),
]


@pytest.mark.parametrize("ex, check, kernel, words, hint", WRONG,
                         ids=[f"{w[0]}-{i}" for i, w in enumerate(WRONG)])
def test_a_wrong_kernel_only_the_generated_stage_catches(monkeypatch, ex, check, kernel,
                                                         words, hint):
    assert verdict(check, kernel, monkeypatch)[0] == "✅"  # the fixed cases let it through
    mark, message, got_hint = verdict(check, kernel)
    assert mark == "❌" and "generated case" in message and "shrunk to" in message, message
    assert words in message and hint in got_hint, (message, got_hint)


@pytest.mark.parametrize("check, kernel", [
    (ch05.check_scale_tile, tile_other_shape), (ch05.check_gather_rows, gather_other_shape),
    (ch05.check_row_softmax, softmax_other_shape),
    (ch05.check_online_attention, Bugged(attention, 0)),
    (ch05.check_online_attention, Bugged(attention, 3))])
def test_a_right_kernel_of_another_shape_passes(check, kernel):
    mark, message, _ = verdict(check, kernel)
    assert mark == "✅", message
