"""The paged decode kernel in Triton: one query token per sequence, K/V read through a block table.

One program per (sequence, KV head, head chunk[, KV segment]). The program loads the
query rows of the query heads that share its KV head (GQA: a ``[GROUP_TILE, HEAD_PAD]``
tile of 16 rows, the smallest ``tl.dot`` takes; a larger group, like MQA's 64:1, is
spread over several head chunks on the grid's second axis), so each K/V tile is read
once per 16 query heads, as vLLM does. MHA (one query head per KV head) gets a tile of
one row and no ``tl.dot`` (:func:`group_tile`).

It then walks the sequence's tokens ``TILE_N`` at a time: each token's physical address
is ``block_tables[seq, pos // BLOCK_SIZE] * stride + pos % BLOCK_SIZE``, with each
block-table entry read once per block (not per token) and cast to int64 first, so a
cache of more than 2**31 elements cannot overflow 32-bit offsets; tokens past the end
are masked (never loaded), and an online softmax in fp32 folds the tile into running
max ``m``, denominator ``l`` and accumulator ``acc``: one call of
:func:`~paged_lib.kernels.triton_tile.attend_tile` per tile, the loop body the prefill
kernel shares.

Call it through :func:`paged_lib.kernels.paged_attention`, which validates its inputs;
:func:`paged_attention_triton` here only launches. Given ``max_seq_len`` (the engine
knows it on the host) nothing in it reads a value back from the GPU: the engine calls
it every layer of every step.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paged_lib.device import interpreter_on
from paged_lib.kernels.kv_quant import quant_args
from paged_lib.kernels.triton_split import choose_num_splits, merge_splits
from paged_lib.kernels.triton_tile import LN2, LOG2E, attend_tile, no_block, tile_blocks
from paged_lib.util import cdiv

#: Shared memory one thread block may use (the opt-in maximum, bytes) by compute
#: capability, from the CUDA C++ Programming Guide's table of compute capabilities: K and
#: V tiles times pipeline stages must fit, or the kernel does not compile on that GPU (the
#: interpreter never checks). Used where there is no device to ask (ahead-of-time compiles,
#: the interpreter); on a GPU :func:`smem_limit` asks the device.
SMEM_PER_BLOCK = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024,
                  90: 227 * 1024}
#: The course's GPU (H100/H200, sm_90): the limit when no device and no arch is given.
DEFAULT_ARCH = 90
SMEM_BUDGET = SMEM_PER_BLOCK[DEFAULT_ARCH]
#: Query-head rows per program: 16 is the smallest M of ``tl.dot`` on NVIDIA, and more
#: rows would only spill registers for MQA's 64 heads.
MAX_GROUP_TILE = 16
#: Groups of at most this many query heads skip ``tl.dot``: their rows, padded to a power
#: of two, are multiplied and summed on CUDA cores, so MHA computes no 16-row tile with 15
#: rows of padding. Only MHA's 1: compiled (tools/aot_compile.py, head size 128, fp16) one
#: row takes 79 registers on sm_90 and 76 on sm_80 (the 16-row ``tl.dot``: 74 and 64) and
#: 4 KB of shared memory instead of 21, while 2 rows take 128 registers and 4 rows 255.
SMALL_GROUP = 1


@triton.jit
def _paged_decode_kernel(
    out_ptr, lse_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    scale_log2,  # softmax scale * log2(e): the kernel works with exp2
    num_splits,  # KV segments per sequence: a runtime value, no recompile per count
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_os, stride_oh, stride_osplit, stride_od,
    stride_ls, stride_lh,
    k_scale_ptr, v_scale_ptr, stride_sb, stride_sh,  # quantised caches (chapter 11)
    GROUP: tl.constexpr, GROUP_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    IS_SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr = 0,
):
    seq = tl.program_id(0).to(tl.int64)
    chunks: tl.constexpr = (GROUP + GROUP_TILE - 1) // GROUP_TILE
    kv_head = tl.program_id(1) // chunks
    chunk = tl.program_id(1) % chunks
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if IS_SPLIT:  # this sequence's segment: cdiv(seq_len, num_splits) in whole tiles
        per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_N) * TILE_N
        start = split * per_split
        end = tl.minimum(seq_len, start + per_split)
    else:
        start = 0
        end = seq_len

    # The query rows of this chunk of the KV head's group: [GROUP_TILE, HEAD_PAD].
    g = chunk * GROUP_TILE + tl.arange(0, GROUP_TILE)
    d = tl.arange(0, HEAD_PAD)
    heads = kv_head * GROUP + g
    row_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_TILE], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([GROUP_TILE], tl.float32)  # running softmax denominator
    acc = tl.zeros([GROUP_TILE, HEAD_PAD], tl.float32)  # running sum of p * v

    t = tl.arange(0, TILE_N)
    block_table = block_tables_ptr + seq * stride_bts
    block = no_block(TILE_N, BLOCK_SIZE)
    for tile_start in range(start, end, TILE_N):
        block = tile_blocks(block, block_table, stride_btb, tile_start, start, end,
                            TILE_N, BLOCK_SIZE)
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, tile_start + t, end, end, block,
            k_cache_ptr, v_cache_ptr, kv_head, d,
            stride_kb, stride_kt, stride_kh, stride_kd,
            stride_vb, stride_vt, stride_vh, stride_vd, scale_log2,
            k_scale_ptr, v_scale_ptr, stride_sb, stride_sh,
            HEAD_DIM, ALIGN, BLOCK_SIZE, False, UPCAST, DOT_PRECISION, KV_QUANT,
            GROUP_TILE >= 16)

    # No token (seq_len 0, or a segment past the end): l = 0, output 0, lse -inf.
    empty = l_i == 0.0
    result = acc / tl.where(empty, 1.0, l_i)[:, None]
    out_ptrs = (out_ptr + seq * stride_os + heads[:, None] * stride_oh + split * stride_osplit
                + d[None, :] * stride_od)
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_mask)
    if IS_SPLIT:
        # Natural log at the interface (merge_splits, merge_partials): ln x = log2 x * ln 2.
        lse = tl.where(empty, float("-inf"),
                       (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
        tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=g < GROUP)


# ------------------------------------------------------------------ launch configuration


def group_tile(group: int) -> int:
    """Query-head rows per decode program: the group padded to a power of two when it is
    small (:data:`SMALL_GROUP`, no ``tl.dot``), else :data:`MAX_GROUP_TILE` (``tl.dot``;
    a larger group is spread over ``cdiv(group, 16)`` head chunks)."""
    small = triton.next_power_of_2(group)
    return small if small <= SMALL_GROUP else MAX_GROUP_TILE


def head_pad(head_dim: int) -> int:
    """Head size padded to a power of two (``tl.arange`` needs one), at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


