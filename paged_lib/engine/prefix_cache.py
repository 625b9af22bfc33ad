"""Automatic prefix caching: hashed full blocks and an LRU free queue (chapter 10).

As vLLM v1 does it (vLLM docs, "Automatic Prefix Caching" design page). A *full* block
of a sequence is named by a hash of its parent block's hash, its own token ids and any
extra keys; the chain makes a block's hash stand for the whole prefix up to its last
token. A request whose first blocks hash the same as blocks already in the pool reads
those blocks instead of computing them again.

* :func:`hash_block_tokens` - one block's :class:`BlockHash`, chained on its parent's;
* :func:`block_hashes` - the hashes of every full block of a token list;
* :func:`longest_cache_hit` - the cached blocks of the longest run of leading hits;
* :func:`allocate_slots` - a new request's table: its cache hit adopted, fresh blocks for
  this step's tokens only, its full blocks registered (vLLM v1's ``allocate_slots``);
* :class:`FreeBlockQueue` - the free blocks in LRU order, a doubly linked list with O(1)
  removal from the middle (a hit on a free block takes it out);
* :class:`PrefixCachingAllocator` - chapter 03's allocator whose freed blocks keep their
  contents and their hash until they are reused (evicted), least recently freed first.

Pure Python, no tensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from typing import NamedTuple

from paged_lib.blocks import BlockAllocator, BlockTable, OutOfBlocks


class BlockHash(NamedTuple):
    """What names one full block: a stable 64-bit ``value`` (the same in every process)
    and the ``token_ids`` and ``extra_keys`` it was made from, kept so that two blocks
    whose values collide are still told apart."""

    value: int
    token_ids: tuple[int, ...]
    extra_keys: tuple = ()


def hash_block_tokens(parent: BlockHash | None, token_ids: Iterable[int],
                      extra_keys: tuple = ()) -> BlockHash:
    """The hash of one block: sha256 over the parent's value (``None`` for the first
    block), the block's token ids and ``extra_keys``, cut to 64 bits.

    Example: two prompts that start with the same 8 tokens get equal hashes for their
    first two blocks of 4; a block whose parent differs gets a different value even if
    its own tokens are equal.
    """
    tokens = tuple(int(t) for t in token_ids)
    extra = tuple(extra_keys)
    parent_value = None if parent is None else parent.value
    digest = hashlib.sha256(repr((parent_value, tokens, extra)).encode()).digest()
    return BlockHash(int.from_bytes(digest[:8], "little"), tokens, extra)


def block_hashes(token_ids: Seq[int], block_size: int,
                 extra_keys: tuple = ()) -> list[BlockHash]:
    """One :class:`BlockHash` per *full* block of ``token_ids``, each chained on the one
    before; a part-filled last block gets none (its K/V will still change).

    Example (block size 4): 10 tokens -> 2 hashes.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


