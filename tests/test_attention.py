"""Chapter 4: online softmax over blocks, the paged references, pictures and graders."""

from __future__ import annotations

import itertools

import matplotlib
import pytest
import torch

import paged_lib  # noqa: F401  (sets up the interpreter before anything Triton)
from paged_lib import attention as A
from paged_lib.course.grading.generated import small_attention
from paged_lib.course.viz import attention as viz
from paged_lib.kernels.reference import gather_kv, ref_paged_attention

matplotlib.use("Agg")
F64 = torch.float64


def _qkv(shape, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, d, generator=g, dtype=F64),
            torch.randn(*shape, n, d, generator=g, dtype=F64),
            torch.randn(*shape, n, d, generator=g, dtype=F64))


@pytest.mark.parametrize("n,block_size", [(1, 4), (16, 16), (17, 16), (37, 8), (64, 5)])
def test_blockwise_equals_full_softmax(n, block_size):
    q, k, v = _qkv((3,), n, 8, seed=n)
    torch.testing.assert_close(A.blockwise_attention(q, k, v, block_size),
                               A.naive_attention(q, k, v), atol=1e-12, rtol=1e-12)


def test_blockwise_with_fully_masked_blocks():
    q, k, v = _qkv((2,), 40, 8)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[:, :8] = False          # the whole first block: the running max starts at -inf
    mask[0, 16:24] = False       # a whole block in the middle
    mask[1, 35:] = False
    v = v.masked_fill(~mask[..., None], 0.0)
    scores = (k @ q[..., None])[..., 0] * 8 ** -0.5
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    expected = (probs[..., None, :] @ v)[..., 0, :]
    got = A.blockwise_attention(q, k, v, 8, mask=mask)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)


def test_trace_records_running_max_and_sum():
    q, k, v = _qkv((), 30, 4)
    trace = A.Trace()
    A.blockwise_attention(q, k, v, 8, trace=trace)
    assert len(trace.running_max) == len(trace.running_sum) == 4
    maxes = torch.stack(trace.running_max)
    assert (maxes[1:] >= maxes[:-1]).all()
    scores = (k @ q) * 4 ** -0.5
    assert float(maxes[-1]) == pytest.approx(float(scores.max()))
    assert float(trace.running_sum[-1]) == pytest.approx(
        float(torch.exp(scores - scores.max()).sum()))


def _states(seed, parts=3, shape=(4,), d=6):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(parts):
        s = torch.randn(*shape, 5, generator=g, dtype=F64) * (1 + 4 * i)
        if i == 1:
            s[0] = float("-inf")   # one query's block entirely masked
        out.append(A.block_state(s, torch.randn(*shape, 5, d, generator=g, dtype=F64)))
    return out


def _close(x: A.SoftmaxState, y: A.SoftmaxState):
    for a, b in zip(x, y, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_merge_commutative_associative_identity(seed):
    a, b, c = _states(seed)
    _close(A.merge(a, b), A.merge(b, a))
    _close(A.merge(A.merge(a, b), c), A.merge(a, A.merge(b, c)))
    _close(A.merge(a, A.empty_state(torch.zeros(4, 6, dtype=F64))), a)
    for perm in itertools.permutations((a, b, c)):
        _close(A.merge(A.merge(perm[0], perm[1]), perm[2]), A.merge(A.merge(a, b), c))


def test_merge_of_two_empty_states_has_no_nan():
    e = A.empty_state(torch.zeros(3, 4, dtype=F64))
    m = A.merge(e, e)
    assert torch.isinf(m.m).all() and (m.l == 0).all() and (m.acc == 0).all()


def _poisoned(seed, num_blocks, block_size, kv_heads, d, tables, lens, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return small_attention.poisoned_cache(g, num_blocks, block_size, kv_heads, d, tables, lens,
                                          dtype)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (5, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_blockwise_matches_reference(heads, block_size):
    num_heads, kv_heads = heads
    lens = [1, block_size, block_size + 1, 3 * block_size + 2]
    tables = [[3, 3, 0, 7], [5, 99, 99, 99], [1, 1, 99, 99], [6, 2, 6, 4]]
    k, v = _poisoned(1, 8, block_size, kv_heads, 8, tables, lens)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, num_heads, 8, generator=g, dtype=F64)
    bt = torch.tensor(tables, dtype=torch.int32)
    ref = ref_paged_attention(q, k, v, bt % 8, torch.tensor(lens, dtype=torch.int32))
    assert not ref.isnan().any()
    for s, n in enumerate(lens):
        got = A.paged_blockwise_attention(q[s], k, v, bt[s], n)
        torch.testing.assert_close(got, ref[s], atol=1e-12, rtol=1e-12)


def test_gather_kv_reads_only_the_sequence():
    tables = [[4, 1, 4]]
    k, _ = _poisoned(3, 6, 4, 2, 3, tables, [9])
    got = gather_kv(k, torch.tensor(tables[0]), 9)
    assert got.shape == (9, 2, 3) and not got.isnan().any()
    torch.testing.assert_close(got[4:8], k[1])
    torch.testing.assert_close(got[8], k[4, 0])


def test_figures():
    q, k, v = _qkv((), 40, 8)
    trace = A.Trace()
    A.blockwise_attention(q, k, v, 8, trace=trace, mask=torch.arange(40) >= 8)
    assert isinstance(viz.running_softmax(trace, block_size=8), matplotlib.figure.Figure)
    fig = viz.block_gather([5, 2, 9, 77], 40, 16, 12)
    assert isinstance(fig, matplotlib.figure.Figure)
    matplotlib.pyplot.close("all")

# The graders of chapter 04 are tested in tests/test_graders_ch04_05.py.


def test_block_reads_picture_shows_each_read():
    from paged_lib.instruments import block_reads

    g = torch.Generator().manual_seed(0)
    k = torch.randn(12, 4, 1, 3, generator=g, dtype=F64)
    table = torch.tensor([5, 2, 9], dtype=torch.int32)
    q = torch.randn(1, 3, generator=g, dtype=F64)
    runs = {}
    for label, attend in [
            ("blockwise", lambda kc, vc: A.paged_blockwise_attention(q, kc, vc, table, 10)),
            ("gather", lambda kc, vc: ref_paged_attention(q[None], kc, vc, table[None],
                                                          torch.tensor([10]))[0])]:
        kw, vw, log = block_reads.watch(k, k, 1)
        attend(kw, vw)
        runs[label] = log.reads
    assert [(r.kind, r.block) for r in runs["blockwise"]] == [
        ("K", 5), ("V", 5), ("K", 2), ("V", 2), ("K", 9), ("V", 9)]
    assert [(r.kind, r.block) for r in runs["gather"]] == [("K", (5, 2, 9)), ("V", (5, 2, 9))]
    fig = viz.block_reads(runs, table.tolist())
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert "K P5,P2,P9\n(L0-L2)" in labels and "V P9\n(L2)" in labels
    matplotlib.pyplot.close("all")
