"""Split-KV decode (flash-decoding): when to split a long context, and how to merge.

A decode step launches one program per (sequence, KV head). With 64 sequences and 8 KV
heads that is 512 programs, plenty to fill a GPU. With 2 sequences it is 16 programs on
a GPU that has over a hundred SMs: most of the chip idles while 16 programs walk
thousands of tokens each. Flash-decoding cuts each sequence's context into
``num_splits`` segments of ``cdiv(seq_len, num_splits)`` tokens (rounded up to whole
tiles; each sequence by its *own* length), runs one program per (sequence, KV head,
segment), and lets every program write

* its partial output ``o_j`` (already divided by its own softmax denominator), and
* its log-sum-exp ``lse_j``, the natural log of its softmax denominator (the kernels
  compute in base 2, with ``exp2``, and convert at their boundary: ``ln x = log2 x * ln 2``),

which a second, tiny kernel merges exactly (:func:`merge_splits`, the fused GPU form
of :func:`paged_lib.attention.merge_partials`, tested equal)::

    out = sum_j exp(lse_j - M) * o_j / sum_j exp(lse_j - M),   M = max_j lse_j

A segment that holds no token writes ``lse = -inf`` and weighs 0; a sequence of length 0
has only such segments and gets zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_lib.kernels.triton_tile import LOG2E
from paged_lib.util import cdiv

#: A segment shorter than this is not worth its own program (and the merge it costs).
MIN_TOKENS_PER_SPLIT = 256
#: More segments than this only add merge work. 16 left one long sequence with 8 KV heads
#: at 128 programs on an H200's 132 SMs, one program per SM: 28% of peak bandwidth at 32K
#: tokens (``reports/gpu-check-nvidia-h200.md``). 64 gives such a launch 512 programs.
MAX_SPLITS = 64
#: Programs per SM a split launch aims for: several, so that SMs whose programs finish
#: early (shorter sequences) pick up others, and memory latency hides behind them.
PROGRAMS_PER_SM = 4


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      num_sms: int | None, head_chunks: int = 1) -> int:
    """How many KV segments per sequence a decode launch should use (1 = no split).

    Split only on a GPU (``num_sms`` known) when the plain launch
    (``num_seqs * num_kv_heads * head_chunks`` programs) has fewer than
    ``PROGRAMS_PER_SM`` programs per SM *and* the longest context is at least two
    segments of ``MIN_TOKENS_PER_SPLIT`` tokens. The count is a power of two (a few
    buckets: the partial buffers, and CUDA graphs captured for them, are reused), at
    most ``MAX_SPLITS``, with segments at least ``MIN_TOKENS_PER_SPLIT`` long.
    ``max_seq_len`` may be an upper bound (the block tables' capacity) when the caller
    does not want to read lengths back from the GPU.
    In Triton's interpreter (``num_sms=None``) every extra program costs CPU time and
    buys nothing, so it never splits unless a caller forces it.
    """
    programs = num_seqs * num_kv_heads * head_chunks
    target = PROGRAMS_PER_SM * (num_sms or 0)
    if num_sms is None or programs == 0 or programs >= target:
        return 1
    if max_seq_len < 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    wanted = min(MAX_SPLITS, cdiv(target, programs), max_seq_len // MIN_TOKENS_PER_SPLIT)
    return 1 << (wanted.bit_length() - 1)  # round down to a power of two


def split_len(seq_len: int, num_splits: int, tile_n: int) -> int:
    """Tokens per segment of one sequence: ``cdiv(seq_len, num_splits)`` in whole tiles."""
    return cdiv(cdiv(seq_len, num_splits), tile_n) * tile_n


#: Elements of the ``[heads, splits, head_dim]`` tile one merge program holds: enough
#: heads per program that the interpreter runs few programs, few enough not to spill.
MERGE_TILE_ELEMS = 8192


@triton.jit
def _merge_splits_kernel(
    out_ptr, partial_ptr, lse_ptr,
    stride_os, stride_oh, stride_od,
    num_heads, num_splits,
    HEADS: tl.constexpr, SPLIT_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """One program per (sequence, HEADS query heads): merge ``num_splits`` partial outputs."""
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    s = tl.arange(0, SPLIT_PAD)
    d = tl.arange(0, HEAD_PAD)
    hs_mask = (h < num_heads)[:, None] & (s < num_splits)[None, :]
    row = (seq * num_heads + h) * num_splits  # partials are contiguous [S, H, splits, D]
    lse = tl.load(lse_ptr + row[:, None] + s[None, :], mask=hs_mask, other=float("-inf"))
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # every segment empty (seq_len 0): no NaN
    # exp(x) = 2**(x * log2(e)); empty segments: 2**-inf = 0. [HEADS, SPLIT_PAD]
    w = tl.exp2((lse - m[:, None]) * LOG2E)
    offs = (row[:, None] + s[None, :]) * HEAD_DIM
    part = tl.load(partial_ptr + offs[:, :, None] + d[None, None, :],
                   mask=hs_mask[:, :, None] & (d < HEAD_DIM)[None, None, :], other=0.0)
    den = tl.sum(w, 1)
    out = tl.sum(w[:, :, None] * part, 1) / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_os + h[:, None] * stride_oh + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty),
             mask=(h < num_heads)[:, None] & (d < HEAD_DIM)[None, :])


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Launch the merge: ``partial`` fp32 ``[S, H, splits, D]``, ``lse`` fp32 ``[S, H, splits]``
    (natural log, contiguous), into ``out [S, H, D]``."""
    num_seqs, num_heads, num_splits, head_dim = partial.shape
    if num_seqs == 0:
        return out
    split_pad = max(2, triton.next_power_of_2(num_splits))
    head_pad = max(16, triton.next_power_of_2(head_dim))
    heads = max(1, min(16, triton.next_power_of_2(num_heads),
                       MERGE_TILE_ELEMS // (split_pad * head_pad)))
    _merge_splits_kernel[(num_seqs, cdiv(num_heads, heads))](
        out, partial, lse,
        out.stride(0), out.stride(1), out.stride(2),
        num_heads, num_splits,
        HEADS=heads, SPLIT_PAD=split_pad, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
    )
    return out
