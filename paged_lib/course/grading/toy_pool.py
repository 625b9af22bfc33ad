"""Block pools in a known state, built through the library allocator (chapters 03 and 08)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paged_lib.blocks import BlockAllocator


def busy_pool(num_blocks: int, free_in_order: tuple[int, ...] | None = None
              ) -> BlockAllocator:
    """A pool of ``num_blocks`` whose free list is exactly ``free_in_order``: every block
    was taken, then those came back in that order (the others stay held, ref count 1).
    ``None``: a fresh pool."""
    allocator = BlockAllocator(num_blocks)
    if free_in_order is not None:
        for _ in range(num_blocks):
            allocator.allocate()
        for b in free_in_order:
            allocator.free(b)
    return allocator


def with_free(allocator: BlockAllocator, free_block: Callable[..., Any]) -> BlockAllocator:
    """``allocator`` freeing through a learner's ``free_block(block, ref_counts,
    free_block_ids)`` (03.3), for its tables and for anyone who calls its ``free``."""
    allocator.free = lambda b: free_block(b, allocator.ref_counts, allocator.free_block_ids)
    return allocator


def pool_state(allocator: BlockAllocator) -> tuple[list[int], list[int]]:
    """(ref counts, free list) of a pool: what a bug in a table or an allocator changes."""
    return list(allocator.ref_counts), list(allocator.free_block_ids)
