"""Paged attention kernels: the public API the chapters, the engine and the graders call.

Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` (K and V separate), or
(chapter 11) :class:`paged_lib.kernels.kv_quant.QuantizedKV` pairs: 8-bit data of that shape with
its scales, written quantised and dequantised on load by both backends.

* :func:`paged_attention` - decode: one new query token per sequence;
* :func:`paged_prefill` - several new query tokens per sequence, causal, packed varlen;
* :func:`reshape_and_cache` - the write path: new tokens' K/V into their slots, which
  :func:`slot_mapping_from_positions` computes from the block tables.

Each takes ``backend="triton"`` (the kernels in this package; Triton's interpreter on
a CPU), ``backend="torch"`` (plain PyTorch) or ``backend="cpu"`` (decode by a small C
kernel compiled at first use, :mod:`~paged_lib.kernels.cpu_decode`; prefill and the cache
write are the torch backend's). Inputs are validated *before* any launch
and a mistake raises ``ValueError`` saying what is wrong: a kernel handed a bad block
table reads someone else's memory silently, an error message does not.

Validation reads lengths and block ids back from the GPU (a device-to-host copy that
waits for the GPU). A caller that validates once per step (the engine, which calls these
every layer of every step) passes ``validate=False``: shapes, dtypes and devices are
still checked, nothing is read back, and the Triton path launches without a sync.

Where things live: ``reference.py`` (float64 definitions, outside baselines),
``torch_backend.py`` (every operation in PyTorch), ``triton_*.py`` (one kernel each),
``cpu_decode.py`` with ``csrc/paged_decode.c`` (the C decode kernel and its build),
``cases.py`` (the test batches everyone uses).
"""

from __future__ import annotations

import torch

from paged_lib.device import interpreter_on
from paged_lib.kernels.backends import BACKENDS
from paged_lib.kernels.backends import check_backend as _check_backend
from paged_lib.kernels.kv_quant import dequantize_used_blocks, is_quantized, write_quantized
from paged_lib.kernels.triton_split import choose_num_splits
from paged_lib.util import cdiv