def kv_smem_bytes(tile_n: int, head_dim: int, dtype: torch.dtype, num_stages: int) -> int:
    """Shared memory a config needs for its K and V tiles over its pipeline stages."""
    return 2 * tile_n * head_pad(head_dim) * dtype.itemsize * num_stages


def smem_limit(device: torch.device | None = None, arch: int | None = None) -> int:
    """Shared memory per thread block (bytes, opt-in maximum) that configs must fit.

    A CUDA device compiling natively is asked (``torch.cuda.get_device_properties``);
    otherwise :data:`SMEM_PER_BLOCK` of ``arch`` (e.g. 80 for A100), by default sm_90.
    """
    if device is not None and device.type == "cuda" and not interpreter_on():
        props = torch.cuda.get_device_properties(device)
        limit = getattr(props, "shared_memory_per_block_optin", 0)
        if limit:
            return int(limit)
        arch = props.major * 10 + props.minor
    arch = DEFAULT_ARCH if arch is None else arch
    if arch not in SMEM_PER_BLOCK:
        raise ValueError(f"no shared-memory limit known for sm_{arch}: known are "
                         f"{sorted(SMEM_PER_BLOCK)}")
    return SMEM_PER_BLOCK[arch]


def check_config(tile_n: int, num_stages: int, head_dim: int, dtype: torch.dtype,
                 smem: int = SMEM_BUDGET) -> None:
    """Refuse a tile the GPU cannot run, with the reason (the interpreter would accept it).

    ``smem``: the GPU's shared memory per block (:func:`smem_limit`)."""
    if not isinstance(tile_n, int) or tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n!r}: tl.dot needs "
                         "a K dimension of at least 16 on NVIDIA GPUs")
    need = kv_smem_bytes(tile_n, head_dim, dtype, num_stages)
    if need > smem:
        raise ValueError(
            f"tile_n={tile_n} x head_dim {head_dim} ({dtype}) x {num_stages} stages needs "
            f"{need // 1024} KB of shared memory for K and V; a GPU block has "
            f"{smem // 1024} KB: use a smaller tile_n or fewer num_stages")


