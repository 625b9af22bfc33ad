"""The paged decode kernel in Triton: one query token per sequence, K/V read through a block table.

One program per (sequence, KV head[, KV segment]). The program loads the query rows of
*all* query heads that share its KV head (GQA: a ``[GROUP_PAD, HEAD_PAD]`` tile, padded
heads masked), so each K/V tile is read from memory once and used by the whole group,
as vLLM does. It then walks the sequence's tokens ``TILE_N`` at a time: each token's
physical address is ``block_tables[seq, pos // BLOCK_SIZE] * stride + pos % BLOCK_SIZE``
(block ids cast to int64 first, so a large cache cannot overflow 32-bit offsets),
tokens past the end are masked (never loaded), and an online softmax in fp32 folds the
tile into running max ``m``, denominator ``l`` and accumulator ``acc``.

Call it through :func:`paged_lib.kernels.paged_attention`, which validates its inputs;
:func:`paged_attention_triton` here only launches.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from paged_lib.device import interpreter_on
from paged_lib.kernels.triton_split import choose_num_splits, merge_splits, split_len

LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode_kernel(
    out_ptr, lse_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    scale_log2,  # softmax scale * log2(e): the kernel works with exp2
    split_tokens,  # tokens per KV segment (ignored when NUM_SPLITS == 1)
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_os, stride_oh, stride_osplit, stride_od,
    stride_ls, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if NUM_SPLITS == 1:
        start = 0
        end = seq_len
    else:
        start = split * split_tokens
        end = tl.minimum(seq_len, start + split_tokens)

    # The query rows of every head in this KV head's group: [GROUP_PAD, HEAD_PAD].
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    heads = kv_head * GROUP + g
    row_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running softmax denominator
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)  # running sum of p * v

    t = tl.arange(0, TILE_N)
    block_table = block_tables_ptr + seq * stride_bts
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + t  # logical token positions of this tile
        valid = pos < end
        block = tl.load(block_table + (pos // BLOCK_SIZE) * stride_btb, mask=valid, other=0)
        block = block.to(tl.int64)  # 64-bit before multiplying by a stride
        offset = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_kt
                    + kv_head * stride_kh + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vt
                    + kv_head * stride_vh + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))  # [GROUP_PAD, TILE_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was summed so far
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_ptrs = (out_ptr + seq * stride_os + heads[:, None] * stride_oh + split * stride_osplit
                + d[None, :] * stride_od)
    if NUM_SPLITS == 1:
        tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        # This segment's partial output and log-sum-exp; an empty segment weighs 0.
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        tl.store(out_ptrs, acc / l_safe[:, None], mask=row_mask)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=g < GROUP)


def launch_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tile size and warps per head size, chosen by hand (used in the interpreter, and on
    a GPU when autotuning is off): K and V tiles of 8-16 KB each per pipeline stage."""
    head_pad = max(16, triton.next_power_of_2(head_dim))
    tile_n = 64 if head_pad <= 64 else 32 if head_pad <= 128 else 16
    return {"TILE_N": tile_n, "num_warps": 4 if head_pad <= 128 else 8, "num_stages": 3}


#: (TILE_N, num_warps, num_stages) tried by the GPU autotuner: a few, not a search space.
GPU_CONFIGS = [(16, 4, 3), (32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 2),
               (128, 8, 2)]
#: Segment lengths are rounded to this, a multiple of every TILE_N above.
MAX_TILE_N = 128


def make_autotuned_decode_kernel(do_bench=None):
    """The decode kernel wrapped in ``triton.autotune`` over :data:`GPU_CONFIGS`.

    Keyed by the compile-time shape (group, head size, block size, splits). Only used on a
    GPU that compiles natively: in the interpreter, autotuning more than one config fails
    (tests pass a stand-in ``do_bench`` to exercise the plumbing).
    """
    configs = [triton.Config({"TILE_N": t}, num_warps=w, num_stages=s)
               for t, w, s in GPU_CONFIGS]
    return triton.autotune(configs=configs, key=["GROUP", "HEAD_DIM", "BLOCK_SIZE", "NUM_SPLITS"],
                           do_bench=do_bench)(_paged_decode_kernel)


_autotuned_kernel = None


def use_autotune(device: torch.device) -> bool:
    """Autotune on a GPU that compiles natively, unless ``PAGED_LIB_AUTOTUNE=0``."""
    return (device.type == "cuda" and not interpreter_on()
            and os.environ.get("PAGED_LIB_AUTOTUNE", "1") != "0")


def num_sms(device: torch.device) -> int | None:
    """SM count of a GPU that compiles kernels natively; None in the interpreter."""
    if device.type != "cuda" or interpreter_on():
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, tile_n: int | None = None,
                           max_seq_len: int | None = None,
                           autotune: bool | None = None) -> torch.Tensor:
    """Launch the decode kernel on already validated inputs (see ``paged_attention``).

    ``num_splits=None`` picks the split-KV segment count with
    :func:`~paged_lib.kernels.triton_split.choose_num_splits`; ``tile_n`` fixes the tile
    size (tests use it to put tiles across block boundaries); ``max_seq_len`` saves a
    device-to-host copy when the caller knows it; ``autotune=None`` autotunes where
    :func:`use_autotune` says so (never in the interpreter).
    """
    global _autotuned_kernel
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if autotune is None:
        autotune = tile_n is None and use_autotune(q.device)
    cfg = launch_config(head_dim, q.dtype)
    if tile_n is not None:
        cfg["TILE_N"] = tile_n
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms(q.device))
    tokens = 0
    if num_splits > 1:  # segment length in whole tiles; rounding may leave fewer segments
        tokens = split_len(max_seq_len, num_splits, MAX_TILE_N if autotune else cfg["TILE_N"])
        num_splits = math.ceil(max_seq_len / tokens)
    interp = interpreter_on()
    consts = dict(
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        # The interpreter has no bf16 arithmetic: upcast after load there.
        UPCAST=interp and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if autotune:
        if _autotuned_kernel is None:
            _autotuned_kernel = make_autotuned_decode_kernel()
        kernel = _autotuned_kernel
    else:
        kernel = _paged_decode_kernel
        consts["TILE_N"] = cfg["TILE_N"]
        if not interp:
            consts.update(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if num_splits == 1:
        target, lse = out.unsqueeze(2), out  # [S, H, 1, D] view of the output; lse unused
    else:
        target = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                             device=q.device)
        lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    kernel[(num_seqs, num_kv_heads, num_splits)](
        target, lse, q, k_cache, v_cache, block_tables, seq_lens,
        scale * LOG2E, tokens,
        q.stride(0), q.stride(1), q.stride(2),
        *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0), block_tables.stride(1),
        *target.stride(), lse.stride(0), lse.stride(1),
        **consts,
    )
    if num_splits > 1:
        merge_splits(target, lse, out)
    return out
