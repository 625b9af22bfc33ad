"""Block pools in a known state, and a KV store with a label per slot (chapters 03 and 08)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paged_lib.blocks import BlockAllocator, BlockTable, Slot


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


class ToyStore:
    """A KV cache with a label per slot, written the way the engine writes a ``Slot``:
    its copy first (all of block ``src`` into ``dst``), then the token at (block, offset).
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.blocks: dict[int, list[Any]] = {}

    def _row(self, block: int | None) -> list[Any]:
        return self.blocks.get(block, [None] * self.block_size)

    def write(self, slot: Slot, label: Any) -> None:
        if slot.copy is not None:
            src, dst = slot.copy
            self.blocks[dst] = list(self._row(src))
        row = self.blocks.setdefault(slot.block, [None] * self.block_size)
        if 0 <= slot.offset < self.block_size:  # a wrong offset writes nowhere
            row[slot.offset] = label

    def read(self, table: BlockTable) -> list[Any]:
        """What a kernel reads through ``table``: a label per token, None where nothing
        was written (or the table has fewer blocks than its tokens need)."""
        out = []
        for t in range(table.num_tokens):
            blocks, j = table.blocks, t // self.block_size
            out.append(self._row(blocks[j] if j < len(blocks) else None)[t % self.block_size])
        return out
