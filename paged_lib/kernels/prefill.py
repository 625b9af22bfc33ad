"""Paged prefill: new query tokens attend causally to the cached context and to themselves.

Layout (varlen, like vLLM's ``cu_seqlens``): the new tokens of all sequences are packed
into ``q [total_query_tokens, num_heads, head_dim]``; sequence ``s`` owns rows
``query_start[s] : query_start[s + 1]`` where ``query_start`` is the cumulative sum of
``query_lens``. ``seq_lens[s]`` *includes* the new tokens, whose K/V were already
written to the cache by ``reshape_and_cache``. With context ``c = seq_len - query_len``,
new token ``i`` sits at position ``c + i`` and sees positions ``0 .. c + i``.

Decode is the special case ``query_lens == 1``. Call it through
:func:`paged_lib.kernels.paged_prefill`, which validates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from paged_lib.device import interpreter_on
from paged_lib.kernels.reference import gather_kv, ref_paged_prefill  # noqa: F401 (chapter 05)
from paged_lib.kernels.triton_decode import LOG2E


@triton.jit
def _paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per (sequence, KV head, tile of BLOCK_Q new tokens).

    Row ``r`` of the ``[BLOCK_M, HEAD_PAD]`` query tile is new token ``r // GROUP`` of
    the tile and query head ``kv_head * GROUP + r % GROUP``: every head of the GQA
    group shares each K/V tile, as in decode.
    """
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= query_len:  # this sequence has fewer new tokens
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - query_len

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_PAD)
    tok = q_block * BLOCK_Q + r // GROUP  # index among this sequence's new tokens
    heads = kv_head * GROUP + r % GROUP
    row_valid = (r < BLOCK_Q * GROUP) & (tok < query_len)
    row_pos = context + tok  # the position each row sits at (and sees up to)
    row_mask = row_valid[:, None] & (d < HEAD_DIM)[None, :]
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=row_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)

    kv_end = tl.minimum(seq_len, context + (q_block + 1) * BLOCK_Q)  # causal: no further
    t = tl.arange(0, TILE_N)
    block_table = block_tables_ptr + seq * stride_bts
    for tile_start in range(0, kv_end, TILE_N):
        pos = tile_start + t
        valid = pos < kv_end
        block = tl.load(block_table + (pos // BLOCK_SIZE) * stride_btb, mask=valid, other=0)
        block = block.to(tl.int64)
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
        # Causal mask; every row sees position 0, so its running max is finite from tile 0.
        s = tl.where(valid[None, :] & (pos[None, :] <= row_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh
             + d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def paged_prefill_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         query_lens: torch.Tensor, scale: float,
                         max_query_len: int | None = None) -> torch.Tensor:
    """Launch the prefill kernel on validated inputs."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs = seq_lens.shape[0]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    query_start = torch.zeros(num_seqs + 1, dtype=torch.int32, device=q.device)
    query_start[1:] = torch.cumsum(query_lens, 0)
    if max_query_len is None:
        max_query_len = int(query_lens.max())
    # About 64 rows (tokens x heads of the group) per program.
    block_q = max(1, 64 // triton.next_power_of_2(group))
    block_m = max(16, triton.next_power_of_2(block_q * group))
    head_pad = max(16, triton.next_power_of_2(head_dim))
    interp = interpreter_on()
    launch = {} if interp else {"num_warps": 4, "num_stages": 2}
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _paged_prefill_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start,
        scale * LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0), block_tables.stride(1), *out.stride(),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, TILE_N=32 if head_pad <= 128 else 16,
        UPCAST=interp and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **launch,
    )
    return out


def paged_prefill_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Prefill in PyTorch: per sequence, gather its K/V and run causal SDPA (fp32)."""
    out = torch.empty_like(q)
    num_heads = q.shape[1]
    start = 0
    for s, (n, ql) in enumerate(zip(seq_lens.tolist(), query_lens.tolist(), strict=True)):
        k = gather_kv(k_cache, block_tables[s], n).float().transpose(0, 1)  # [kv_heads, n, d]
        v = gather_kv(v_cache, block_tables[s], n).float().transpose(0, 1)
        qs = q[start:start + ql].float().transpose(0, 1)  # [heads, ql, d]
        rows = torch.arange(n - ql, n, device=q.device)[:, None]  # positions of new tokens
        mask = torch.arange(n, device=q.device)[None, :] <= rows  # [ql, n]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=num_heads != k.shape[0])
        out[start:start + ql] = o.transpose(0, 1).to(q.dtype)
        start += ql
    return out