def launch_config(head_dim: int, dtype: torch.dtype, smem: int = SMEM_BUDGET) -> dict:
    """Tile size, warps and stages per head size and dtype, chosen by hand (used in the
    interpreter, and on a GPU when autotuning is off); ``smem`` is the GPU's shared
    memory per block (:func:`smem_limit`).

    Checked by compiling for sm_80 and sm_90 (``tools/aot_compile.py``: registers, spills,
    shared memory): every config here compiles without spills, 16-bit and fp32. fp32
    gets 8 warps from head size 128 (fp32 32-token tiles of head size 256 with 4 warps
    spilled 9 KB on sm_90) and 2 stages; at head size 256 its tiles are 16 tokens (32
    spilled 4 bytes on sm_80). Stages drop further where K and V would not fit in ``smem``.
    """
    pad = head_pad(head_dim)
    wide = dtype.itemsize >= 4
    tile_n = 64 if pad <= 64 else 16 if wide and pad >= 256 else 32
    warps = 8 if pad > 128 or (wide and pad >= 128) else 4
    stages = 2 if wide else 3
    while stages > 1 and kv_smem_bytes(tile_n, head_dim, dtype, stages) > smem:
        stages -= 1
    return {"TILE_N": tile_n, "num_warps": warps, "num_stages": stages}


#: (TILE_N, num_warps, num_stages) tried by the GPU autotuner: a few, not a search space.
#: At head size 128 in fp16 all compile for sm_80 and sm_90 without spills
#: (tools/aot_compile.py).
GPU_CONFIGS = [(16, 4, 3), (32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3),
               (128, 8, 2)]


def gpu_configs(head_dim: int, dtype: torch.dtype, smem: int = SMEM_BUDGET
                ) -> list[tuple[int, int, int]]:
    """:data:`GPU_CONFIGS` that fit in ``smem`` bytes of shared memory for this head size
    and dtype."""
    return [c for c in GPU_CONFIGS if kv_smem_bytes(c[0], head_dim, dtype, c[2]) <= smem]


def make_autotuned_decode_kernel(head_dim: int = 128, dtype: torch.dtype = torch.float16,
                                 do_bench=None, smem: int = SMEM_BUDGET):
    """The decode kernel wrapped in ``triton.autotune`` over :func:`gpu_configs`.

    Keyed by the compile-time shape (group, head size, block size, split or not; Triton
    adds the tensors' dtypes), never by the batch, the lengths or the split count, so a
    new batch shape reuses the tuned config. Opt-in (:func:`use_autotune`); in the
    interpreter autotuning more than one config fails (tests pass a stand-in
    ``do_bench`` to exercise the plumbing).
    """
    configs = [triton.Config({"TILE_N": t}, num_warps=w, num_stages=s)
               for t, w, s in gpu_configs(head_dim, dtype, smem)]
    return triton.autotune(configs=configs, key=["GROUP", "HEAD_DIM", "BLOCK_SIZE", "IS_SPLIT"],
                           do_bench=do_bench)(_paged_decode_kernel)


#: Autotuned kernels by (head_pad, dtype, smem): each has its own pruned config list.
_autotuned: dict[tuple[int, torch.dtype, int], object] = {}


def use_autotune(device: torch.device) -> bool:
    """Autotune only when asked (``PAGED_LIB_AUTOTUNE=1``) on a GPU that compiles natively:
    a tuning run in the middle of serving, or of a test, stalls it for seconds."""
    return (device.type == "cuda" and not interpreter_on()
            and os.environ.get("PAGED_LIB_AUTOTUNE", "0") == "1")


