"""The graders of chapters 04 and 05 against the mistakes learners make.

For every exercise: the solution gets ✅, a stub gets ⏳, and each typical wrong answer
(and small bugs planted in the solution) gets ❌ with a hint that names the mistake.
"""

from __future__ import annotations

import pytest
import torch

import paged_lib  # noqa: F401  (sets up the interpreter before anything Triton)
from paged_lib import attention as A
from paged_lib.course.grading import ch04
from paged_lib.util import cdiv

NEG_INF = float("-inf")


def _verdict(capsys, check, answer) -> str:
    check(answer)
    return capsys.readouterr().out


def _stub(*args):
    raise NotImplementedError()


# ---------------------------------------------------------------- 04.1 merge two states

def _merge_ok(a, b):
    m = torch.maximum(a[0], b[0])
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both empty: weights 0
    wa, wb = torch.exp(a[0] - safe), torch.exp(b[0] - safe)
    return m, wa * a[1] + wb * b[1], wa[..., None] * a[2] + wb[..., None] * b[2]


def _merge_nan_on_empty(a, b):
    m = torch.maximum(a[0], b[0])
    wa, wb = torch.exp(a[0] - m), torch.exp(b[0] - m)
    return m, wa * a[1] + wb * b[1], wa[..., None] * a[2] + wb[..., None] * b[2]


def _merge_no_rescale(a, b):
    return torch.maximum(a[0], b[0]), a[1] + b[1], a[2] + b[2]


def _merge_exp_of_max(a, b):
    """Scales by exp(m) itself: overflows for scores around 1000."""
    m = torch.maximum(a[0], b[0])
    ea, eb, em = torch.exp(a[0]), torch.exp(b[0]), torch.exp(m)
    ea, eb = torch.nan_to_num(ea / em, nan=0.0), torch.nan_to_num(eb / em, nan=0.0)
    return m, ea * a[1] + eb * b[1], ea[..., None] * a[2] + eb[..., None] * b[2]


def _merge_min(a, b):
    m = torch.minimum(a[0], b[0])
    ms = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(a[0] - ms), torch.exp(b[0] - ms)
    return m, wa * a[1] + wb * b[1], wa[..., None] * a[2] + wb[..., None] * b[2]


def _merge_with(a, b, slip):
    m = torch.maximum(a[0], b[0])
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(a[0] - safe), torch.exp(b[0] - safe)
    ka, kb = (wa, wb) if slip != "l only" else (torch.ones_like(wa), torch.ones_like(wb))
    la, lb = (wa, wb) if slip != "acc only" else (torch.ones_like(wa), torch.ones_like(wb))
    if slip == "flipped":
        la, lb = ka, kb = torch.exp(safe - a[0]), torch.exp(safe - b[0])
    if slip == "swapped":
        la, lb = ka, kb = wb, wa
    m_out = a[0] if slip == "m_a" else m
    return m_out, la * a[1] + lb * b[1], ka[..., None] * a[2] + kb[..., None] * b[2]


def test_merge_grader_names_each_slip(capsys):
    for slip, words in [("l only", "l was rescaled but acc was not"),
                        ("acc only", "acc was rescaled but l was not"),
                        ("flipped", "not exp(m - m_side)"), ("swapped", "its own l and acc"),
                        ("m_a", "not m_a")]:
        out = _verdict(capsys, ch04.check_merge_states, lambda a, b, s=slip: _merge_with(a, b, s))
        assert out.startswith("❌ [04.1]") and words in out, (slip, out)
    out = _verdict(capsys, ch04.check_merge_states, _merge_no_rescale)
    assert "no rescale" in out, out
    out = _verdict(capsys, ch04.check_merge_states, _merge_min)
    assert "larger max" in out, out


def test_merge_grader(capsys):
    assert _verdict(capsys, ch04.check_merge_states, _merge_ok).startswith("✅ [04.1]")
    assert _verdict(capsys, ch04.check_merge_states, _stub).startswith("⏳ [04.1]")
    in_fp32 = lambda a, b: tuple(t.to(a[0].dtype) for t in _merge_ok(  # noqa: E731
        *(tuple(t.float() for t in s) for s in (a, b))))
    for bad, words in [(_merge_nan_on_empty, "NaN"), (_merge_no_rescale, "rescale"),
                       (in_fp32, "computed in float32 and cast back"),
                       (_merge_exp_of_max, "1000"), (_merge_min, "max")]:
        out = _verdict(capsys, ch04.check_merge_states, bad)
        assert out.startswith("❌ [04.1]") and words in out, out
        assert "hint:" in out


# ------------------------------------------------- 04.2 online softmax through the table

