"""Block pools in a known state, built through the library allocator (chapters 03 and 08)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paged_lib.blocks import BlockAllocator


def busy_pool(num_blocks: int, free_in_order: tuple[int, ...] | None = None
              ) -> BlockAllocator:
    """A pool whose free list is exactly ``free_in_order`` (the other blocks held once);
    ``None``: a fresh pool."""
    allocator = BlockAllocator(num_blocks)
    for _ in range(num_blocks if free_in_order is not None else 0):
        allocator.allocate()
    for b in free_in_order or ():
        allocator.free(b)
    return allocator


def with_free(allocator: BlockAllocator, free_block: Callable[..., Any]) -> BlockAllocator:
    """``allocator`` freeing through a learner's ``free_block(block, ref_counts, free_ids)``."""
    allocator.free = lambda b: free_block(b, allocator.ref_counts, allocator.free_block_ids)
    return allocator


def pool_state(allocator: BlockAllocator) -> tuple[list[int], list[int]]:
    """(ref counts, free list) of a pool."""
    return list(allocator.ref_counts), list(allocator.free_block_ids)