__all__ = ["BACKENDS", "choose_num_splits", "paged_attention", "paged_prefill",
           "reshape_and_cache", "slot_mapping_from_positions"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float | None = None, *, backend: str = "triton",
                    num_splits: int | None = None, validate: bool = True,
                    max_seq_len: int | None = None) -> torch.Tensor:
    """Decode attention through block tables.

    q ``[num_seqs, num_heads, head_dim]``; ``block_tables`` int32 ``[num_seqs, max_blocks]``;
    ``seq_lens`` int32 ``[num_seqs]``; returns ``[num_seqs, num_heads, head_dim]``.
    ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA: query head ``h`` reads KV
    head ``h // (num_heads // num_kv_heads)``). ``scale`` defaults to ``head_dim ** -0.5``.
    A sequence of length 0 (a padding row) gets zeros.

    ``num_splits`` (triton only; the torch backend ignores it) forces split-KV
    (flash-decoding) with that many segments per sequence; ``None`` lets
    :func:`choose_num_splits` decide (it never splits in the interpreter).
    ``validate=False`` skips the checks that read values back from the GPU;
    ``max_seq_len`` (the longest length, if the caller knows it) then chooses splits
    (without it a launch on a GPU whose table is wide enough to split reads
    ``seq_lens.max()`` back once).
    """
    _check_backend(backend)
    k_cache, v_cache, quant = _unwrap_quantized(k_cache, v_cache)
    _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, num_query_dims=3,
                            quantized=quant is not None)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if validate:
        max_seq_len = _check_seq_lens(seq_lens, block_tables, k_cache.shape[0],
                                      k_cache.shape[1])
    scale = _scale(scale, q.shape[-1])
    if quant is not None and backend != "triton":  # dequantise the blocks read, then attend
        k_cache, v_cache, block_tables = dequantize_used_blocks(*quant, block_tables, seq_lens)
    if backend == "cpu":
        from paged_lib.kernels.cpu_decode import paged_attention_cpu

        return paged_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale)
    if backend == "torch":
        try:
            from paged_lib.kernels.torch_backend import paged_attention_torch
        except ImportError as err:  # pragma: no cover - only while chapter 04 is written
            raise ImportError("backend='torch' needs paged_lib/kernels/torch_backend.py "
                              f"(chapter 04), which could not be imported: {err}") from err
        return paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, scale)
    _check_triton_device(q.device)
    from paged_lib.kernels.triton_decode import paged_attention_triton

    return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                  num_splits=num_splits, max_seq_len=max_seq_len,
                                  kv_quant=quant)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, query_lens: torch.Tensor,
                  scale: float | None = None, *, backend: str = "triton",
                  validate: bool = True, max_query_len: int | None = None) -> torch.Tensor:
    """Causal attention of new tokens over their cached context plus themselves.

    q ``[total_query_tokens, num_heads, head_dim]`` holds the new tokens of all
    sequences back to back (sequence ``s`` owns ``query_lens[s]`` rows, in order);
    ``query_lens`` and ``seq_lens`` int32 ``[num_seqs]``, ``seq_lens`` *including* the new
    tokens, whose K/V must already be in the cache (:func:`reshape_and_cache`). New token
    ``i`` of sequence ``s`` sits at position ``seq_lens[s] - query_lens[s] + i`` and
    attends to every position up to and including its own. Returns q's shape.
    ``validate=False`` skips the checks that read values back from the GPU;
    ``max_query_len`` (if the caller knows it) then sizes the grid.
    """
    _check_backend(backend)
    k_cache, v_cache, quant = _unwrap_quantized(k_cache, v_cache)
    _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, num_query_dims=3,
                            packed=True, quantized=quant is not None)
    _check_index_tensor(query_lens, "query_lens", 1, q.device)
    if query_lens.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"query_lens has {query_lens.shape[0]} entries but seq_lens has "
                         f"{seq_lens.shape[0]}: one per sequence in both")
    if validate:
        max_query_len = _check_query_lens(q, seq_lens, query_lens, block_tables,
                                          k_cache.shape[0], k_cache.shape[1])
    scale = _scale(scale, q.shape[-1])
    if quant is not None and backend != "triton":
        k_cache, v_cache, block_tables = dequantize_used_blocks(*quant, block_tables, seq_lens)
    if backend == "cpu":  # each new token a decode row of the C kernel
        from paged_lib.kernels.cpu_decode import paged_prefill_cpu

        return paged_prefill_cpu(q, k_cache, v_cache, block_tables, seq_lens, query_lens,
                                 scale)
    if backend == "torch":
        from paged_lib.kernels.torch_backend import paged_prefill_torch

        return paged_prefill_torch(q, k_cache, v_cache, block_tables, seq_lens, query_lens,
                                   scale)
    _check_triton_device(q.device)
    from paged_lib.kernels.triton_prefill import paged_prefill_triton

    return paged_prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, query_lens, scale,
                                max_query_len=max_query_len, kv_quant=quant)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                      backend: str = "triton", validate: bool = True) -> None:
    """Write new tokens' K/V into the paged cache, in place.

    key, value ``[num_tokens, num_kv_heads, head_dim]``; ``slot_mapping`` int64 (or int32)
    ``[num_tokens]`` with ``slot = block * block_size + offset``, or ``-1`` to skip a token.
    ``validate=False`` skips the slot range check (a read-back from the GPU).
    """
    _check_backend(backend)
    qk, qv = k_cache, v_cache
    k_cache, v_cache, quant = _unwrap_quantized(k_cache, v_cache)
    _check_caches(k_cache, v_cache, quantized=quant is not None)
    for name, t in (("key", key), ("value", value)):
        if t.ndim != 3:
            raise ValueError(f"{name} must be [num_tokens, num_kv_heads, head_dim], got shape "
                             f"{tuple(t.shape)}")
        if tuple(t.shape[1:]) != tuple(k_cache.shape[2:]):
            raise ValueError(f"{name} has [num_kv_heads, head_dim] = {tuple(t.shape[1:])} but "
                             f"the cache holds {tuple(k_cache.shape[2:])}")
        if quant is None and t.dtype != k_cache.dtype:
            raise ValueError(f"{name} is {t.dtype} but the cache is {k_cache.dtype}")
        if quant is not None and t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens, value {value.shape[0]}")
    if slot_mapping.ndim != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be 1-D with one slot per token ({key.shape[0]}), "
                         f"got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 or int32, got {slot_mapping.dtype}")
    _check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache,
                       slot_mapping=slot_mapping)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if validate and slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            bad = lo if lo < -1 else hi
            raise ValueError(f"slot {bad} is outside the cache: slots run from 0 to "
                             f"{num_slots - 1} ({k_cache.shape[0]} blocks x {k_cache.shape[1]}),"
                             " and -1 means skip")
    if quant is not None:  # quantised caches: the same PyTorch write for both backends
        write_quantized(key, qk, slot_mapping)
        write_quantized(value, qv, slot_mapping)
        return None
    if backend != "triton":  # "cpu" writes with the torch backend
        from paged_lib.kernels.torch_backend import reshape_and_cache_torch

        return reshape_and_cache_torch(key, value, k_cache, v_cache, slot_mapping)
    _check_triton_device(key.device)
    from paged_lib.kernels.triton_cache import reshape_and_cache_triton

    return reshape_and_cache_triton(key, value, k_cache, v_cache, slot_mapping)