def _paged_ok(q, k_cache, v_cache, block_table, seq_len, scale, *, bug=None):
    num_heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    qg = q.view(kv_heads, num_heads // kv_heads, d)
    state = (torch.full(qg.shape[:2], 0.0 if bug == "m from 0" else NEG_INF, dtype=q.dtype),
             torch.zeros(qg.shape[:2], dtype=q.dtype), torch.zeros(qg.shape, dtype=q.dtype))
    nb = cdiv(seq_len, block_size) + (1 if bug == "extra block" else 0)
    for j in range(nb):
        block = int(block_table[j])
        limit = seq_len - j * block_size + (1 if bug == "off by one" else 0)
        if bug == "fill mod" and j == nb - 1:  # a full last block counted as empty
            limit = seq_len % block_size
        valid = torch.arange(block_size) < limit
        kb = torch.where(valid[:, None, None], k_cache[block], 0.0)
        vb = v_cache[block] if bug == "no value mask" else \
            torch.where(valid[:, None, None], v_cache[block], 0.0)
        scores = torch.einsum("kgd,tkd->kgt", qg, kb) * scale
        scores = scores.masked_fill(~valid, NEG_INF)
        new = A.block_state(scores, vb.transpose(0, 1)[:, None])
        if bug == "no running max":  # exp of the raw scores: right while they are small
            p = torch.exp(scores)
            state = (state[0], state[1] + p.sum(-1),
                     state[2] + torch.einsum("kgt,ktd->kgd", p, vb.transpose(0, 1)))
        elif bug == "no rescale":
            state = (torch.maximum(state[0], new.m), state[1] + new.l, state[2] + new.acc)
        elif bug == "l kept":  # acc rescaled when the running max grows, l not
            merged = A.merge(A.SoftmaxState(*state), new)
            state = (merged.m, state[1] + torch.exp(new.m - merged.m) * new.l, merged.acc)
        else:
            state = tuple(A.merge(A.SoftmaxState(*state), new))
    out = (state[2] / state[1][..., None]).reshape(num_heads, d)
    return out.float() if bug == "float32" else out.float().double() if bug == "via float32" \
        else out


def _gather_fancy(q, k_cache, v_cache, block_table, seq_len, scale):
    bs = k_cache.shape[1]
    t = torch.arange(seq_len)
    blocks = block_table.long()[t // bs]
    k, v = k_cache[blocks, t % bs], v_cache[blocks, t % bs]
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, -1)
    return torch.einsum("hn,nhd->hd", p, v)


def _gather_list_cat(q, k_cache, v_cache, block_table, seq_len, scale):
    bs = k_cache.shape[1]
    blocks = [int(b) for b in block_table[:cdiv(seq_len, bs)]]
    k = torch.cat([k_cache[b] for b in blocks])[:seq_len]
    v = torch.cat([v_cache[b] for b in blocks])[:seq_len]
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, -1)
    return torch.einsum("hn,nhd->hd", p, v)


