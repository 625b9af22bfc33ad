"""Split-KV decode (flash-decoding): when to split a long context, and how to merge.

A decode step launches one program per (sequence, KV head). With 64 sequences and 8 KV
heads that is 512 programs, plenty to fill a GPU. With 2 sequences it is 16 programs on
a GPU that has over a hundred SMs: most of the chip idles while 16 programs walk
thousands of tokens each. Flash-decoding cuts each sequence's context into
``num_splits`` segments, runs one program per (sequence, KV head, segment), and lets
every program write

* its partial output ``o_j`` (already divided by its own softmax denominator), and
* its log-sum-exp ``lse_j = m_j + log2(l_j)`` (base 2, like the kernel's ``exp2``),

which a second, tiny kernel merges exactly::

    out = sum_j 2**(lse_j - M) * o_j / sum_j 2**(lse_j - M),   M = max_j lse_j

A segment that holds no token of a short sequence writes ``lse = -inf`` and weighs 0.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

#: A segment shorter than this is not worth its own program (and the merge it costs).
MIN_TOKENS_PER_SPLIT = 256
#: More segments than this only add merge work.
MAX_SPLITS = 16


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      num_sms: int | None) -> int:
    """How many KV segments per sequence a decode launch should use (1 = no split).

    The heuristic (documented in chapter 05): split only on a GPU (``num_sms`` known)
    when the plain launch has fewer programs (``num_seqs * num_kv_heads``) than the GPU
    has SMs *and* the longest context is at least two segments of
    ``MIN_TOKENS_PER_SPLIT`` tokens. Then aim for about two programs per SM, at most
    ``MAX_SPLITS`` segments, each at least ``MIN_TOKENS_PER_SPLIT`` tokens long.
    In Triton's interpreter (``num_sms=None``) every extra program costs CPU time and
    buys nothing, so it never splits unless a caller forces it.
    """
    programs = num_seqs * num_kv_heads
    if num_sms is None or programs == 0 or programs >= num_sms:
        return 1
    if max_seq_len < 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    wanted = math.ceil(2 * num_sms / programs)
    return max(1, min(MAX_SPLITS, wanted, max_seq_len // MIN_TOKENS_PER_SPLIT))


def split_len(max_seq_len: int, num_splits: int, tile_n: int) -> int:
    """Tokens per segment: the longest context cut in ``num_splits``, rounded up to tiles."""
    per_split = math.ceil(max_seq_len / num_splits)
    return math.ceil(per_split / tile_n) * tile_n


@triton.jit
def _merge_splits_kernel(
    out_ptr, partial_ptr, lse_ptr,
    stride_os, stride_oh, stride_od,
    num_heads,
    NUM_SPLITS: tl.constexpr, SPLIT_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    """One program per (sequence, query head): merge NUM_SPLITS partial outputs."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLIT_PAD)
    d = tl.arange(0, HEAD_PAD)
    s_mask = s < NUM_SPLITS
    row = (seq * num_heads + head) * NUM_SPLITS  # partials are contiguous [S, H, NUM_SPLITS, D]
    lse = tl.load(lse_ptr + row + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)  # finite: the first segment always holds token 0
    w = tl.exp2(lse - m)  # empty segments: 2**-inf = 0
    part = tl.load(partial_ptr + (row + s[:, None]) * HEAD_DIM + d[None, :],
                   mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Launch the merge: ``partial`` fp32 ``[S, H, splits, D]``, ``lse`` fp32 ``[S, H, splits]``."""
    num_seqs, num_heads, num_splits, head_dim = partial.shape
    grid = (num_seqs, num_heads)
    _merge_splits_kernel[grid](
        out, partial, lse,
        out.stride(0), out.stride(1), out.stride(2),
        num_heads,
        NUM_SPLITS=num_splits, SPLIT_PAD=max(2, triton.next_power_of_2(num_splits)),
        HEAD_DIM=head_dim, HEAD_PAD=max(16, triton.next_power_of_2(head_dim)),
    )
    return out


def merge_splits_torch(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The same merge in PyTorch (base-2 log-sum-exp), for tests and the notebook."""
    m = lse.max(dim=-1, keepdim=True).values
    w = torch.exp2(lse - m)
    return (w.unsqueeze(-1) * partial).sum(-2) / w.sum(-1, keepdim=True)