def slot_mapping_from_positions(block_tables: torch.Tensor, seq_ids: torch.Tensor,
                                positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """``slot_mapping`` (int64) for tokens at ``positions`` of sequences ``seq_ids``:
    ``block_tables[seq, pos // block_size] * block_size + pos % block_size``.

    A negative position marks a padding token and maps to slot ``-1``.
    """
    seq_ids = seq_ids.long()
    positions = positions.long()
    keep = positions >= 0
    pos = positions.clamp(min=0)
    blocks = block_tables.long()[seq_ids, pos // block_size]
    slots = blocks * block_size + pos % block_size
    return torch.where(keep, slots, torch.full_like(slots, -1))


# ---------------------------------------------------------------- validation helpers


def _scale(scale: float | None, head_dim: int) -> float:
    return head_dim ** -0.5 if scale is None else float(scale)


def _check_triton_device(device: torch.device) -> None:
    """Compiled Triton kernels read GPU memory only; in the interpreter they read CPU tensors.
    A CPU tensor handed to a compiled kernel would fail deep inside Triton's launcher
    ("Pointer argument cannot be accessed"), so say here what to do instead."""
    if device.type == "cpu" and not interpreter_on():
        raise ValueError("backend='triton' runs compiled on the GPU here, but the tensors are "
                         "on the CPU: move them to 'cuda' (paged_lib.default_device()), or use "
                         "backend='torch' or backend='cpu' for CPU tensors")


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def _check_index_tensor(t: torch.Tensor, name: str, ndim: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32 (like vLLM's), got {t.dtype}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def _unwrap_quantized(k_cache, v_cache):
    """``(k_data, v_data, (k_cache, v_cache))`` for quantised caches
    (:class:`paged_lib.kernels.kv_quant.QuantizedKV`, chapter 11), else ``(k, v, None)``."""
    if not (is_quantized(k_cache) or is_quantized(v_cache)):
        return k_cache, v_cache, None
    if not (is_quantized(k_cache) and is_quantized(v_cache)) or k_cache.kind != v_cache.kind:
        raise ValueError("k_cache and v_cache must both be quantised in the same format, got "
                         f"{type(k_cache).__name__} and {type(v_cache).__name__}")
    return k_cache.data, v_cache.data, (k_cache, v_cache)


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, quantized: bool = False) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim], "
                             f"got {shape}")
        if not quantized and t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "must have the same shape")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")


