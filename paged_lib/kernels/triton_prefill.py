"""Paged prefill in Triton: new tokens attend causally to the cached context and themselves.

Layout (varlen, like vLLM's ``cu_seqlens``): the new tokens of all sequences are packed
into ``q [total_query_tokens, num_heads, head_dim]``; sequence ``s`` owns rows
``query_start[s] : query_start[s + 1]`` where ``query_start`` is the cumulative sum of
``query_lens``. ``seq_lens[s]`` *includes* the new tokens, whose K/V were already
written to the cache by ``reshape_and_cache``. With context ``c = seq_len - query_len``,
new token ``i`` sits at position ``c + i`` and sees positions ``0 .. c + i``.

The tile loop is the decode kernel's (:func:`~paged_lib.kernels.triton_tile.attend_tile`,
with the causal mask on). Decode is the special case ``query_lens == 1``. Call it through
:func:`paged_lib.kernels.paged_prefill`, which validates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_lib.device import interpreter_on
from paged_lib.kernels.kv_quant import quant_args
from paged_lib.kernels.triton_decode import MAX_GROUP_TILE, alignment, head_pad, on_device
from paged_lib.kernels.triton_tile import LOG2E, attend_tile, no_block, tile_blocks
from paged_lib.util import cdiv

#: Query rows (new tokens x query heads) per program.
BLOCK_M = 64
#: CUDA limits the grid's second and third axes to 65535 programs.
MAX_GRID_YZ = 65535


@triton.jit
def _paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_ot, stride_oh, stride_od,
    k_scale_ptr, v_scale_ptr, stride_sb, stride_sh,  # quantised caches (chapter 11)
    GROUP: tl.constexpr, GROUP_TILE: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr = 0,
):
    """One program per (tile of BLOCK_Q new tokens, KV head and head chunk, sequence).

    Row ``r < BLOCK_Q * GROUP_TILE`` of the ``[ROWS, HEAD_PAD]`` query tile is new token
    ``r // GROUP_TILE`` of the tile and query head ``r % GROUP_TILE`` of this chunk of
    the KV head's group: those heads share each K/V tile, as in decode; the few rows
    left over (``ROWS % GROUP_TILE``) are masked. The token tiles
    are on the grid's first axis, the only one allowed more than 65535 programs.
    """
    q_block = tl.program_id(0)
    chunks: tl.constexpr = (GROUP + GROUP_TILE - 1) // GROUP_TILE
    kv_head = tl.program_id(1) // chunks
    chunk = tl.program_id(1) % chunks
    seq = tl.program_id(2).to(tl.int64)
    q_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= query_len:  # this sequence has fewer new tokens
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - query_len

    r = tl.arange(0, ROWS)
    d = tl.arange(0, HEAD_PAD)
    tok = q_block * BLOCK_Q + r // GROUP_TILE  # index among this sequence's new tokens
    g = chunk * GROUP_TILE + r % GROUP_TILE
    heads = kv_head * GROUP + g
    row_valid = (g < GROUP) & (tok < query_len) & (r < BLOCK_Q * GROUP_TILE)
    row_pos = context + tok  # the position each row sits at (and sees up to)
    row_mask = row_valid[:, None] & (d < HEAD_DIM)[None, :]
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=row_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)

    kv_end = tl.minimum(seq_len, context + (q_block + 1) * BLOCK_Q)  # causal: no further
    t = tl.arange(0, TILE_N)
    block_table = block_tables_ptr + seq * stride_bts
    block = no_block(TILE_N, BLOCK_SIZE)
    for tile_start in range(0, kv_end, TILE_N):
        block = tile_blocks(block, block_table, stride_btb, tile_start, 0, kv_end,
                            TILE_N, BLOCK_SIZE)
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, tile_start + t, kv_end, row_pos, block,
            k_cache_ptr, v_cache_ptr, kv_head, d,
            stride_kb, stride_kt, stride_kh, stride_kd,
            stride_vb, stride_vt, stride_vh, stride_vd, scale_log2,
            k_scale_ptr, v_scale_ptr, stride_sb, stride_sh,
            HEAD_DIM, ALIGN, BLOCK_SIZE, True, UPCAST, DOT_PRECISION, KV_QUANT)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # padded rows: 0, never NaN
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh
             + d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def prefill_tiles(group: int) -> tuple[int, int]:
    """``(GROUP_TILE, BLOCK_Q)``: query heads and new tokens per program, at most
    :data:`BLOCK_M` rows in all.

    A group of up to 16 heads is one chunk of exactly ``group`` heads (no padding to a
    power of two: group 5 fills 60 of the 64 rows with 12 tokens, not 40 with 8); a larger
    group is cut into ``cdiv(group, 16)`` chunks of equal size (71 heads: 5 chunks of 15).
    """
    group_tile = cdiv(group, cdiv(group, MAX_GROUP_TILE))
    return group_tile, BLOCK_M // group_tile


def prefill_config(head_dim: int, dtype: torch.dtype) -> dict:
    """K/V tile and launch of the prefill kernel, checked by compiling for sm_80 and sm_90
    (tools/aot_compile.py): none spills. 8 warps: 64 query rows of fp32 accumulators at
    head size 256 took 218 registers per thread with 4 warps, 142 with 8. fp32 tiles are
    16 tokens (32 spilled on sm_80 from head size 40 up), with 16 warps at head size 256
    (8 spilled over 11 KB on sm_90)."""
    if dtype.itemsize >= 4:
        return {"TILE_N": 16, "num_warps": 16 if head_pad(head_dim) >= 256 else 8,
                "num_stages": 2}
    return {"TILE_N": 32 if head_pad(head_dim) <= 128 else 16, "num_warps": 8,
            "num_stages": 2}


def paged_prefill_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         query_lens: torch.Tensor, scale: float,
                         max_query_len: int | None = None,
                         kv_quant: tuple | None = None) -> torch.Tensor:
    """Launch the prefill kernel on validated inputs.

    ``max_query_len`` sizes the grid; without it the total number of new tokens is used
    (an upper bound: surplus programs return at once), so nothing is read back from the GPU.
    ``kv_quant``: quantised caches, as in the decode kernel (chapter 11).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs = seq_lens.shape[0]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    group_tile, block_q = prefill_tiles(group)
    chunks = cdiv(group, group_tile)
    if num_seqs > MAX_GRID_YZ or num_kv_heads * chunks > MAX_GRID_YZ:
        raise ValueError(f"{num_seqs} sequences x {num_kv_heads * chunks} head programs: "
                         f"at most {MAX_GRID_YZ} of each per launch; split the batch")
    query_start = torch.zeros(num_seqs + 1, dtype=torch.int32, device=q.device)
    query_start[1:] = torch.cumsum(query_lens, 0)
    if max_query_len is None:
        max_query_len = q.shape[0]
    pad = head_pad(head_dim)
    interp = interpreter_on()
    cfg = prefill_config(head_dim, q.dtype)
    launch = {} if interp else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    grid = (cdiv(max_query_len, block_q), num_kv_heads * chunks, num_seqs)
    k_cache, v_cache, scale_args, kv_quant_code = quant_args(k_cache, v_cache, kv_quant)
    with on_device(q.device):
        _paged_prefill_kernel[grid](
            out, q, k_cache, v_cache, block_tables, seq_lens, query_start,
            scale * LOG2E.value,
            *q.stride(), *k_cache.stride(), *v_cache.stride(),
            block_tables.stride(0), block_tables.stride(1), *out.stride(), *scale_args,
            GROUP=group, GROUP_TILE=group_tile, BLOCK_Q=block_q, ROWS=BLOCK_M,
            HEAD_DIM=head_dim, HEAD_PAD=pad,
            ALIGN=alignment(*k_cache.stride()[:3], *v_cache.stride()[:3]),
            BLOCK_SIZE=block_size, TILE_N=cfg["TILE_N"],
            UPCAST=interp and q.dtype == torch.bfloat16,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            KV_QUANT=kv_quant_code, **launch,
        )
    return out
