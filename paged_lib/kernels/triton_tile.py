"""One K/V tile of paged attention: the loop body the decode and prefill kernels share.

Both kernels walk a sequence's tokens ``TILE_N`` at a time and, per tile:

1. look up the physical block of the tile's tokens (:func:`tile_blocks`): each
   block-table entry is read once per block, not once per token, and cast to int64
   before it is multiplied by a stride (a cache of more than 2**31 elements must not
   overflow 32-bit offsets);
2. load the K and V rows of those tokens, masked by ``pos < end`` (a token past the end
   is never loaded, so a NaN-poisoned slot cannot reach the output);
3. upcast them where the interpreter has no bf16 arithmetic;
4. fold the tile into the running max ``m``, denominator ``l`` and accumulator ``acc``
   (the online softmax of chapter 04, in base 2: scores arrive scaled by ``log2(e)``).

:func:`attend_tile` is that body; a ``@triton.jit`` function called from a kernel is
inlined by Triton, so the two kernels compile as if each held its own copy. Decode
masks tokens by ``pos < end`` only; prefill (``CAUSAL``) also hides from query row ``r``
every position after ``row_pos[r]``.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: ``log2(e)``: ``exp(x) == exp2(x * LOG2E)``, the form GPUs compute fastest. The kernels
#: take scores scaled by it (host code: ``LOG2E.value``).
LOG2E = tl.constexpr(1.4426950408889634)
#: ``ln(2)``: a base-2 log times this is the natural log every interface uses.
LN2 = tl.constexpr(0.6931471805599453)


@triton.constexpr_function
def blocks_per_tile(tile_n, block_size):
    """Block-table entries a tile of ``tile_n`` positions can touch, padded to a power of
    two (``tl.arange`` needs one): ``tile_n // block_size`` when blocks tile it exactly."""
    if tile_n % block_size == 0:
        return tile_n // block_size
    return triton.next_power_of_2((tile_n - 1) // block_size + 2)


@triton.jit
def no_block(TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The value :func:`tile_blocks` starts its loop from (a block id per position, or one
    id for the whole tile when a block holds whole tiles)."""
    if BLOCK_SIZE % TILE_N == 0:
        return tl.full([], 0, tl.int64)
    else:
        return tl.zeros([TILE_N], tl.int64)


@triton.jit
def tile_blocks(block, block_table, stride_btb, tile_start, start, end,
                TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Physical block (int64) of the positions ``tile_start + arange(TILE_N)``.

    Reads each block-table entry once per block, never once per token:

    * a block holds whole tiles (``BLOCK_SIZE % TILE_N == 0``): the entry is read at the
      block's first tile (or the loop's first, ``start``) and ``block``, the previous
      tile's id, is kept otherwise; the result is one id for the whole tile;
    * a tile holds whole blocks (``TILE_N % BLOCK_SIZE == 0``): its ``TILE_N // BLOCK_SIZE``
      entries in one load, each repeated over its block's positions;
    * otherwise (a block size like 12): the few entries the tile touches, each position
      picking its own; a block that straddles two tiles is read by both.

    Entries of blocks at or past ``end`` are never read (the table's padding).
    """
    if BLOCK_SIZE % TILE_N == 0:
        if (tile_start % BLOCK_SIZE == 0) | (tile_start == start):
            block = tl.load(block_table + (tile_start // BLOCK_SIZE) * stride_btb)
            block = block.to(tl.int64)
    elif TILE_N % BLOCK_SIZE == 0:
        NB: tl.constexpr = TILE_N // BLOCK_SIZE
        j = tile_start // BLOCK_SIZE + tl.arange(0, NB)
        ids = tl.load(block_table + j * stride_btb, mask=j * BLOCK_SIZE < end, other=0)
        ids = ids.to(tl.int64)
        block = tl.reshape(tl.broadcast_to(ids[:, None], (NB, BLOCK_SIZE)), (TILE_N,))
    else:
        NB: tl.constexpr = blocks_per_tile(TILE_N, BLOCK_SIZE)
        first = tile_start // BLOCK_SIZE
        last = (tile_start + TILE_N - 1) // BLOCK_SIZE
        k = tl.arange(0, NB)
        j = first + k
        ids = tl.load(block_table + j * stride_btb, mask=(j <= last) & (j * BLOCK_SIZE < end),
                      other=0).to(tl.int64)
        local = (tile_start + tl.arange(0, TILE_N)) // BLOCK_SIZE - first
        block = tl.sum(tl.where(local[:, None] == k[None, :], ids[None, :], 0), 1)
    return block


@triton.jit
def dequantize_tile(x, scale_ptr, block, pos, kv_head, stride_sb, stride_sh, valid,
                    KV_QUANT: tl.constexpr):
    """A loaded ``[TILE_N, HEAD_PAD]`` tile of 8-bit K or V as fp32.

    ``KV_QUANT == 1``: int8 times its (block, KV head) scale, one scale read per token
    (``block`` may be one id for the tile or one per token); ``2``: fp8 E4M3 read as
    ``uint8`` bits (the interpreter cannot load fp8 pointers), bitcast, converted, times the
    per-tensor scale. Tokens past the end (``valid`` false) are 0: their scale may be a
    never-written block's NaN.
    """
    if KV_QUANT == 1:
        rows = block + tl.zeros_like(pos).to(tl.int64)  # one block id per token
        s = tl.load(scale_ptr + rows * stride_sb + kv_head * stride_sh)
        x = x.to(tl.float32) * s[:, None]
    else:
        x = x.to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.load(scale_ptr)
    return tl.where(valid[:, None], x, 0.0)


@triton.jit
def attend_tile(
    q, m_i, l_i, acc, pos, end, row_pos,
    block, k_cache_ptr, v_cache_ptr, kv_head, d,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    scale_log2, k_scale_ptr, v_scale_ptr, stride_sb, stride_sh,
    HEAD_DIM: tl.constexpr, ALIGN: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr, USE_DOT: tl.constexpr = True,
):
    """Fold the tile of logical positions ``pos [TILE_N]`` into ``(m_i, l_i, acc)``.

    ``q [ROWS, HEAD_PAD]`` is the program's query tile, ``d`` the ``tl.arange`` over the padded head
    size, ``block`` the tile's physical block ids from :func:`tile_blocks` (int64). Returns
    the new ``(m_i, l_i, acc)``. ``USE_DOT=False`` (fewer than 16 query rows, e.g. MHA's
    one head per KV head in decode) computes ``q @ k^T`` and ``p @ v`` as products summed
    on CUDA cores, in fp32: ``tl.dot`` needs at least 16 rows and would waste the rest.
    ``KV_QUANT`` (:data:`paged_lib.kernels.kv_quant.KV_QUANT_CODES`; 0: plain caches, the scale
    arguments unused)
    dequantises K and V in fp32 right after the load (:func:`dequantize_tile`).
    """
    valid = pos < end
    offset = pos % BLOCK_SIZE
    # Row starts are ALIGN-element aligned (head sizes like 40 or 72): the compiler may
    # then load each row with vector instructions despite the d < HEAD_DIM mask.
    k_rows = tl.multiple_of(block * stride_kb + offset * stride_kt + kv_head * stride_kh, ALIGN)
    v_rows = tl.multiple_of(block * stride_vb + offset * stride_vt + kv_head * stride_vh, ALIGN)
    kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if KV_QUANT != 0:
        k = dequantize_tile(k, k_scale_ptr, block, pos, kv_head, stride_sb, stride_sh, valid,
                            KV_QUANT)
        v = dequantize_tile(v, v_scale_ptr, block, pos, kv_head, stride_sb, stride_sh, valid,
                            KV_QUANT)
        q = q.to(tl.float32)

    if USE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [ROWS, TILE_N]
    else:
        s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], 2)
    s = s * scale_log2
    if CAUSAL:  # every row sees position 0, so its running max is finite from tile 0
        s = tl.where(valid[None, :] & (pos[None, :] <= row_pos[:, None]), s, float("-inf"))
    else:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)  # rescales what was summed so far
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if USE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc
