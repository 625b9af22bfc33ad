"""Quantised KV blocks (chapter 11): int8 with a scale per (block, KV head), fp8 E4M3 per tensor.

A paged cache can hold its K and V in 8 bits instead of 16 or 32: each token then takes
a half (or a quarter) of the bytes, and the pool holds twice (four times) the tokens.
``LLMEngine(..., kv_cache_dtype=...)`` chooses the format (:data:`KV_CACHE_DTYPES`):

* ``"auto"`` - the model's dtype, nothing quantised (the default);
* ``"int8"`` - symmetric int8 with one fp32 scale per (physical block, KV head),
  ``scale = absmax / 127``. A block fills a token at a time, so a later token can be
  larger than every token before it. The rule here: **a scale only grows, and when it
  grows it at least doubles** (``new = max(absmax / 127, 2 * old)``); the values already
  in the block are requantised to the new scale. Nothing ever clips, and a value
  requantised ``k`` times has lost at most ``s_1/2 + ... + s_k/2 < s_k`` (each scale at
  least twice the one before), so every stored value is within one final step ``s`` of
  the truth, and ``s < 2 * absmax / 127`` of its (block, head); a block written whole (a
  prefill) keeps ``absmax / 127`` and half a step of error. A write at offset 0 starts a
  block afresh (a block freed and reallocated forgets its old scale), as does a first
  write into a block never written (its scale is still NaN);
* ``"fp8_e4m3"`` - ``torch.float8_e4m3fn`` (OCP E4M3, largest finite value 448:
  :func:`e4m3_max`) with one fp32 scale per tensor (per layer, for K and for V), as in
  vLLM's docs on quantized KV cache. The scale is set by the first write the layer sees,
  as vLLM's on-the-fly calibration (``calculate_kv_scales``) does: ``absmax / 200`` for
  K and ``absmax / 100`` for V (vLLM's ``K_SCALE_CONSTANT`` and ``V_SCALE_CONSTANT``),
  leaving 448/200 and 448/100 of headroom; a later value beyond ``448 * scale``
  saturates (clips to it) instead of becoming NaN.

Where it runs. The write (:func:`write_quantized`, which
:func:`paged_lib.kernels.reshape_and_cache` calls for both backends) is a handful of
PyTorch ops. The torch attention backend dequantises the blocks a call reads
(:func:`dequantize_used_blocks`); the Triton kernels dequantise each K/V tile in fp32
right after ``tl.load`` (``triton_tile.dequantize_tile``). Triton's interpreter cannot
load ``float8`` pointers (it fails casting the masked lanes' ``other``), so the kernels
read fp8 caches as ``uint8`` bits and bitcast them to ``tl.float8e4nv`` before the fp32
conversion; on a GPU that bitcast is free. Indexing (writes, copies, swaps) also goes
through the ``uint8`` view.

Poisoning: the int8 data holds no NaN, so its scales start as NaN (a block never written
reads as NaN); fp8 data starts as NaN (E4M3 has a NaN) and its scale is NaN until the
first write.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["FP8_RANGES", "INT8_MAX", "KV_CACHE_DTYPES", "KV_QUANT_CODES", "QuantizedKV",
           "allocate_quantized_kv_caches", "check_kv_cache_dtype", "copy_quantized_blocks",
           "copy_quantized_kv", "dequantize_blocks",
           "dequantize_cache", "dequantize_fp8", "dequantize_int8", "dequantize_used_blocks",
           "e4m3_max", "e4m3_value", "int8_scale", "is_quantized", "quant_args",
           "quantize_fp8", "quantize_int8", "use_int8_write", "write_int8_blocks",
           "write_quantized"]

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
INT8_MAX = 127
#: fp8 calibration: ``scale = absmax / FP8_RANGES[which]`` on the first write (vLLM's
#: ``K_SCALE_CONSTANT`` and ``V_SCALE_CONSTANT``).
FP8_RANGES = {"k": 200.0, "v": 100.0}
#: ``KV_QUANT`` of the Triton kernels (``triton_tile.dequantize_tile``) by format.
KV_QUANT_CODES = {"auto": 0, "int8": 1, "fp8_e4m3": 2}
_TINY = torch.finfo(torch.float32).tiny


# ---------------------------------------------------------------- the E4M3 format


def e4m3_value(bits: int, fnuz: bool = False) -> float:
    """The value of an 8-bit E4M3 pattern: 1 sign, 4 exponent, 3 mantissa bits.

    OCP E4M3 (``float8_e4m3fn``): exponent bias 7, no infinities, NaN only at
    ``S.1111.111``. FNUZ (``float8_e4m3fnuz``): bias 8, one NaN (``1.0000.000``, the
    pattern that would be -0), every other pattern finite. Exponent field 0: subnormal.
    """
    if not isinstance(bits, int) or not 0 <= bits < 256:
        raise ValueError(f"bits must be an int in 0..255, got {bits!r}")
    sign, exp, man = bits >> 7, (bits >> 3) & 0xF, bits & 0x7
    bias = 8 if fnuz else 7
    if fnuz and bits == 0x80:
        return float("nan")
    if not fnuz and exp == 0xF and man == 0x7:
        return float("nan")
    if exp == 0:
        value = man / 8 * 2.0 ** (1 - bias)
    else:
        value = (1 + man / 8) * 2.0 ** (exp - bias)
    return -value if sign else value


def e4m3_max(fnuz: bool = False) -> float:
    """E4M3's largest finite value, found by decoding all 256 patterns: 448 for OCP
    (``torch.float8_e4m3fn``: ``1.1111.110`` = 1.75 x 2^8) and 240 for FNUZ
    (``torch.float8_e4m3fnuz``: ``0.1111.111`` = 1.875 x 2^7)."""
    values = [e4m3_value(b, fnuz) for b in range(256)]
    return max(v for v in values if v == v)


# ---------------------------------------------------------------- elementwise formats


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                         f"got {kv_cache_dtype!r}")
    return kv_cache_dtype


def int8_scale(absmax: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 scale ``absmax / 127`` (fp32; never 0, so division is safe)."""
    return (absmax.float() / INT8_MAX).clamp(min=_TINY)


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``round(x / scale)`` clipped to -127..127, as int8 (``scale`` broadcasts)."""
    return (x.float() / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in fp32."""
    return q.float() * scale


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``x / scale`` saturated to +-448 and rounded to the nearest ``float8_e4m3fn``."""
    limit = e4m3_max()
    return (x.float() / scale).clamp(-limit, limit).to(torch.float8_e4m3fn)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``q * scale`` in fp32."""
    return q.float() * scale


