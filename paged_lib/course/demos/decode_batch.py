"""Chapter 05's demo batch, built the way an engine builds one: from chapter 03's tables.

The kernel tests use random block tables (:mod:`paged_lib.kernels.cases`); the chapter
shows a batch that could really occur. Every sequence grows token by token through a
:class:`~paged_lib.blocks.BlockTable` over one :class:`~paged_lib.blocks.BlockAllocator`,
each token's K/V is written to the slot ``append_token`` returns, and one sequence is a
fork of another taken at a block boundary, so the two share a *full* block (a partly
filled block is never shared: the next append would copy it). Padding is ``-1``, which
is never an allocatable block; every slot no token was written to is NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_lib.blocks import BlockAllocator, BlockTable
from paged_lib.kernels.cases import DecodeCase
from paged_lib.studies.block_formats import to_padded


def demo_batch(seq_lens: Sequence[int] = (20, 25, 37), fork: tuple[int, int] = (0, 1),
               fork_at: int = 16, num_heads: int = 8, num_kv_heads: int = 2,
               head_dim: int = 128, block_size: int = 16, num_blocks: int = 8,
               seed: int = 0) -> tuple[DecodeCase, list[BlockTable]]:
    """A decode batch on a NaN-poisoned cache, and the tables it was built with.

    Sequence ``fork[1]`` is a fork of sequence ``fork[0]`` taken when the latter held
    ``fork_at`` tokens (a multiple of ``block_size``), then both grow on their own.
    Returns ``(case, tables)``; ``case`` unpacks into ``paged_attention(*case)``.
    """
    parent, child = fork
    if fork_at % block_size or fork_at > min(seq_lens[parent], seq_lens[child]):
        raise ValueError(f"fork_at={fork_at} must be a multiple of block_size={block_size} "
                         f"and at most both sequences' lengths {seq_lens[parent]}, "
                         f"{seq_lens[child]}")
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    allocator = BlockAllocator(num_blocks)
    tables: list[BlockTable | None] = [None] * len(seq_lens)

    def grow(i: int, upto: int) -> None:
        while tables[i].num_tokens < upto:
            slot = tables[i].append_token()
            if slot.copy is not None:  # cannot happen at a block boundary; be explicit
                k_cache[slot.copy[1]] = k_cache[slot.copy[0]]
                v_cache[slot.copy[1]] = v_cache[slot.copy[0]]
            k_cache[slot.block, slot.offset] = torch.randn(num_kv_heads, head_dim, generator=g)
            v_cache[slot.block, slot.offset] = torch.randn(num_kv_heads, head_dim, generator=g)

    for i in range(len(seq_lens)):
        if i == child:
            continue
        tables[i] = BlockTable(allocator, block_size)
        grow(i, fork_at if i == parent else seq_lens[i])
        if i == parent:
            tables[child] = tables[i].fork()
            grow(i, seq_lens[i])
    grow(child, seq_lens[child])
    block_tables, lens = to_padded([t.blocks for t in tables], list(seq_lens), block_size,
                                   pad=-1)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    return DecodeCase(q, k_cache, v_cache, block_tables, lens, head_dim ** -0.5), tables
