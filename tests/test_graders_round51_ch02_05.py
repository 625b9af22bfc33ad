"""Chapters 02-05's graders, review round 51: wrong answers that passed get ❌ with a hint
that names their mistake; right answers of other shapes get ✅."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from test_generated_numeric import Bugged  # 05.5's kernel, BUG=5: q loaded unmasked

import paged_lib  # noqa: F401  (sets up the interpreter before anything Triton)
from paged_lib.course.grading import ch04, ch05
from paged_lib.device import interpreter_on

pytestmark = pytest.mark.usefixtures("one_torch_thread")
needs_interpreter = pytest.mark.skipif(not interpreter_on(),
                                       reason="the load trace needs Triton's interpreter")


def _verdict(capsys, check, answer) -> str:
    check(answer)
    return capsys.readouterr().out


def _fails(capsys, check, answer, ex_id: str, *words: str) -> None:
    out = _verdict(capsys, check, answer)
    assert out.startswith(f"❌ [{ex_id}]") and all(w in out for w in words), (words, out)


def _passes(capsys, check, answer, ex_id: str) -> None:
    out = _verdict(capsys, check, answer)
    assert out.startswith(f"✅ [{ex_id}]"), out


# ---------------------------------------------------------------- 04.1 merge two states

def _merge(a, b, zero):
    m = torch.maximum(a[0], b[0])
    safe = torch.where(torch.isinf(m), zero(m), m)
    wa, wb = torch.exp(a[0] - safe), torch.exp(b[0] - safe)
    return m, wa * a[1] + wb * b[1], wa[..., None] * a[2] + wb[..., None] * b[2]


def test_04_1_a_float64_constant_that_promotes_float32_states_is_named(capsys):
    """Wrong: the 0 in place of an infinite max is a float64 tensor; float32 states come
    back float64 (right values, so only the dtype tells)."""
    _fails(capsys, ch04.check_merge_states,
           lambda a, b: _merge(a, b, lambda m: torch.zeros(m.shape, dtype=torch.float64)),
           "04.1", "expected dtype torch.float32", "compute in the states' own dtype")
    # a default-dtype (float32) constant leaves float64 states float64: right
    _passes(capsys, ch04.check_merge_states,
            lambda a, b: _merge(a, b, lambda m: torch.zeros(m.shape)), "04.1")


# -------------------------------------------------------------- 05.7 merge_partials

def _merge_centred(center):
    def merge(out, lse):
        w = torch.exp(lse - center(lse[torch.isfinite(lse)]))
        return (w[:, None] * out).sum(0) / w.sum()
    return merge


def test_05_7_log_sum_exps_centred_on_their_mean_are_named(capsys):
    """Wrong: weights exp(lse - mean), not exp(lse - max): right while the log-sum-exps are
    within about 1400 of each other, NaN for -821 and 820 (exp(853) overflows)."""
    _fails(capsys, ch05.check_merge_partials, _merge_centred(torch.mean), "05.7",
           "the merged output is NaN", "M the max over all segments")
    _passes(capsys, ch05.check_merge_partials, _merge_centred(torch.max), "05.7")
    _passes(capsys, ch05.check_merge_partials,
            lambda out, lse: torch.softmax(lse, 0) @ out, "05.7")


# ------------------------------------------------------------- 05.2 gather through a table

@triton.jit
def _gather_x_unmasked(x_ptr, idx_ptr, out_ptr, n, D: tl.constexpr, BLOCK_I: tl.constexpr,
                       MASK_X: tl.constexpr = False):
    """Wrong (MASK_X False): idx masked (no other), x not: a lane past n loads a row of x at
    an undefined row id (0 in the interpreter, so the values were right); right otherwise."""
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    d = tl.arange(0, D)
    live = i < n
    rows = tl.load(idx_ptr + i, mask=live).to(tl.int64)
    if MASK_X:
        x = tl.load(x_ptr + rows[:, None] * D + d[None, :], mask=live[:, None])
    else:
        x = tl.load(x_ptr + rows[:, None] * D + d[None, :])
    tl.store(out_ptr + i[:, None] * D + d[None, :], x, mask=live[:, None])


class _With:
    """A kernel launched with one constexpr switched on."""

    def __init__(self, kernel, **on):
        self.kernel, self.on = kernel, on

    def __getitem__(self, grid):
        return lambda *a, **kw: self.kernel[grid](*a, **self.on, **kw)


@needs_interpreter
def test_05_2_rows_of_x_loaded_for_lanes_past_n_are_named(capsys):
    _fails(capsys, ch05.check_gather_rows, _gather_x_unmasked, "05.2",
           "row(s) of x for lanes i >= n", "mask the load of x with (i < n)[:, None]")
    _passes(capsys, ch05.check_gather_rows, _With(_gather_x_unmasked, MASK_X=True), "05.2")


# ------------------------------------------------------------ 05.5 paged decode kernel

@needs_interpreter
@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the padding rows read the guard's NaN
def test_05_5_q_loaded_past_its_end_is_named(capsys):
    """Wrong: the padding rows of the query tile (GROUP_PAD > GROUP) loaded unmasked: the
    last program reads past q's end; only the store was masked, so the output was right."""
    _fails(capsys, ch05.check_paged_decode_kernel, Bugged(5), "05.5", "read q past its end",
           "mask=(g < GROUP)[:, None]")