# ---------------------------------------------------------------- quantised paged caches


@dataclass
class QuantizedKV:
    """One layer's K (or V) cache in 8 bits, and its scales.

    ``data`` ``[num_blocks, block_size, num_kv_heads, head_dim]``: int8, or
    ``float8_e4m3fn``; ``scale`` fp32: ``[num_blocks, num_kv_heads]`` for int8, ``[1]``
    for fp8. ``which`` is ``"k"`` or ``"v"`` (fp8's calibration range differs);
    ``calibrated`` says whether fp8's scale has been set (kept on the host, so a write
    never reads it back from the device).
    """

    data: torch.Tensor
    scale: torch.Tensor
    kind: str
    which: str = "k"
    calibrated: bool = field(default=False)
    #: int8's write (:func:`write_int8_blocks` when ``None``): the engine's hook
    write_int8: Callable | None = field(default=None, repr=False)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def bits(self) -> torch.Tensor:
        """The data as raw bytes (int8 as is, fp8 as a ``uint8`` view): what indexing
        and the Triton kernels use."""
        return self.data.view(torch.uint8) if self.kind == "fp8_e4m3" else self.data


def is_quantized(cache) -> bool:
    return isinstance(cache, QuantizedKV)


def allocate_quantized_kv_caches(kv_cache_dtype: str, num_layers: int,
                                 shape: tuple[int, int, int, int],
                                 device: torch.device | str
                                 ) -> list[tuple[QuantizedKV, QuantizedKV]]:
    """One (K, V) pair of :class:`QuantizedKV` per layer, poisoned (see the module)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        raise ValueError("kv_cache_dtype='auto' is not quantised: allocate plain tensors")
    num_blocks, _, num_kv_heads, _ = shape

    def one(which: str) -> QuantizedKV:
        if kv_cache_dtype == "int8":
            return QuantizedKV(torch.zeros(shape, dtype=torch.int8, device=device),
                               torch.full((num_blocks, num_kv_heads), float("nan"),
                                          device=device), "int8", which)
        data = torch.full(shape, float("nan"), dtype=torch.float8_e4m3fn, device=device)
        return QuantizedKV(data, torch.full((1,), float("nan"), device=device),
                           "fp8_e4m3", which)

    return [(one("k"), one("v")) for _ in range(num_layers)]


def write_quantized(x: torch.Tensor, cache: QuantizedKV, slot_mapping: torch.Tensor) -> None:
    """Write ``x`` ``[num_tokens, num_kv_heads, head_dim]`` into its slots, quantised
    (slot ``-1``: skipped). int8: :func:`write_int8_blocks` (or the cache's
    ``write_int8``); fp8: the first write calibrates the per-tensor scale."""
    slots = slot_mapping.long()
    keep = slots >= 0
    x, slots = x[keep].float(), slots[keep]
    if slots.numel() == 0:
        return
    block_size = cache.data.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    bits = cache.bits
    if cache.kind == "fp8_e4m3":
        if not cache.calibrated:
            absmax = x.abs().max().clamp(min=_TINY)
            cache.scale.copy_((absmax / FP8_RANGES[cache.which]).reshape(1))
            cache.calibrated = True
        bits[blocks, offsets] = quantize_fp8(x, cache.scale).view(torch.uint8)
        return
    (cache.write_int8 or write_int8_blocks)(x, cache.data, cache.scale, slots)


def write_int8_blocks(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                      slots: torch.Tensor) -> None:
    """One step's tokens into int8 blocks, in place: the block scale rule of the module
    docstring (chapter 11's exercise 11.3; the engine's ``EngineHooks.write_int8_blocks``).

    ``x`` fp32 ``[num_tokens, num_kv_heads, head_dim]``, ``data`` int8 ``[num_blocks,
    block_size, num_kv_heads, head_dim]``, ``scale`` fp32 ``[num_blocks, num_kv_heads]``
    (NaN: never written), ``slots`` int64 ``[num_tokens]``, every one ``>= 0``. The tokens
    of one call that land in one block are taken together: one growth per (block, head).
    """
    block_size = data.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    uniq, inv = torch.unique(blocks, return_inverse=True)
    num_heads = x.shape[1]
    need = torch.zeros(uniq.numel(), num_heads, device=x.device).scatter_reduce_(
        0, inv[:, None].expand(-1, num_heads), x.abs().amax(-1), "amax") / INT8_MAX
    fresh = torch.zeros(uniq.numel(), dtype=torch.int32, device=x.device).scatter_reduce_(
        0, inv, (offsets == 0).int(), "amax").bool()
    old = scale[uniq]
    old = torch.where(fresh[:, None] | old.isnan(), 0.0, old)  # NaN: never written
    new = torch.where(need > old, torch.maximum(need, 2 * old), old).clamp(min=_TINY)
    ratio = torch.where(old > 0, old / new, 0.0)  # 1 where unchanged; 0 clears a fresh block
    held = data[uniq].float() * ratio[:, None, :, None]
    data[uniq] = held.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    scale[uniq] = new
    data[blocks, offsets] = quantize_int8(x, new[inv][:, :, None])


def use_int8_write(kv_caches: list, write_int8: Callable | None) -> None:
    """Make every int8 :class:`QuantizedKV` of ``kv_caches`` write with ``write_int8``
    (``write_int8_blocks``'s signature; the engine passes ``EngineHooks.write_int8_blocks``).
    Plain and fp8 caches are left alone."""
    for pair in kv_caches:
        for cache in pair:
            if is_quantized(cache) and cache.kind == "int8":
                cache.write_int8 = write_int8


def dequantize_blocks(cache: QuantizedKV, blocks: torch.Tensor) -> torch.Tensor:
    """Physical ``blocks`` of the cache in fp32 ``[len(blocks), block_size, heads, dim]``."""
    blocks = blocks.long()
    data = cache.bits[blocks]
    if cache.kind == "int8":
        return dequantize_int8(data, cache.scale[blocks][:, None, :, None])
    return dequantize_fp8(data.view(torch.float8_e4m3fn), cache.scale)


def dequantize_cache(cache: QuantizedKV) -> torch.Tensor:
    """The whole cache in fp32 (for measurements and tests)."""
    return dequantize_blocks(cache, torch.arange(cache.shape[0], device=cache.device))


def dequantize_used_blocks(k_cache: QuantizedKV, v_cache: QuantizedKV,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks a call reads, dequantised into compact fp32 caches, and the block
    tables renumbered into them (``-1`` where nothing is read): what the torch backend
    attends over. Each block read is dequantised once, however many tables share it."""
    block_size = k_cache.shape[1]
    width = block_tables.shape[1]
    num_used = (seq_lens.long() + block_size - 1) // block_size
    used = torch.arange(width, device=block_tables.device)[None, :] < num_used[:, None]
    ids = block_tables.long()[used]
    if ids.numel() == 0:  # nothing is read: one block keeps the shapes valid
        ids = torch.zeros(1, dtype=torch.long, device=block_tables.device)
    uniq, inv = torch.unique(ids, return_inverse=True)
    tables = torch.full_like(block_tables, -1)
    if bool(used.any()):
        tables[used] = inv.to(tables.dtype)
    return dequantize_blocks(k_cache, uniq), dequantize_blocks(v_cache, uniq), tables


def copy_quantized_blocks(src: QuantizedKV, dst: QuantizedKV, src_blocks: torch.Tensor,
                          dst_blocks: torch.Tensor) -> None:
    """Copy whole blocks ``src_blocks -> dst_blocks`` (same or another pool: copy-on-write,
    swap) with their int8 scales; fp8's per-tensor scale stays (the bits mean the same
    under it in both pools)."""
    if src.kind != dst.kind or src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"cannot copy {src.kind} {tuple(src.shape)} blocks into "
                         f"{dst.kind} {tuple(dst.shape)}")
    s, d = src_blocks.long().to(src.device), dst_blocks.long().to(dst.device)
    dst.bits[d] = src.bits[s].to(dst.device)
    if src.kind == "int8":
        dst.scale[d] = src.scale[s].to(dst.device)
    elif src.calibrated and not dst.calibrated:
        dst.scale.copy_(src.scale.to(dst.device))
        dst.calibrated = True