def _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, num_query_dims: int,
                            packed: bool = False, quantized: bool = False) -> None:
    if not isinstance(q, torch.Tensor) or q.ndim != num_query_dims:
        layout = "total_query_tokens" if packed else "num_seqs"
        shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be [{layout}, num_heads, head_dim], got {shape}")
    _check_caches(k_cache, v_cache, quantized)
    _check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                       seq_lens=seq_lens)
    if quantized and q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if not quantized and q.dtype != k_cache.dtype:
        raise ValueError(f"q is {q.dtype} but the caches are {k_cache.dtype}: use one dtype")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"q has head_dim {head_dim} but the caches have {k_cache.shape[3]}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads}): each KV head serves a whole group of query heads")
    _check_index_tensor(block_tables, "block_tables", 2, q.device)
    _check_index_tensor(seq_lens, "seq_lens", 1, q.device)
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but seq_lens has "
                         f"{seq_lens.shape[0]} entries: one per sequence in both")
    if not packed and q.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"q has {q.shape[0]} sequences but seq_lens has {seq_lens.shape[0]}")


def _check_seq_lens(seq_lens: torch.Tensor, block_tables: torch.Tensor, num_blocks: int,
                    block_size: int) -> int:
    """Every length in 0..capacity, every block the kernel will read inside the cache.

    Returns the longest length (it helps choose the split count). Length 0 is a padding
    row (CUDA-graph batches have them): it reads nothing and gets zeros.
    """
    if seq_lens.numel() == 0:
        return 0
    lens = seq_lens.cpu().long()
    capacity = block_tables.shape[1] * block_size
    if bool((lens < 0).any()):
        s = int((lens < 0).nonzero()[0])
        raise ValueError(f"sequence {s} has seq_len {int(lens[s])}: lengths are >= 0")
    if bool((lens > capacity).any()):
        s = int((lens > capacity).nonzero()[0])
        raise ValueError(f"sequence {s} has seq_len {int(lens[s])} but its block table holds "
                         f"only {block_tables.shape[1]} blocks x {block_size} = {capacity} tokens")
    num_used = cdiv(lens, block_size)  # blocks the kernel will read
    used = torch.arange(block_tables.shape[1])[None, :] < num_used[:, None]
    table = block_tables.cpu()
    bad = used & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        s, b = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"sequence {s}, logical block {b}: physical block {int(table[s, b])} "
                         f"is outside the cache (0..{num_blocks - 1})")
    return int(lens.max())


def _check_query_lens(q: torch.Tensor, seq_lens: torch.Tensor, query_lens: torch.Tensor,
                      block_tables: torch.Tensor, num_blocks: int, block_size: int) -> int:
    """Prefill's lengths: 1 <= query_len <= seq_len, summing to q's rows. Returns the
    longest query_len (it sizes the grid)."""
    _check_seq_lens(seq_lens, block_tables, num_blocks, block_size)
    ql, sl = query_lens.cpu(), seq_lens.cpu()
    if bool((ql < 1).any()):
        raise ValueError(f"every query_len must be >= 1, got {ql.tolist()}")
    if bool((ql > sl).any()):
        s = int((ql > sl).nonzero()[0])
        raise ValueError(f"sequence {s}: query_len {int(ql[s])} > seq_len {int(sl[s])} "
                         "(seq_len counts the context *and* the new tokens)")
    if int(ql.sum()) != q.shape[0]:
        raise ValueError(f"q holds {q.shape[0]} tokens but query_lens sum to {int(ql.sum())}")
    return int(ql.max()) if len(ql) else 0
