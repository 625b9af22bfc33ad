"""The vectorised PyTorch paged-attention backend against the float64 naive reference."""

from __future__ import annotations

import pytest
import torch

import paged_lib  # noqa: F401  (sets up the interpreter before anything Triton)
from paged_lib.kernels.cases import make_decode_case
from paged_lib.kernels.reference import ref_paged_attention
from paged_lib.kernels.torch_backend import paged_attention_torch


def _case(num_heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """Sequences of length 1, a full block, a block plus one, and longer ones, on the
    shared NaN-poisoned case (repeated blocks, -1 padding past each sequence's end)."""
    lens = [1, block_size, block_size + 1, 5 * block_size - 3, 11 * block_size + 7]
    case = make_decode_case(lens, num_heads, kv_heads, head_dim, block_size, dtype, seed=seed)
    return case[:5]


def _reference(q, k, v, tables, lens, scale):
    return ref_paged_attention(q, k, v, tables, lens, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (5, 1)])
def test_matches_reference(heads, head_dim, block_size, dtype):
    q, k, v, tables, lens = _case(*heads, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    out = paged_attention_torch(q, k, v, tables, lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert not out.isnan().any(), "read a NaN-poisoned slot"
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, _reference(q, k, v, tables, lens, scale), atol=tol,
                               rtol=tol)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("blocks_per_segment", [1, 3, 64])
def test_segment_sizes_and_both_paths(fused, blocks_per_segment):
    q, k, v, tables, lens = _case(8, 2, 64, 16, torch.float64, seed=1)
    out = paged_attention_torch(q, k, v, tables, lens, 0.3, fused=fused,
                                blocks_per_segment=blocks_per_segment)
    torch.testing.assert_close(out, _reference(q, k, v, tables, lens, 0.3), atol=1e-12,
                               rtol=1e-12)


def test_large_scores_do_not_overflow():
    q, k, v, tables, lens = _case(4, 4, 64, 16, torch.float32, seed=2)
    q = q * 200
    out = paged_attention_torch(q, k, v, tables, lens, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _reference(q, k, v, tables, lens, 1.0), atol=1e-4,
                               rtol=1e-4)


def test_empty_sequence_gives_zeros():
    q, k, v, tables, lens = _case(4, 2, 64, 8, torch.float32, seed=3)
    lens[2] = 0
    out = paged_attention_torch(q, k, v, tables, lens, 0.125)
    assert (out[2] == 0).all()
    keep = [0, 1, 3, 4]
    torch.testing.assert_close(out[keep], _reference(q, k, v, tables, lens, 0.125)[keep],
                               atol=1e-5, rtol=1e-5)


def test_empty_batch():
    q, k, v, tables, lens = _case(4, 2, 64, 8, torch.float32, seed=4)
    out = paged_attention_torch(q[:0], k, v, tables[:0], lens[:0], 0.125)
    assert out.shape == (0, 4, 64)


def test_merge_segments_is_softmax_over_all_parts():
    """The one merge: parts of a sequence combine to the softmax over all their scores."""
    from paged_lib.attention import merge_partials
    from paged_lib.kernels.torch_backend import merge_segments

    g = torch.Generator().manual_seed(5)
    scores = torch.randn(7, 3, generator=g, dtype=torch.float64) * 5  # 7 tokens, 3 heads
    values = torch.randn(7, 3, 4, generator=g, dtype=torch.float64)
    cuts = [(0, 2), (2, 3), (3, 7)]  # three parts of one sequence
    outs, lses = [], []
    for a, b in cuts:
        p = torch.softmax(scores[a:b], dim=0)
        outs.append(torch.einsum("th,thd->hd", p, values[a:b]))
        lses.append(torch.logsumexp(scores[a:b], dim=0))
    outs.append(torch.full((3, 4), float("nan"), dtype=torch.float64))  # an empty part
    lses.append(torch.full((3,), float("-inf"), dtype=torch.float64))
    # Sequence 0: the four parts; sequence 1: none; sequence 2: one empty part.
    out = torch.stack(outs + [torch.zeros(3, 4, dtype=torch.float64)])
    lse = torch.stack(lses + [torch.full((3,), float("-inf"), dtype=torch.float64)])
    seg_seq, seg_idx = torch.tensor([0, 0, 0, 0, 2]), torch.tensor([0, 1, 2, 3, 0])
    merged = merge_segments(out, lse, seg_seq, seg_idx, 3)
    expected = torch.einsum("th,thd->hd", torch.softmax(scores, dim=0), values)
    torch.testing.assert_close(merged[0], expected, atol=1e-12, rtol=1e-12)
    assert (merged[1:] == 0).all()  # no part, or only empty ones: zeros, not NaN
    # merge_segments is merge_partials over each sequence's stack of parts.
    torch.testing.assert_close(merge_partials(out[:4], lse[:4]), merged[0], atol=0, rtol=0)


def test_merge_partials_is_merge_states_of_normalised_parts():
    """Chapter 04's merge and the log-sum-exp merge are one computation: a part
    normalised by its own denominator is the state (m = lse, l = 1, acc = out)."""
    from paged_lib import attention as A

    g = torch.Generator().manual_seed(6)
    scores = torch.randn(2, 9, generator=g, dtype=torch.float64) * 4
    values = torch.randn(9, 5, generator=g, dtype=torch.float64)
    a = A.block_state(scores[:, :4], values[:4])
    b = A.block_state(scores[:, 4:], values[4:])
    via_states = A.finalize(A.merge(a, b))
    parts = torch.stack([A.finalize(a), A.finalize(b)])
    lse = torch.stack([a.m + a.l.log(), b.m + b.l.log()])
    torch.testing.assert_close(A.merge_partials(parts, lse), via_states, atol=1e-12, rtol=1e-12)
    expected = torch.softmax(scores, dim=-1) @ values
    torch.testing.assert_close(via_states, expected, atol=1e-12, rtol=1e-12)


def test_merge_segments_keeps_a_poisoned_part_nan():
    """A part that read a NaN slot must make its sequence NaN, not quietly zero: the NaN
    poisoning of the kernel tests relies on it."""
    from paged_lib.kernels.torch_backend import merge_segments

    out = torch.ones(3, 2, 4, dtype=torch.float64)
    lse = torch.zeros(3, 2, dtype=torch.float64)
    lse[1, 0] = float("nan")  # sequence 0's second part saw poison in head 0
    merged = merge_segments(out, lse, torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), 2)
    assert merged[0, 0].isnan().all()
    assert not merged[0, 1].isnan().any() and not merged[1].isnan().any()
