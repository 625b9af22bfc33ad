"""Contiguous allocators for the pre-paging baselines of chapter 02.

Before vLLM, a serving system reserved one *contiguous* chunk of KV slots per request.
Two ways to hand out such chunks from a linear address space, both small enough to read:

* :class:`FirstFit`: the first hole big enough wins; freed chunks merge with free
  neighbours. Chunks of different sizes leave holes that may be too small for the next
  request: external fragmentation.
* :class:`Buddy`: every chunk is a power of two aligned to its size; a freed block merges
  with its *buddy* (address XOR size). The round-up to a power of two is internal
  fragmentation; the paper assumes its Orca baselines use such an allocator (§6.1).

Both answer ``alloc(size) -> (address, slots held) | None`` and ``free(address, size)``,
and keep ``free_slots`` up to date.
"""

from __future__ import annotations

import bisect


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (int(n) - 1).bit_length()


class FirstFit:
    """Contiguous chunks in a linear address space: the first hole that fits wins."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.holes: list[list[int]] = [[0, capacity]]  # [start, size], sorted by start
        self.free_slots = capacity

    def alloc(self, size: int) -> tuple[int, int] | None:
        """(address, slots held) of a new chunk, or None when no hole is big enough."""
        for i, (start, hole) in enumerate(self.holes):
            if hole >= size:
                if hole == size:
                    del self.holes[i]
                else:
                    self.holes[i] = [start + size, hole - size]
                self.free_slots -= size
                return start, size
        return None

    def free(self, addr: int, size: int) -> None:
        """Give a chunk back, merging it with the free holes on either side."""
        i = bisect.bisect_left(self.holes, [addr, 0])
        self.holes.insert(i, [addr, size])
        self.free_slots += size
        if i + 1 < len(self.holes) and addr + size == self.holes[i + 1][0]:  # merge right
            self.holes[i][1] += self.holes.pop(i + 1)[1]
        if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == addr:  # merge left
            self.holes[i - 1][1] += self.holes.pop(i)[1]

    @property
    def largest_hole(self) -> int:
        return max((size for _, size in self.holes), default=0)


class Buddy:
    """Binary buddy allocator: blocks of 2**k slots aligned to their size; a freed block
    merges with its buddy (address XOR size) whenever that buddy is free too."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.free_lists: dict[int, set[int]] = {}
        self.free_slots = capacity
        addr = 0
        for k in range(capacity.bit_length() - 1, -1, -1):  # aligned power-of-two pieces
            if capacity >> k & 1:
                self.free_lists.setdefault(k, set()).add(addr)
                addr += 1 << k
        self.largest_block = 1 << (capacity.bit_length() - 1)

    def alloc(self, size: int) -> tuple[int, int] | None:
        """(address, 2**k slots held) for the smallest power of two >= size, or None."""
        k = (size - 1).bit_length()
        for j in range(k, self.capacity.bit_length()):
            if self.free_lists.get(j):
                addr = min(self.free_lists[j])
                self.free_lists[j].remove(addr)
                while j > k:  # split, keep the lower half
                    j -= 1
                    self.free_lists.setdefault(j, set()).add(addr + (1 << j))
                self.free_slots -= 1 << k
                return addr, 1 << k
        return None

    def free(self, addr: int, size: int) -> None:
        """Give a block back; merge with its buddy for as long as the buddy is free."""
        k = (size - 1).bit_length()
        self.free_slots += 1 << k
        while addr ^ (1 << k) in self.free_lists.get(k, ()):
            self.free_lists[k].remove(addr ^ (1 << k))
            addr = min(addr, addr ^ (1 << k))
            k += 1
        self.free_lists.setdefault(k, set()).add(addr)
