"""Logical blocks, physical blocks and the block table: the bookkeeping of PagedAttention.

The KV cache is one pool of equal-sized *physical blocks* (``block_size`` token slots
each). A sequence sees a run of *logical blocks*; its :class:`BlockTable` maps logical
block ``i`` to a physical block and knows how many slots of the last one are filled.
Token ``t`` of a sequence lives in physical block ``blocks[t // block_size]`` at offset
``t % block_size``.

Two classes, nano-vllm style:

* :class:`BlockAllocator` owns the pool: a free list (a ``deque``) and a reference count
  per block. A block is free exactly when its count is 0.
* :class:`BlockTable` is one sequence's view. It takes a block only when a token needs
  one (on demand), shares blocks with :meth:`~BlockTable.fork`, and copies a shared
  block before writing into it (copy-on-write).

Nothing here touches tensors: a :class:`Slot` says *where* to write a token's K/V and,
for copy-on-write, which block to copy first. The engine does the writing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from paged_lib.util import cdiv


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs.

    Raised before anything changes, so the caller (a scheduler) can preempt another
    sequence and retry.
    """

    def __init__(self, needed: int, num_free: int, num_blocks: int):
        self.needed, self.num_free, self.num_blocks = needed, num_free, num_blocks
        noun = "block" if needed == 1 else "blocks"
        super().__init__(f"need {needed} {noun}, {num_free} free (pool of {num_blocks})")


@dataclass(frozen=True)
class Slot:
    """Where one token's K/V goes: physical ``block`` and ``offset`` inside it.

    ``copy = (src, dst)`` means: before writing, copy all of physical block ``src`` into
    ``dst`` (copy-on-write; ``block == dst``). ``None`` means write in place.
    """

    block: int
    offset: int
    copy: tuple[int, int] | None = None


class BlockAllocator:
    """A pool of ``num_blocks`` physical blocks with reference counts.

    ``allocate`` takes from the left of the free list and ``free`` returns to the right,
    so the block freed longest ago is reused first and the order is easy to predict.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a pool needs at least 1 block, got num_blocks={num_blocks}")
        self._num_blocks = num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts: list[int] = [0] * num_blocks

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_block_ids)

    def allocate(self) -> int:
        """Take a free block; its reference count becomes 1."""
        if not self.free_block_ids:
            raise OutOfBlocks(1, 0, self._num_blocks)
        block = self.free_block_ids.popleft()
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """One more holder of a block that is in use (a fork shares it)."""
        self._check_known(block)
        if self.ref_counts[block] == 0:
            raise ValueError(f"cannot incref block {block}: it is free (allocate it first)")
        self.ref_counts[block] += 1

    def free(self, block: int) -> None:
        """Drop one reference; the last holder returns the block to the free list."""
        self._check_known(block)
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is already free (double free?)")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_block_ids.append(block)

    def refcount(self, block: int) -> int:
        """How many block tables hold ``block`` (0: it is free)."""
        self._check_known(block)
        return self.ref_counts[block]

    def _check_known(self, block: int) -> None:
        # An explicit range check: Python would happily read ref_counts[-1].
        if not 0 <= block < self._num_blocks:
            raise ValueError(
                f"unknown block {block}: this pool has blocks 0..{self._num_blocks - 1}")


class BlockTable:
    """One sequence's logical-to-physical block map, filled token by token."""

    def __init__(self, allocator: BlockAllocator, block_size: int,
                 blocks: Sequence[int] = (), num_tokens: int = 0):
        """A table over ``blocks`` already holding ``num_tokens`` tokens (default: empty).

        The table *adopts* ``blocks``: the caller already holds one reference to each
        (it allocated them, increfed them for a fork, or swapped them in), so nothing is
        counted here.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if cdiv(num_tokens, block_size) != len(blocks) or num_tokens < 0:
            raise ValueError(f"{num_tokens} tokens at block size {block_size} need "
                             f"{cdiv(max(num_tokens, 0), block_size)} blocks, got {len(blocks)}")
        self.allocator = allocator
        self.block_size = block_size
        self._blocks: list[int] = list(blocks)
        self._num_tokens = num_tokens
        self._freed = False

    @property
    def blocks(self) -> list[int]:
        """Physical block of each logical block (a copy: change it through the methods)."""
        return list(self._blocks)

    @property
    def freed(self) -> bool:
        """Whether :meth:`free` has run: the table holds nothing and refuses every call."""
        return self._freed

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def last_block_fill(self) -> int:
        """Filled slots of the last block (0 when the table holds no block)."""
        return self._num_tokens - (len(self._blocks) - 1) * self.block_size \
            if self._blocks else 0

    def append_token(self) -> Slot:
        """Find the slot for the next token, taking or copying a block if needed.

        * last block full (or none): allocate a new one (on demand);
        * last block shared (ref count > 1): copy-on-write, since writing in place
          would change the other holders' tokens;
        * otherwise write into the last block in place.

        Allocation happens before any change, so :class:`OutOfBlocks` leaves the table
        and the allocator as they were.
        """
        self._check_live()
        offset = self._num_tokens % self.block_size
        copy = None
        if offset == 0:
            self._blocks.append(self.allocator.allocate())
        elif self.allocator.refcount(self._blocks[-1]) > 1:
            src, dst = self._blocks[-1], self.allocator.allocate()
            self.allocator.free(src)  # the other holders keep it
            self._blocks[-1] = dst
            copy = (src, dst)
        self._num_tokens += 1
        return Slot(self._blocks[-1], offset, copy)

    def blocks_needed(self, num_new_tokens: int = 1) -> int:
        """Free blocks that appending ``num_new_tokens`` tokens would take.

        New blocks for the tokens past the last block, plus one for copy-on-write when
        the first new token lands in a shared, part-filled last block. A scheduler asks
        this before appending, so it never hits :class:`OutOfBlocks` half way.
        """
        self._check_live()
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        new = cdiv(self._num_tokens + num_new_tokens, self.block_size) - len(self._blocks)
        shared_tail = (num_new_tokens > 0 and self._num_tokens % self.block_size != 0
                       and self.allocator.refcount(self._blocks[-1]) > 1)
        return new + int(shared_tail)

    def fork(self) -> BlockTable:
        """A second sequence sharing every block of this one; allocates nothing.

        The child has this table's class, so a subclass's fork returns the subclass.
        """
        self._check_live()
        for block in self._blocks:
            self.allocator.incref(block)
        return type(self)(self.allocator, self.block_size, self._blocks, self._num_tokens)

    def free(self) -> None:
        """Return every block (drop this table's references); the table is then dead.

        The tail goes back first, so the head of the sequence (the part other
        sequences most often share, as a prompt prefix) is the last to be reused.
        """
        self._check_live()
        for block in reversed(self._blocks):
            self.allocator.free(block)
        self._blocks = []
        self._num_tokens = 0
        self._freed = True

    def _check_live(self) -> None:
        if self._freed:
            raise ValueError("this BlockTable was freed; create a new one (or fork a live one)")

    def __repr__(self) -> str:
        state = "freed" if self._freed else f"num_tokens={self._num_tokens}"
        return f"BlockTable(blocks={self._blocks}, {state}, block_size={self.block_size})"
