"""Block pools in a known state, for the graders of chapters 03 and 08 and their tests.

Chapter 03's running example starts from a pool whose free list is not ``0, 1, 2, ...``:
other requests took blocks and gave some back, so a 40-token request lands in blocks 5,
2 and 9. :func:`busy_pool` builds that state with the
library's own :class:`~paged_lib.blocks.BlockAllocator`, through its public methods.
"""

from __future__ import annotations

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


def pool_state(allocator: BlockAllocator) -> tuple[list[int], list[int]]:
    """(ref counts, free list) of a pool: what a bug in a table or an allocator changes."""
    return list(allocator.ref_counts), list(allocator.free_block_ids)