def num_sms(device: torch.device) -> int | None:
    """SM count of a GPU that compiles kernels natively; None in the interpreter."""
    if device.type != "cuda" or interpreter_on():
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def alignment(*strides: int) -> int:
    """The largest power of two (at most 16) dividing every stride, in elements."""
    align = 16
    while align > 1 and any(s % align for s in strides):
        align //= 2
    return align


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Launch on the tensors' own GPU: Triton launches on the *current* device."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class LaunchInfo:
    """What one decode launch ran: the benchmark reports it, tests check it.

    ``num_splits``: KV segments per sequence (1: no split-KV); ``head_chunks``: programs
    per KV head on the grid's second axis (GQA groups over 16 heads); ``autotuned``:
    whether ``triton.autotune`` chose the config; ``config``: the tile config, as text.
    """

    num_splits: int
    head_chunks: int
    autotuned: bool
    config: str


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, tile_n: int | None = None,
                           max_seq_len: int | None = None, autotune: bool | None = None,
                           num_stages: int | None = None, return_launch: bool = False,
                           kv_quant: tuple | None = None
                           ) -> torch.Tensor | tuple[torch.Tensor, LaunchInfo]:
    """Launch the decode kernel on already validated inputs (see ``paged_attention``).

    ``num_splits=None`` picks the split-KV segment count with
    :func:`~paged_lib.kernels.triton_split.choose_num_splits` from ``max_seq_len``;
    without it, from the block tables' capacity when that already says "no split" (no
    read-back), else from ``seq_lens.max()`` (one read-back from the GPU); ``tile_n``
    and ``num_stages`` fix the tile (tests use it to put tiles across block boundaries;
    :func:`check_config` refuses what a GPU cannot run); ``autotune=None`` autotunes
    where :func:`use_autotune` says so. ``return_launch=True`` returns
    ``(out, LaunchInfo)``: what was launched, for benchmarks and tests. ``kv_quant``:
    the ``(k, v)`` :class:`~paged_lib.kernels.kv_quant.QuantizedKV` whose data ``k_cache`` and
    ``v_cache`` are (chapter 11; :func:`~paged_lib.kernels.kv_quant.quant_args`).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    rows = group_tile(group)
    chunks = cdiv(group, rows)
    out = torch.empty_like(q)
    if num_seqs == 0:
        info = LaunchInfo(num_splits=1, head_chunks=chunks, autotuned=False,
                          config="nothing launched")
        return (out, info) if return_launch else out
    interp = interpreter_on()
    smem = smem_limit(q.device)
    cfg = launch_config(head_dim, q.dtype, smem)
    if tile_n is not None or num_stages is not None:
        cfg["TILE_N"] = cfg["TILE_N"] if tile_n is None else tile_n
        cfg["num_stages"] = cfg["num_stages"] if num_stages is None else num_stages
        check_config(cfg["TILE_N"], cfg["num_stages"], head_dim, k_cache.dtype, smem)
        autotune = False
    if autotune is None:
        autotune = use_autotune(q.device)
    if num_splits is None:
        sms = num_sms(q.device)
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_seqs, num_kv_heads, bound, sms, chunks)
        if num_splits > 1 and max_seq_len is None:
            # The table's width only bounds the lengths: short sequences in a wide table
            # would be split for nothing. Read the longest length back, once.
            num_splits = choose_num_splits(num_seqs, num_kv_heads, int(seq_lens.max()), sms,
                                           chunks)
    consts = dict(
        GROUP=group, GROUP_TILE=rows, HEAD_DIM=head_dim,
        HEAD_PAD=head_pad(head_dim),
        ALIGN=alignment(*k_cache.stride()[:3], *v_cache.stride()[:3]),
        BLOCK_SIZE=block_size, IS_SPLIT=num_splits > 1,
        # The interpreter has no bf16 arithmetic: upcast after load there.
        UPCAST=interp and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    k_cache, v_cache, scale_args, consts["KV_QUANT"] = quant_args(k_cache, v_cache, kv_quant)
    if autotune:
        key = (consts["HEAD_PAD"], q.dtype, smem)
        if key not in _autotuned:
            _autotuned[key] = make_autotuned_decode_kernel(head_dim, q.dtype, smem=smem)
        kernel = _autotuned[key]
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
    with on_device(q.device):
        kernel[(num_seqs, num_kv_heads * chunks, num_splits)](
            target, lse, q, k_cache, v_cache, block_tables, seq_lens,
            scale * LOG2E.value, num_splits,
            q.stride(0), q.stride(1), q.stride(2),
            *k_cache.stride(), *v_cache.stride(),
            block_tables.stride(0), block_tables.stride(1),
            *target.stride(), lse.stride(0), lse.stride(1), *scale_args,
            **consts,
        )
        if num_splits > 1:
            merge_splits(target, lse, out)
    if not return_launch:
        return out
    chosen = getattr(kernel, "best_config", None)
    config = (str(chosen) if chosen is not None else
              f"TILE_N={cfg['TILE_N']}, num_warps={cfg['num_warps']}, "
              f"num_stages={cfg['num_stages']}")
    return out, LaunchInfo(num_splits=num_splits, head_chunks=chunks, autotuned=autotune,
                           config=config)