def copy_quantized_kv(src_caches: list, dst_caches: list, pairs: list[tuple[int, int]]) -> None:
    """Copy blocks ``src -> dst`` in every layer's quantised (K, V), scales included:
    copy-on-write inside one pool (``src_caches is dst_caches``: the pairs are checked
    like :func:`paged_lib.kernels.copy_blocks.copy_blocks` checks them) or a swap
    between the GPU and CPU pools."""
    if not pairs:
        return
    if src_caches is dst_caches:
        from paged_lib.kernels.copy_blocks import normalize_pairs

        table = normalize_pairs(pairs, src_caches[0][0].shape[0])
    else:
        table = torch.tensor([tuple(p) for p in pairs], dtype=torch.int64).reshape(-1, 2)
    for (sk, sv), (dk, dv) in zip(src_caches, dst_caches, strict=True):
        copy_quantized_blocks(sk, dk, table[:, 0], table[:, 1])
        copy_quantized_blocks(sv, dv, table[:, 0], table[:, 1])


def quant_args(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_quant: tuple | None
               ) -> tuple[torch.Tensor, torch.Tensor, tuple, int]:
    """What a Triton launch passes for caches ``kv_quant = (k, v)`` (:class:`QuantizedKV`
    pairs whose data ``k_cache`` and ``v_cache`` are): the data as the kernels read it (fp8
    as ``uint8`` bits), ``(k_scale, v_scale, stride_sb, stride_sh)`` and ``KV_QUANT``
    (:data:`KV_QUANT_CODES`). Plain caches (``None``): the caches unchanged, themselves as
    unused scale pointers, and 0."""
    if kv_quant is None:
        return k_cache, v_cache, (k_cache, v_cache, 0, 0), 0
    k, v = kv_quant
    if k.kind == "fp8_e4m3" and k.data.is_cuda:
        from paged_lib.device import interpreter_on

        cc = torch.cuda.get_device_capability(k.data.device)
        if not interpreter_on() and cc < (8, 9):
            raise ValueError(f"fp8_e4m3 in the Triton kernels needs a GPU of compute capability "
                             f"8.9 or newer (Triton's fp8e4nv), this one is {cc[0]}.{cc[1]}: "
                             "use attention_backend='torch' or kv_cache_dtype='int8'")
    if k.scale.stride() != v.scale.stride():
        raise ValueError("k and v scales must have the same layout")
    strides = tuple(k.scale.stride()) if k.kind == "int8" else (0, 0)
    return k.bits, v.bits, (k.scale, v.scale, *strides), KV_QUANT_CODES[k.kind]
