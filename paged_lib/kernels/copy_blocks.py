"""Copy-on-write in the cache: copy whole physical blocks ``src -> dst``, every layer.

When a sequence writes into a block it shares (a forked sample or beam), the block
manager hands it a fresh block ``dst`` and a :class:`~paged_lib.blocks.Slot` with
``copy=(src, dst)``. Before the new token's K/V are written, everything already in
``src`` has to be in ``dst`` too, in every layer's K and V cache. That is this module:
vLLM's ``copy_blocks`` op, in Triton and in PyTorch.

Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``; pass one tensor (one
layer) or a list with one tensor per layer, for K and for V. ``pairs`` is a list of
``(src, dst)`` or an int tensor ``[num_pairs, 2]``. Inputs are checked before anything
is copied: a wrong id here silently overwrites another sequence's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from paged_lib.kernels.backends import check_backend
from paged_lib.util import cdiv

__all__ = ["copy_blocks", "normalize_pairs"]

Caches = torch.Tensor | Sequence[torch.Tensor]
Pairs = torch.Tensor | Sequence[tuple[int, int]]

#: Elements one Triton program copies per cache (a power of two).
CHUNK = 1024


@triton.jit
def _copy_blocks_kernel(k_ptr, v_ptr, pairs_ptr, stride_kb, stride_vb,
                        BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr):
    """Program (pair, chunk): copy ``CHUNK`` elements of block ``src`` into ``dst``.

    A block's ``block_size * num_kv_heads * head_dim`` elements are contiguous (checked
    by the wrapper), so a block is one flat run starting at ``block * stride_b``.
    """
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    k = tl.load(k_ptr + src * stride_kb + offs, mask=mask)
    tl.store(k_ptr + dst * stride_kb + offs, k, mask=mask)
    v = tl.load(v_ptr + src * stride_vb + offs, mask=mask)
    tl.store(v_ptr + dst * stride_vb + offs, v, mask=mask)


def copy_blocks(k_cache: Caches, v_cache: Caches, pairs: Pairs, *,
                backend: str = "triton") -> None:
    """Copy physical block ``src`` to ``dst`` for every ``(src, dst)`` pair, in place.

    Every layer's K and V cache given is copied. Raises ``ValueError`` (before copying
    anything) for an id outside the cache, ``src == dst``, a ``dst`` named twice (which
    copy would win?) or a block that is both a source and a destination (the result
    would depend on the order of the copies).
    """
    check_backend(backend)
    ks, vs = _as_layers(k_cache, "k_cache"), _as_layers(v_cache, "v_cache")
    _check_layers(ks, vs)
    table = normalize_pairs(pairs, ks[0].shape[0])
    if table.shape[0] == 0:
        return
    for k, v in zip(ks, vs, strict=True):
        if backend != "triton":  # "cpu" copies as the torch backend does
            _copy_torch(k, v, table)
        else:
            _copy_triton(k, v, table.to(k.device))


def normalize_pairs(pairs: Pairs, num_blocks: int) -> torch.Tensor:
    """``pairs`` as an int64 CPU tensor ``[num_pairs, 2]``, validated against the pool."""
    if isinstance(pairs, torch.Tensor):
        if pairs.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"pairs must be an int32 or int64 tensor, got {pairs.dtype}")
        table = pairs.detach().cpu().long()
    else:
        try:
            table = torch.tensor([tuple(p) for p in pairs], dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"pairs must be a list of (src, dst) int pairs: {err}") from err
        if table.numel() == 0:
            table = table.reshape(0, 2)
    if table.ndim != 2 or table.shape[1] != 2:
        raise ValueError(f"pairs must be [num_pairs, 2] (src, dst), got shape "
                         f"{tuple(table.shape)}")
    for i, (src, dst) in enumerate(table.tolist()):
        for name, b in (("src", src), ("dst", dst)):
            if not 0 <= b < num_blocks:
                raise ValueError(f"pair {i} ({src} -> {dst}): {name} block {b} is outside "
                                 f"the cache (blocks 0..{num_blocks - 1})")
        if src == dst:
            raise ValueError(f"pair {i}: src == dst == {src}; copy-on-write copies into a "
                             "*fresh* block")
    dsts = table[:, 1].tolist()
    dup = sorted({d for d in dsts if dsts.count(d) > 1})
    if dup:
        raise ValueError(f"destination block(s) {dup} named more than once: each copy "
                         "needs its own fresh block")
    both = sorted(set(table[:, 0].tolist()) & set(dsts))
    if both:
        raise ValueError(f"block(s) {both} are both a source and a destination: the result "
                         "would depend on the order of the copies")
    return table


def _as_layers(caches: Caches, name: str) -> list[torch.Tensor]:
    layers = [caches] if isinstance(caches, torch.Tensor) else list(caches)
    if not layers:
        raise ValueError(f"{name} is empty: give one cache tensor per layer")
    for i, t in enumerate(layers):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}[{i}] must be [num_blocks, block_size, num_kv_heads, "
                             f"head_dim], got {shape}")
    return layers


def _check_layers(ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
    if len(ks) != len(vs):
        raise ValueError(f"{len(ks)} K caches but {len(vs)} V caches: one of each per layer")
    first = ks[0]
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        for name, t in ((f"k_cache[{i}]", k), (f"v_cache[{i}]", v)):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}, but "
                                 f"k_cache[0] is {tuple(first.shape)} {first.dtype} on "
                                 f"{first.device}: every layer's caches must match")
            if not t[0].is_contiguous():
                raise ValueError(f"{name}: each block must be contiguous in memory (a "
                                 "[num_blocks, block_size, num_kv_heads, head_dim] tensor "
                                 "or a slice of one along the first axis)")


def _copy_torch(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor) -> None:
    """The reference: gather all sources first, then scatter (order does not matter)."""
    src, dst = table[:, 0].to(k.device), table[:, 1].to(k.device)
    k[dst] = k[src]
    v[dst] = v[src]


def _copy_triton(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor) -> None:
    block_numel = k[0].numel()
    chunk = min(CHUNK, triton.next_power_of_2(block_numel))
    grid = (table.shape[0], cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](k, v, table.contiguous(), k.stride(0), v.stride(0),
                              BLOCK_NUMEL=block_numel, CHUNK=chunk)