def _block_scores(q, k_cache, block, valid, scale):
    kv = k_cache.shape[2]
    qg = q.view(kv, q.shape[0] // kv, q.shape[1])
    kb = torch.where(valid[:, None, None], k_cache[block], 0.0)
    return torch.einsum("kgd,tkd->kgt", qg, kb).masked_fill(~valid, NEG_INF) * scale


def _two_pass(q, k_cache, v_cache, block_table, seq_len, scale):
    """Pass 1: the max over all blocks; pass 2: read K again for exp and V for the sum."""
    bs, kv = k_cache.shape[1], k_cache.shape[2]
    nb = cdiv(seq_len, bs)
    valids = [torch.arange(bs) < seq_len - j * bs for j in range(nb)]
    m = torch.stack([_block_scores(q, k_cache, int(block_table[j]), valids[j], scale).amax(-1)
                     for j in range(nb)]).amax(0)
    denom = torch.zeros_like(m)
    acc = torch.zeros(kv, q.shape[0] // kv, q.shape[1], dtype=q.dtype)
    for j in range(nb):
        b = int(block_table[j])
        p = torch.exp(_block_scores(q, k_cache, b, valids[j], scale) - m[..., None])
        vb = torch.where(valids[j][:, None, None], v_cache[b], 0.0).transpose(0, 1)
        denom = denom + p.sum(-1)
        acc = acc + torch.einsum("kgt,ktd->kgd", p, vb)
    return (acc / denom[..., None]).reshape(q.shape)


def _collect_scores(q, k_cache, v_cache, block_table, seq_len, scale, *, cat=True):
    """Reads each block once, in order, but keeps every block's scores and values."""
    bs = k_cache.shape[1]
    scores, values = [], []
    for j in range(cdiv(seq_len, bs)):
        b = int(block_table[j])
        valid = torch.arange(bs) < seq_len - j * bs
        scores.append(_block_scores(q, k_cache, b, valid, scale))
        values.append(torch.where(valid[:, None, None], v_cache[b], 0.0).transpose(0, 1))
    if cat:
        p = torch.softmax(torch.cat(scores, -1), -1)
        return torch.einsum("kgt,ktd->kgd", p, torch.cat(values, 1)).reshape(q.shape)
    m = torch.stack([s.amax(-1) for s in scores]).amax(0)
    ps = [torch.exp(s - m[..., None]) for s in scores]
    acc = sum(torch.einsum("kgt,ktd->kgd", p, v) for p, v in zip(ps, values, strict=True))
    return (acc / sum(p.sum(-1) for p in ps)[..., None]).reshape(q.shape)


def _states_merged_at_end(q, k_cache, v_cache, block_table, seq_len, scale):
    """Right numbers, but every block's (m, l, acc) is kept and merged after the loop."""
    num_heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    qg = q.view(kv_heads, num_heads // kv_heads, d)
    states = []
    for j in range(cdiv(seq_len, block_size)):
        block = int(block_table[j])
        valid = torch.arange(block_size) < seq_len - j * block_size
        kb = torch.where(valid[:, None, None], k_cache[block], 0.0)
        scores = (torch.einsum("kgd,tkd->kgt", qg, kb) * scale).masked_fill(~valid, NEG_INF)
        vb = torch.where(valid[:, None, None], v_cache[block], 0.0)
        states.append(A.block_state(scores, vb.transpose(0, 1)[:, None]))
    state = states[0]
    for new in states[1:]:
        state = A.merge(state, new)
    return (state.acc / state.l[..., None]).reshape(num_heads, d)


def _wrong_gqa(q, k_cache, v_cache, block_table, seq_len, scale):
    """Query head h paired with KV head h % num_kv_heads instead of h // group."""
    kv = k_cache.shape[2]
    h = q.shape[0]
    perm = torch.arange(h).view(h // kv, kv).t().reshape(-1)  # heads regrouped by h % kv
    out = _paged_ok(q[perm], k_cache, v_cache, block_table, seq_len, scale)
    return out[torch.argsort(perm)]


def test_paged_online_grader_passes_the_solution(capsys):
    out = _verdict(capsys, ch04.check_paged_online, _paged_ok)
    assert out == "✅ [04.2] Attention through a block table, one block at a time: correct\n", out
    assert _verdict(capsys, ch04.check_paged_online, _stub).startswith("⏳ [04.2]")


def test_paged_online_grader_fails_wrong_answers(capsys):
    cases = [
        (_gather_fancy, "gathers many blocks"),
        (_gather_list_cat, "all scores first, then one softmax"),
        (_two_pass, "read twice"),
        (_collect_scores, "concatenated"),
        (lambda *a: _collect_scores(*a, cat=False), "several blocks' keys, values or scores"),
        (_wrong_gqa, "KV head h // "),
        (_states_merged_at_end, "every block's state and merge at the end"),
        (_paged_per_head, "a loop over query heads around the loop over blocks"),
    ]
    for bad, words in cases:
        out = _verdict(capsys, ch04.check_paged_online, bad)
        assert out.startswith("❌ [04.2]") and words in out, (bad, out)
        assert "hint:" in out and "Traceback" not in out


def test_paged_online_grader_catches_planted_bugs(capsys):
    for bug, words in [("off by one", "NaN"), ("no value mask", "NaN"),
                       ("extra block", "padding"), ("no rescale", "rescale"),
                       ("float32", "dtype"), ("no running max", "running max"),
                       ("m from 0", "start the running max at -inf, not 0"),
                       ("via float32", "computed in float32 and cast back"),
                       ("fill mod", "a full last block"),
                       ("l kept", "acc was rescaled but l was not")]:
        out = _verdict(capsys, ch04.check_paged_online,
                       lambda *a, bug=bug: _paged_ok(*a, bug=bug))
        assert out.startswith("❌ [04.2]") and words in out, (bug, out)


# ---------------------------------------------------------------- 04.3 flash vs paged

_RIGHT_04_3 = {i: ans for i, (_, ans, _) in enumerate(ch04.STATEMENTS, 1)}


def test_flash_vs_paged_grader(capsys):
    right = _RIGHT_04_3
    assert _verdict(capsys, ch04.check_flash_vs_paged, lambda: right).startswith("✅ [04.3]")
    assert _verdict(capsys, ch04.check_flash_vs_paged, _stub).startswith("⏳ [04.3]")
    spaced = {i: f" {a.title()} " for i, a in right.items()}  # case and spaces do not matter
    assert _verdict(capsys, ch04.check_flash_vs_paged, lambda: spaced).startswith("✅ [04.3]")


@pytest.mark.parametrize("answer, words", [
    ({**_RIGHT_04_3, 3: "both"}, "two-pass"),  # "vLLM's kernels use the online softmax"
    ({**_RIGHT_04_3, 7: "flash"}, "is either of them an approximation?"),  # "flash is exact"
    ({**_RIGHT_04_3, 10: "flash"}, "FlashAttention-style kernels that read a paged cache"),
    ({**_RIGHT_04_3, 4: "both"}, "which paper's own CUDA kernel"),  # "both use two passes"
    ({**_RIGHT_04_3, 6: "both"}, "sharing needs an indirection"),
    ({**_RIGHT_04_3, 9: "both"}, "written before KV caches were paged"),
    ({i: "both" for i in _RIGHT_04_3}, "SRAM vs HBM"),  # "both work in blocks"
    ([_RIGHT_04_3[i] for i in sorted(_RIGHT_04_3)], "a list's order is not relied on"),
    ({**_RIGHT_04_3, 1: "FlashAttention"}, "one of the three words exactly"),
    ({i - 1: a for i, a in _RIGHT_04_3.items()}, "numbered from 1 (as printed), not from 0"),
    ({str(i): a for i, a in _RIGHT_04_3.items()}, "the statement numbers as ints"),
])
def test_flash_vs_paged_wrong_answers(capsys, answer, words):
    out = _verdict(capsys, ch04.check_flash_vs_paged, lambda: answer)
    assert out.startswith("❌ [04.3]") and words in out and "hint:" in out, out


# ================================================================== chapter 05 (Triton)
# isort: split
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from paged_lib.course.grading import ch05  # noqa: E402
from paged_lib.device import interpreter_on  # noqa: E402

needs_interpreter = pytest.mark.skipif(not interpreter_on(),
                                       reason="the load trace needs Triton's interpreter")


class Bugged:
    """A kernel launched with ``BUG=bug``: one planted mistake per value."""

    def __init__(self, kernel, bug: int):
        self.kernel, self.bug = kernel, bug

    def __getitem__(self, grid):
        return lambda *a, **kw: self.kernel[grid](*a, BUG=self.bug, **kw)


def _expect_fail(capsys, check, answer, ex_id: str, words: str) -> None:
    out = _verdict(capsys, check, answer)
    assert out.startswith(f"❌ [{ex_id}]") and words in out, (words, out)
    assert "hint:" in out and "Traceback" not in out, out


@triton.jit
def _stub_kernel(x_ptr):
    # YOUR CODE HERE
    raise NotImplementedError()


# ---------------------------------------------------------------- 05.1 2-D masked tile

@triton.jit
def _scale_tile(x_ptr, out_ptr, M, N, stride_x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BUG: tl.constexpr = 0):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if BUG == 7:  # program ids swapped: rows from axis 1, columns from axis 0
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if BUG == 5:  # off by one: <= where < is meant
        mask = (rows[:, None] <= M) & (cols[None, :] <= N)
    load_mask = mask
    if BUG == 1:  # no mask on the load
        load_mask = rows[:, None] >= 0
    if BUG == 2:  # rows only
        load_mask = (rows[:, None] < M) & (cols[None, :] >= 0)
    stride = stride_x
    if BUG == 3:  # N as the row stride
        stride = N
    x = tl.load(x_ptr + rows[:, None] * stride + cols[None, :], mask=load_mask, other=0.0)
    if BUG == 8:  # halved the traffic: x rounded to float16, cast back by the store
        x = x.to(tl.float16)
    store_mask = mask
    if BUG == 4:  # unmasked store
        store_mask = rows[:, None] >= 0
    out_stride = N
    if BUG == 6:  # out written with x's row stride
        out_stride = stride_x
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], 2 * x, mask=store_mask)


@needs_interpreter
def test_scale_tile_grader(capsys):
    assert _verdict(capsys, ch05.check_scale_tile, _scale_tile).startswith("✅ [05.1]")
    assert _verdict(capsys, ch05.check_scale_tile, _stub_kernel).startswith("⏳ [05.1]")
    for bug, words in [(1, "outside the"), (2, "outside the"), (3, "stride_x, not N"),
                       (4, "wrote outside out"),
                       (5, "mask the load with (rows < M)[:, None] & (cols < N)[None, :]"),
                       (6, "out[i, j] is at i * N + j"),
                       (7, "were never written"), (8, "rounded to float16")]:
        _expect_fail(capsys, ch05.check_scale_tile, Bugged(_scale_tile, bug), "05.1", words)


@triton.jit
def _scale_rows_one_by_one(x_ptr, out_ptr, M, N, stride_x, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    for r in range(BLOCK_M):  # right on a GPU: a scalar row test mixed into a vector mask
        row = tl.program_id(0) * BLOCK_M + r
        inside = (row < M) & (cols < N)
        tl.store(out_ptr + row * N + cols, 2 * tl.load(x_ptr + row * stride_x + cols,
                                                       mask=inside), mask=inside)


@needs_interpreter
def test_a_mask_the_interpreter_refuses_is_told_how_to_write_it(capsys):
    """Triton 3.9's interpreter fails ``scalar & vector`` masks ("mask has unsupported
    dtype"); the verdict says so and how to write the mask, not only the raw error."""
    _expect_fail(capsys, ch05.check_scale_tile, _scale_rows_one_by_one, "05.1",
                 "(pid + tl.zeros_like(cols) < M) & (cols < N)")


# ------------------------------------------------------------- 05.2 gather through a table

@triton.jit
def _gather_rows(x_ptr, idx_ptr, out_ptr, n, D: tl.constexpr, BLOCK_I: tl.constexpr,
                 BUG: tl.constexpr = 0):
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    d = tl.arange(0, D)
    live = i < n
    if BUG == 1:  # idx read without a mask
        rows = tl.load(idx_ptr + i)
    else:
        rows = tl.load(idx_ptr + i, mask=live, other=0)
    if BUG != 2 and BUG != 5:  # 2: no int64 cast; 5: cast after the multiply
        rows = rows.to(tl.int64)
    if BUG == 3:  # i instead of idx[i]
        rows = i.to(tl.int64)
    offs = rows[:, None] * D + d[None, :]
    if BUG == 5:
        offs = offs.to(tl.int64)  # the int32 product has already wrapped
    x = tl.load(x_ptr + offs, mask=live[:, None], other=0.0)
    if BUG == 4:  # unmasked store
        live = i >= 0
    tl.store(out_ptr + i[:, None] * D + d[None, :], x, mask=live[:, None])


@needs_interpreter
def test_gather_rows_grader(capsys):
    assert _verdict(capsys, ch05.check_gather_rows, _gather_rows).startswith("✅ [05.2]")
    assert _verdict(capsys, ch05.check_gather_rows, _stub_kernel).startswith("⏳ [05.2]")
    for bug, words in [(1, "outside its n="), (2, "32 bits"), (3, "row idx[i] of x"),
                       (4, "at i >= n"), (5, "multiplied in 32 bits")]:
        _expect_fail(capsys, ch05.check_gather_rows, Bugged(_gather_rows, bug), "05.2", words)


# ---------------------------------------------------------------------- 05.3 row softmax

@triton.jit
def _row_softmax(x_ptr, out_ptr, N, BLOCK_N: tl.constexpr, BUG: tl.constexpr = 0):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    start = row * N
    if BUG == 4:  # rows taken BLOCK_N apart (the padded width), not N
        start = row * BLOCK_N
    if BUG == 1:  # padding lanes load 0, not -inf
        x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
    elif BUG == 3:  # no mask at all
        x = tl.load(x_ptr + row * N + cols)
        x = tl.where(mask, x, float("-inf"))
    else:
        x = tl.load(x_ptr + start + cols, mask=mask, other=float("-inf"))
    if BUG == 7:  # x rounded to float16 before the softmax
        x = x.to(tl.float16).to(tl.float32)
    if BUG == 2:  # no max subtracted
        e = tl.exp(x)
    elif BUG == 8:  # exp2 without the log2(e) factor
        e = tl.exp2(x - tl.max(x, axis=0))
    elif BUG == 9:  # right: exp2 with the factor
        e = tl.exp2((x - tl.max(x, axis=0)) * 1.4426950408889634)
    else:
        e = tl.exp(x - tl.max(x, axis=0))
    out = e / tl.sum(e, axis=0)
    if BUG == 6:  # never normalised
        out = e
    store_mask = mask
    if BUG == 5:  # unmasked store: padding lanes write past the row
        store_mask = cols >= 0
    tl.store(out_ptr + row * N + cols, out, mask=store_mask)


@needs_interpreter
def test_row_softmax_grader(capsys):
    assert _verdict(capsys, ch05.check_row_softmax, _row_softmax).startswith("✅ [05.3]")
    assert _verdict(capsys, ch05.check_row_softmax, _stub_kernel).startswith("⏳ [05.3]")
    for bug, words in [(1, "other=-inf"), (2, "subtract the row's max"),
                       (3, "of its row 0, which has"), (4, "rows are N apart, not BLOCK_N"),
                       (5, "mask the store with cols < N"), (6, "divide exp(x - max)"),
                       (7, "rounded to float16"), (8, "exp2 without its factor")]:
        _expect_fail(capsys, ch05.check_row_softmax, Bugged(_row_softmax, bug), "05.3", words)


# ------------------------------------------------ 05.4 online softmax over contiguous K

@triton.jit
def _online_attention(q_ptr, k_ptr, v_ptr, out_ptr, N, scale, D: tl.constexpr,
                      TILE: tl.constexpr, BUG: tl.constexpr = 0):
    b = tl.program_id(0)
    d = tl.arange(0, D)
    t = tl.arange(0, TILE)
    q = tl.load(q_ptr + b * D + d)
    m_i = tl.max(tl.full([TILE], float("-inf"), tl.float32), axis=0)
    if BUG == 7:  # the running max starts at 0
        m_i = tl.max(tl.zeros([TILE], tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([TILE], tl.float32), axis=0)
    acc = tl.zeros([D], tl.float32)
    if BUG == 4:  # two passes: the max first, then everything again
        for start in range(0, N, TILE):
            tok = start + t
            k = tl.load(k_ptr + (b * N + tok[:, None]) * D + d[None, :],
                        mask=(tok < N)[:, None], other=0.0)
            s = tl.where(tok < N, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
            m_i = tl.maximum(m_i, tl.max(s, axis=0))
    for start in range(0, N, TILE):
        tok = start + t
        valid = tok < N
        offs = (b * N + tok[:, None]) * D + d[None, :]
        if BUG == 3:  # unmasked K, NaN hidden by tl.where below
            k = tl.load(k_ptr + offs)
        else:
            k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
        s = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        if BUG == 5:  # scale forgotten
            s = tl.where(valid, tl.sum(k * q[None, :], axis=1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        if BUG == 2:  # exp of the raw scores
            alpha = 1.0
            p = tl.exp(s)
        else:
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
        if BUG == 1:  # no rescale of what was summed so far
            alpha = 1.0
        if BUG == 8:  # exp2 without the log2(e) factor
            alpha, p = tl.exp2(m_i - m_new), tl.exp2(s - m_new)
        if BUG == 9:  # right: exp2 with the factor
            alpha, p = tl.exp2((m_i - m_new) * 1.4426950408889634), \
                tl.exp2((s - m_new) * 1.4426950408889634)
        if BUG == 10:  # l not rescaled (acc is): undone by the line below
            l_i = tl.where(alpha > 0, l_i / alpha, l_i)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        if BUG == 6:  # probabilities rounded to float16 before they weigh V
            p = p.to(tl.float16).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    tl.store(out_ptr + b * D + d, acc / l_i)


@needs_interpreter
def test_online_attention_grader(capsys):
    check = ch05.check_online_attention
    assert _verdict(capsys, check, _online_attention).startswith("✅ [05.4]")
    assert _verdict(capsys, check, _stub_kernel).startswith("⏳ [05.4]")
    for bug, words in [(1, "not rescaled when the running max grew"), (2, "NaN or inf"),
                       (3, "without a mask"),
                       (4, "times over"), (5, "it was left out"), (6, "rounded to float16"),
                       (7, "start the running max at -inf"), (8, "exp2 without its factor"),
                       (10, "acc was rescaled but l was not")]:
        _expect_fail(capsys, check, Bugged(_online_attention, bug), "05.4", words)


# -------------------------------------------------------------- 05.5 paged decode kernel

@triton.jit
def _decode(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale,
            max_blocks, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
            GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BUG: tl.constexpr = 0):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + g
    if BUG == 5:  # query head h paired with KV head h % NUM_KV_HEADS
        heads = kv_head + g * NUM_KV_HEADS
    rows = (g < GROUP)[:, None]
    q_offs = (seq * NUM_KV_HEADS * GROUP + heads[:, None]) * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=rows, other=0.0)
    seq_len = tl.load(seq_lens_ptr + seq)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    if BUG == 13:  # the running max starts at 0
        m_i = tl.zeros([GROUP_PAD], tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    if BUG == 10:  # every program loops over the widest table (masks keep it right)
        num_blocks = max_blocks
    for j in range(0, num_blocks):
        block = tl.load(block_tables_ptr + seq * max_blocks + j)
        if BUG != 2 and BUG != 8:  # 2: no 64-bit block id; 8: cast after the multiply
            block = block.to(tl.int64)
        valid = j * BLOCK_SIZE + t < seq_len
        if BUG == 6:  # off by one
            valid = j * BLOCK_SIZE + t <= seq_len
        if BUG == 3:  # the block's start forgotten
            valid = t < seq_len
        if BUG == 15:  # a full last block counted as empty: its fill taken as seq_len % BS
            valid = t < tl.where(j == num_blocks - 1, seq_len % BLOCK_SIZE, BLOCK_SIZE)
        offs = ((block * BLOCK_SIZE + t[:, None]) * NUM_KV_HEADS + kv_head) * HEAD_DIM \
            + d[None, :]
        if BUG == 8:  # the offset in int32, cast afterwards: the wrap has happened already
            offs = offs.to(tl.int64)
        if BUG == 1:  # unmasked K; the NaN is hidden by tl.where below
            k = tl.load(k_cache_ptr + offs)
        elif BUG == 7:  # the K tile loaded once per query head of the group
            k = tl.zeros([BLOCK_SIZE, HEAD_DIM], tl.float32)
            for _ in tl.static_range(GROUP):
                k += tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0) / GROUP
        else:
            k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        if BUG == 11:  # tl.dot on a [GROUP_PAD, HEAD_DIM] x [HEAD_DIM, BLOCK_SIZE] tile
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        if BUG == 4:  # no rescale
            alpha = tl.full([GROUP_PAD], 1.0, tl.float32)
        if BUG == 9:  # no running max: exp of the raw scores (right while scores are small)
            m_new = tl.zeros([GROUP_PAD], tl.float32)
            alpha = tl.full([GROUP_PAD], 1.0, tl.float32)
        p = tl.exp(s - m_new[:, None])
        if BUG == 14:  # exp2 without the log2(e) factor
            alpha, p = tl.exp2(m_i - m_new), tl.exp2(s - m_new[:, None])
        if BUG == 16:  # right: exp2 with the factor
            alpha = tl.exp2((m_i - m_new) * 1.4426950408889634)
            p = tl.exp2((s - m_new[:, None]) * 1.4426950408889634)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if BUG == 12:  # probabilities rounded to float16 before they weigh V
            p = p.to(tl.float16).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    tl.store(out_ptr + q_offs, acc / l_i[:, None], mask=rows)


@needs_interpreter
def test_decode_kernel_grader(capsys):
    check = ch05.check_paged_decode_kernel
    out = _verdict(capsys, check, _decode)
    assert out == "✅ [05.5] Paged decode kernel: correct\n", out
    assert _verdict(capsys, check, _stub_kernel).startswith("⏳ [05.5]")
    for bug, words in [(1, "past the sequence's end"), (2, "32 bits"),
                       (3, "past the sequence's end"), (4, "exp(m_old - m_new)"),
                       (5, "not h % num_kv_heads"), (6, "past the sequence's end"),
                       (7, "times"), (8, "multiplied in 32 bits"),
                       (9, "running max"), (10, "not over the table's width"),
                       (11, "a GPU needs every dimension of a tl.dot"),
                       (12, "rounded to float16"), (13, "start the running max at -inf"),
                       (14, "exp2 without its factor"), (15, "a full last block")]:
        _expect_fail(capsys, check, Bugged(_decode, bug), "05.5", words)


def test_decode_trace_message_names_program_and_slot(capsys):
    if not interpreter_on():
        pytest.skip("the load trace needs Triton's interpreter")
    out = _verdict(capsys, ch05.check_paged_decode_kernel, Bugged(_decode, 1))
    assert "program (seq 0, kv_head 0) read K at block" in out and "slot 1" in out, out
    assert "position 1 >= seq_len 1" in out


# ---------------------------------------------------------------------- 05.6 slot mapping

def _slots(block_tables, seq_ids, positions, block_size, bug=None):
    pos = positions.clamp(min=0)
    bs = 4 if bug == "hard-coded 4" else block_size
    blocks = block_tables.long()[seq_ids, pos // bs]
    slots = blocks * bs + pos % bs
    if bug == "no block":
        slots = pos % bs
    if bug == "block id only":
        slots = blocks
    if bug == "unclamped":  # no padding handling at all: -1 indexes the last entry
        return block_tables.long()[seq_ids, positions // bs] * bs + positions % bs
    if bug == "first row":
        slots = block_tables.long()[0, pos // bs] * bs + pos % bs
    if bug == "int32":
        slots = slots.to(torch.int32)
    if bug == "no padding":
        return slots
    if bug == "> 0":
        return torch.where(positions > 0, slots, torch.full_like(slots, -1))
    return torch.where(positions >= 0, slots, torch.full_like(slots, -1))


def test_slot_mapping_grader(capsys):
    check = ch05.check_slot_mapping
    assert _verdict(capsys, check, _slots) == "✅ [05.6] Slot mapping: correct\n"
    assert _verdict(capsys, check, _stub).startswith("⏳ [05.6]")
    for bug, words in [("hard-coded 4", "not a constant"), ("int32", "int64"),
                       ("no padding", "position -1) must map to -1, not to a real slot"),
                       ("no block", "not just the offset"),
                       ("block id only", "a block id is not a slot"),
                       ("first row", "its own sequence's row"),
                       ("unclamped", "silently indexes the table's last entry"),
                       ("> 0", "test positions >= 0, not > 0")]:
        _expect_fail(capsys, check, lambda *a, bug=bug: _slots(*a, bug=bug), "05.6", words)


# ------------------------------------------------------------ 05.7 merge split-KV partials

def _merge(out, lse):
    w = torch.exp(lse - lse.max())
    return (w[:, None] * out).sum(0) / w.sum()


def test_tolerances_are_shown_with_the_digits_that_decide(capsys):
    from paged_lib.course import grading

    with grading.exercise("99.2", "Digits"):
        grading.expect_tensor_close(torch.tensor([0.3668346703]),
                                    torch.tensor([0.3668346847], dtype=torch.float64),
                                    "out", atol=1e-9, rtol=1e-9)
    out = capsys.readouterr().out
    assert "expected 0.36683468" in out and "got 0.36683467" in out, out
    assert "(tolerance 1e-09)" in out, out


def test_merge_partials_grader(capsys):
    check = ch05.check_merge_partials
    assert _verdict(capsys, check, _merge) == "✅ [05.7] Merge split-KV partials: correct\n"
    assert _verdict(capsys, check, _stub).startswith("⏳ [05.7]")
    no_max = lambda out, lse: (torch.exp(lse)[:, None] * out).sum(0) / torch.exp(lse).sum()  # noqa: E731
    no_norm = lambda out, lse: (torch.exp(lse - lse.max())[:, None] * out).sum(0)  # noqa: E731
    in_fp32 = lambda out, lse: _merge(out.float(), lse.float())  # noqa: E731
    via_fp32 = lambda out, lse: _merge(out.float(), lse.float()).double()  # noqa: E731
    exp2 = lambda out, lse: _merge(out, lse * 0.6931471805599453)  # noqa: E731  (2**(lse - M))
    for bad, words in [(no_max, "max over all segments"),
                       (lambda out, lse: out.mean(0), "sum of the weights"),
                       (no_norm, "sum of the weights"),
                       (in_fp32, "expected dtype torch.float64 (the partials' dtype)"),
                       (via_fp32, "computed in float32 and cast back"),
                       (exp2, "exp2 without its factor")]:
        _expect_fail(capsys, check, bad, "05.7", words)


TWIN_MESSAGE = "which is what you are asked to write"


def _finalized(state):
    return state.acc / state.l[..., None]


def _decode_calling_twin():
    from paged_lib.kernels.triton_decode import _paged_decode_kernel

    return _paged_decode_kernel  # the library's kernel, passed as the answer


@pytest.mark.parametrize("check, answer, ex_id, name", [
    (ch04.check_merge_states, lambda a, b: tuple(A.merge(A.SoftmaxState(*a),
                                                         A.SoftmaxState(*b))), "04.1", "merge"),
    (ch04.check_paged_online, lambda *a: A.paged_blockwise_attention(*a), "04.2",
     "paged_blockwise_attention"),  # the exercise notebook's demo calls it just so
    (ch05.check_slot_mapping, lambda *a: __import__("paged_lib.kernels").kernels
     .slot_mapping_from_positions(*a), "05.6", "slot_mapping_from_positions"),
    (ch05.check_merge_partials, lambda out, lse: A.merge_partials(out, lse), "05.7",
     "merge_partials"),
    # what the twins call does the job too
    (ch04.check_merge_states, lambda a, b: tuple(A.merge_states(A.SoftmaxState(*(
        torch.stack(torch.broadcast_tensors(x, y)) for x, y in zip(a, b, strict=True))))),
     "04.1", "merge_states"),
    (ch05.check_merge_partials, lambda out, lse: _finalized(A.merge_states(A.SoftmaxState(
        lse, torch.ones_like(lse), out))), "05.7", "merge_states"),
    (ch05.check_merge_partials, lambda out, lse: __import__(
        "paged_lib.kernels.torch_backend").kernels.torch_backend.merge_segments(
        out, lse, torch.zeros(len(lse), dtype=torch.long), torch.arange(len(lse)), 1)[0],
     "05.7", "merge_segments"),
])
def test_an_answer_that_calls_the_library_twin_fails(capsys, check, answer, ex_id, name):
    out = _verdict(capsys, check, answer)
    assert out.startswith(f"❌ [{ex_id}]"), out
    assert f"your function called the library's {name}" in out and TWIN_MESSAGE in out, out


def test_the_library_twin_itself_fails_and_grading_still_works(capsys):
    from paged_lib.attention import merge_partials
    from paged_lib.kernels import slot_mapping_from_positions

    for check, twin, ex_id in [(ch05.check_merge_partials, merge_partials, "05.7"),
                               (ch05.check_slot_mapping, slot_mapping_from_positions, "05.6"),
                               (ch05.check_paged_decode_kernel, _decode_calling_twin(), "05.5"),
                               (ch04.check_merge_states, A.merge, "04.1")]:
        out = _verdict(capsys, check, twin)
        assert out.startswith(f"❌ [{ex_id}]") and "you passed the library's" in out, out
    # every patch is undone: the library works again, and a right answer still passes
    assert A.merge_partials is merge_partials
    assert _verdict(capsys, ch05.check_merge_partials, _merge).startswith("✅ [05.7]")




# ------------------------------------------------- right answers of other shapes pass

def _merge_stacked(a, b):
    """Both states stacked, one max over the stack (merge_states' way, written out)."""
    m_all = torch.stack(torch.broadcast_tensors(a[0], b[0]))
    m = m_all.amax(0)
    w = torch.exp(m_all - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    acc = (w[..., None] * torch.stack(torch.broadcast_tensors(a[2], b[2]))).sum(0)
    return m, (w * torch.stack(torch.broadcast_tensors(a[1], b[1]))).sum(0), acc


def _paged_per_head(q, k_cache, v_cache, block_table, seq_len, scale):
    """Wrong: one query head at a time, so every block is read once per head."""
    heads, d = q.shape
    bs, group = k_cache.shape[1], heads // k_cache.shape[2]
    out = torch.empty_like(q)
    for h in range(heads):
        m = torch.tensor(NEG_INF, dtype=q.dtype)
        l, acc = torch.zeros((), dtype=q.dtype), torch.zeros(d, dtype=q.dtype)  # noqa: E741
        for j in range(cdiv(seq_len, bs)):
            fill, b = min(bs, seq_len - j * bs), int(block_table[j])
            s = k_cache[b, :fill, h // group] @ q[h] * scale
            m_new = torch.maximum(m, s.max())
            alpha, p = torch.exp(m - m_new), torch.exp(s - m_new)
            l, acc = l * alpha + p.sum(), acc * alpha + p @ v_cache[b, :fill, h // group]  # noqa: E741
            m = m_new
        out[h] = acc / l
    return out


def _paged_repeat(q, k_cache, v_cache, block_table, seq_len, scale):
    """Each block read once (by a 0-d tensor), its KV heads repeated for their query heads,
    the fill sliced."""
    heads, d = q.shape
    bs, group = k_cache.shape[1], heads // k_cache.shape[2]
    m = torch.full((heads,), NEG_INF, dtype=q.dtype)
    l, acc = torch.zeros(heads, dtype=q.dtype), torch.zeros(heads, d, dtype=q.dtype)  # noqa: E741
    for j in range(cdiv(seq_len, bs)):
        fill, b = min(bs, seq_len - j * bs), block_table[j]
        kb = k_cache[b][:fill].repeat_interleave(group, 1)  # [fill, heads, d]
        s = torch.einsum("thd,hd->ht", kb, q) * scale
        m_new = torch.maximum(m, s.amax(1))
        alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
        vb = v_cache[b][:fill].repeat_interleave(group, 1)
        l = l * alpha + p.sum(1)  # noqa: E741
        acc = acc * alpha[:, None] + torch.einsum("ht,thd->hd", p, vb)
        m = m_new
    return acc / l[:, None]


def _slots_loop(block_tables, seq_ids, positions, block_size):
    return torch.tensor([-1 if p < 0 else int(block_tables[s, p // block_size]) * block_size
                         + p % block_size for s, p in zip(seq_ids.tolist(), positions.tolist(),
                                                          strict=True)], dtype=torch.int64)


def _merge_softmax(out, lse):
    return (torch.softmax(lse, 0)[:, None] * out).sum(0)


@pytest.mark.parametrize("check, answer", [
    (ch04.check_merge_states, _merge_stacked), (ch04.check_paged_online, _paged_repeat),
    (ch05.check_slot_mapping, _slots_loop), (ch05.check_merge_partials, _merge_softmax),
    pytest.param(ch05.check_row_softmax, Bugged(_row_softmax, 9), marks=needs_interpreter),
    pytest.param(ch05.check_online_attention, Bugged(_online_attention, 9),
                 marks=needs_interpreter),
    pytest.param(ch05.check_paged_decode_kernel, Bugged(_decode, 16), marks=needs_interpreter),
], ids=["04.1 stacked", "04.2 repeat_interleave", "05.6 loop", "05.7 softmax", "05.3 exp2",
        "05.4 exp2", "05.5 exp2"])
def test_right_answers_of_other_shapes_pass(capsys, check, answer):
    out = _verdict(capsys, check, answer)
    assert out.startswith("✅"), out