def longest_cache_hit(hashes: Seq[BlockHash], lookup: Callable[[BlockHash], int | None],
                      num_tokens: int, block_size: int) -> list[int]:
    """The physical blocks of the longest run of leading hashes that ``lookup`` finds.

    At most ``(num_tokens - 1) // block_size`` blocks: the last token of the text must
    still be computed, because its logits give the next token (vLLM v1 does the same).
    Example (block size 4): 8 tokens, both blocks cached -> only the first is a hit.
    """
    limit = min(len(hashes), max(num_tokens - 1, 0) // block_size)
    hits: list[int] = []
    for h in hashes[:limit]:
        block = lookup(h)
        if block is None:
            break
        hits.append(block)
    return hits


def allocate_slots(pool: PrefixCachingAllocator, token_ids: Seq[int], hashes: Seq[BlockHash],
                   block_size: int, max_new_tokens: int) -> tuple[list[int], int]:
    """A new request's blocks in a caching ``pool``: ``(blocks, num_computed_tokens)``.

    As vLLM v1's ``KVCacheManager.get_computed_blocks`` then ``allocate_slots``: the
    longest run of leading ``hashes`` the pool holds is adopted (at most
    ``(len(token_ids) - 1) // block_size`` blocks: the last token is computed, its logits
    are needed), each hit one reference more (out of the free queue if it was free,
    *before* anything is allocated, so no hit is evicted); then fresh blocks from the head
    of the free queue (evicting their old hashes) for the tokens computed this step,
    ``min(len(token_ids) - num_computed, max_new_tokens)`` (a chunk under the budget);
    then every block those tokens fill is registered, so a request later in the same step
    hits it. A part-filled last block is not.
    """
    hits = longest_cache_hit(hashes, pool.lookup, len(token_ids), block_size)
    for block in hits:
        pool.touch(block)
    computed = len(hits) * block_size
    end = computed + min(len(token_ids) - computed, max_new_tokens)
    blocks = hits + [pool.allocate() for _ in range(-(-end // block_size) - len(hits))]
    for block, h in zip(blocks[:end // block_size], hashes, strict=False):
        pool.cache_block(block, h)  # a hit is already cached under h: nothing changes
    return blocks, computed


class FreeBlockQueue:
    """Free block ids in LRU order: a doubly linked list over ``next`` / ``prev`` dicts
    between a head and a tail sentinel.

    ``popleft`` takes the block freed longest ago, ``append`` puts a freed block at the
    tail, ``remove`` takes a block out of the middle (a cache hit on a free block); all
    three are O(1), which a ``deque`` cannot do for ``remove``.
    """

    HEAD, TAIL = "head", "tail"

    def __init__(self, block_ids: Iterable[int] = ()):
        self.next: dict = {self.HEAD: self.TAIL}
        self.prev: dict = {self.TAIL: self.HEAD}
        self._len = 0
        for block in block_ids:
            self.append(block)

    def popleft(self) -> int:
        """Take the block at the head (the least recently freed)."""
        block = self.next[self.HEAD]
        if block == self.TAIL:
            raise IndexError("popleft from an empty FreeBlockQueue")
        after = self.next.pop(block)
        del self.prev[block]
        self.next[self.HEAD] = after
        self.prev[after] = self.HEAD
        self._len -= 1
        return block

    def remove(self, block_id: int) -> None:
        """Take ``block_id`` out from wherever it is in the queue."""
        if block_id not in self.next or block_id in (self.HEAD, self.TAIL):
            raise ValueError(f"block {block_id} is not in the free queue")
        before, after = self.prev.pop(block_id), self.next.pop(block_id)
        self.next[before] = after
        self.prev[after] = before
        self._len -= 1

    def append(self, block_id: int) -> None:
        """Put ``block_id`` at the tail (it will be reused last)."""
        if block_id in self.next:
            raise ValueError(f"block {block_id} is already in the free queue")
        last = self.prev[self.TAIL]
        self.next[last], self.prev[block_id] = block_id, last
        self.next[block_id], self.prev[self.TAIL] = self.TAIL, block_id
        self._len += 1

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        block = self.next[self.HEAD]
        while block != self.TAIL:
            yield block
            block = self.next[block]

    def __contains__(self, block_id: object) -> bool:
        return block_id in self.next and block_id not in (self.HEAD, self.TAIL)

    def __repr__(self) -> str:
        return f"FreeBlockQueue({list(self)})"


class PrefixCachingAllocator(BlockAllocator):
    """Chapter 03's allocator, with a cache of full blocks (same API, so
    :class:`~paged_lib.blocks.BlockTable` works unchanged).

    A block whose reference count drops to 0 keeps its K/V and its hash and goes to the
    *tail* of the free queue; it still counts as free (``num_free``: it can be evicted).
    ``allocate`` takes the head and, if that block was cached, drops its hash (eviction).
    ``lookup`` finds a cached block by hash; ``touch`` takes a reference to it, taking it
    out of the free queue if it was free; ``cache_block`` registers a full block.
    """

    def __init__(self, num_blocks: int, free_queue_cls: type = FreeBlockQueue):
        super().__init__(num_blocks)
        self.free_block_queue = free_queue_cls(range(num_blocks))
        self.free_block_ids = self.free_block_queue  # the base class's name for it
        self.block_hash: dict[int, BlockHash] = {}            # block -> its hash
        self.cached_blocks: dict[int, list[int]] = {}         # hash value -> blocks

    @property
    def num_free(self) -> int:
        return len(self.free_block_queue)

    @property
    def num_cached(self) -> int:
        """Blocks that hold a hash (in use or free)."""
        return len(self.block_hash)

    def allocate(self) -> int:
        """Take the head of the free queue (evicting its hash if it had one)."""
        if len(self.free_block_queue) == 0:
            raise OutOfBlocks(1, 0, self.num_blocks)
        block = self.free_block_queue.popleft()
        self._evict(block)
        self.ref_counts[block] = 1
        return block

    def _evict(self, block: int) -> None:
        h = self.block_hash.pop(block, None)
        if h is not None:
            same_value = self.cached_blocks[h.value]
            same_value.remove(block)
            if not same_value:
                del self.cached_blocks[h.value]

    def lookup(self, h: BlockHash) -> int | None:
        """The cached block whose hash equals ``h`` (value, token ids and extra keys),
        or ``None``; a block that only shares ``h.value`` is never returned."""
        for block in self.cached_blocks.get(h.value, ()):
            if self.block_hash[block] == h:
                return block
        return None

    def touch(self, block: int) -> None:
        """One more holder of a cached block (a cache hit): out of the free queue if it
        was free, then its reference count goes up."""
        self._check_known(block)
        if block not in self.block_hash:
            raise ValueError(f"block {block} is not cached: touch only lookup's blocks")
        if self.ref_counts[block] == 0:
            self.free_block_queue.remove(block)
        self.ref_counts[block] += 1

    def cache_block(self, block: int, h: BlockHash) -> None:
        """Register the full ``block`` under ``h`` (its K/V written by the end of this step).

        Another block may already be cached under an equal hash (the same text computed
        twice, e.g. by two requests admitted before either was cached): both stay cached,
        :meth:`lookup` returns the older, and evicting one leaves the other (vLLM's
        "duplicated blocks"). Caching a block again under its own hash is a no-op; under
        another hash, or a free block, is a ``ValueError``.
        """
        self._check_known(block)
        if self.ref_counts[block] == 0:
            raise ValueError(f"cannot cache block {block}: it is free (its K/V may be stale)")
        old = self.block_hash.get(block)
        if old is not None:
            if old != h:
                raise ValueError(f"block {block} is already cached under another hash")
            return
        self.block_hash[block] = h
        self.cached_blocks.setdefault(h.value, []).append(block)

    def free_table(self, table: BlockTable) -> None:
        """Free a request's table tail first (:meth:`BlockTable.free` does so), so its
        longest-prefix blocks are the last to be evicted."""
        table.free()
