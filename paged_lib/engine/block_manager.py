"""The block manager: chapter 03's allocator and block tables, asked questions by the scheduler.

Pure Python, no tensors. It answers "how many free blocks would this take?" *before*
anything changes (so the scheduler can preempt someone first and never fails half way),
then does it and returns :class:`~paged_lib.blocks.Slot`s (where each new token's K/V
goes) or block mappings (what the model runner must copy).

Two pools: the GPU pool the kernels read, and an optional CPU pool that preempted
sequences are swapped into (chapter 07). A sequence's ``block_table`` lives in whichever
pool holds its K/V. With prefix caching (chapter 10) the GPU pool is a
:class:`~paged_lib.engine.prefix_cache.PrefixCachingAllocator`: a new table adopts the
cached blocks of its text's longest cached prefix, and full blocks are registered as soon
as the step that writes their K/V is scheduled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from paged_lib.blocks import BlockAllocator, BlockTable, OutOfBlocks, Slot
from paged_lib.engine.prefix_cache import (
    FreeBlockQueue,
    PrefixCachingAllocator,
    allocate_slots,
    block_hashes,
    longest_cache_hit,
)
from paged_lib.engine.sequence import Sequence, SequenceGroup
from paged_lib.util import cdiv


def swap_mapping(tables: list[list[int]], allocate: Callable[[], int]) -> list[tuple[int, int]]:
    """The block copies that move some block tables to another pool.

    ``tables`` are the source block lists of one sequence group (sequences of a group may
    share blocks: a forked prompt, beams with a common history). ``allocate()`` takes one
    free block of the destination pool. Returns ``(src, dst)`` pairs, one per *distinct*
    source block, in the order the blocks are first met reading the tables left to right,
    top to bottom; a block shared by several tables is copied once.

    Example: ``swap_mapping([[7, 3], [7, 5]], alloc)`` with ``alloc`` returning 0, 1, 2
    gives ``[(7, 0), (3, 1), (5, 2)]``.
    """
    mapping: dict[int, int] = {}
    for table in tables:
        for block in table:
            if block not in mapping:
                mapping[block] = allocate()
    return list(mapping.items())


def append_blocks_needed(tables: Iterable[BlockTable],
                         counts: Iterable[int] | None = None) -> int:
    """Free blocks that appending ``counts[i]`` tokens (default: one each) to each of
    ``tables`` takes, all together.

    Each table takes the blocks its new tokens reach past its last one. A part-filled last
    block that others also hold needs a copy (copy-on-write) by each table writing into
    it - except the last writer of the group, when nobody else (no other table, no table
    that writes nothing this step) still holds it: it finds the block no longer shared.
    """
    tables = list(tables)
    counts = [1] * len(tables) if counts is None else list(counts)
    new, writers = 0, {}
    for table, count in zip(tables, counts, strict=True):
        if count == 0:
            continue
        bs = table.block_size
        new += cdiv(table.num_tokens + count, bs) - cdiv(table.num_tokens, bs)
        if table.num_tokens % bs:
            last = table.blocks[-1]
            here, allocator = writers.get(last, (0, table.allocator))
            writers[last] = (here + 1, allocator)
    for block, (here, allocator) in writers.items():
        outside = allocator.refcount(block) > here
        new += here if outside else here - 1
    return new


def shared_prompt_blocks(prompt_len: int, tail_lens: list[int], block_size: int) -> int:
    """Free blocks for a prompt held once and shared by ``len(tail_lens)`` sequences, each
    of which then appends its own ``tail_lens[i]`` tokens.

    The prompt's blocks are counted once. Each tail takes the blocks past the prompt's;
    a part-filled last prompt block is copied (copy-on-write) by every sequence that
    writes into it, except the last holder, which finds it no longer shared.
    Example (block size 4): prompt 6, tails [3, 3] -> 2 + (1 + 1) + 1 copy = 5.
    """
    prompt = cdiv(prompt_len, block_size)
    new = sum(cdiv(prompt_len + t, block_size) - prompt for t in tail_lens)
    writers = sum(t > 0 for t in tail_lens)
    if prompt_len % block_size and writers:
        new += writers - 1 if writers == len(tail_lens) else writers
    return prompt + new


def num_required_blocks(group: SequenceGroup, block_size: int) -> int:
    """Free blocks a waiting group takes to run again, counting what its sequences share.

    A fresh request has one sequence (``n > 1`` samples fork from it after the prefill),
    so that is its text's blocks. A group of several sequences preempted by recompute
    gets its prompt back once, shared, plus each sequence's own generated tail
    (:func:`shared_prompt_blocks`). The scheduler's default admission hook
    (``EngineHooks(num_required_blocks=fn)``; vLLM's ``get_num_required_blocks``).
    """
    seqs = group.live_seqs()
    if len(seqs) == 1:
        return cdiv(seqs[0].num_tokens, block_size)
    prompt_len = len(group.prompt_token_ids)
    return shared_prompt_blocks(prompt_len, [s.num_tokens - prompt_len for s in seqs],
                                block_size)


class _LibraryHooks:
    """The block manager's hooks when none are given: the library's own (the same
    defaults as :class:`~paged_lib.engine.hooks.EngineHooks`, which imports this module)."""

    swap_mapping = staticmethod(swap_mapping)
    block_hashes = staticmethod(block_hashes)
    longest_cache_hit = staticmethod(longest_cache_hit)
    allocate_slots = staticmethod(allocate_slots)
    FreeBlockQueue = FreeBlockQueue
    BlockTable = BlockTable


class BlockManager:
    """Allocation decisions for the scheduler over a GPU pool and an optional CPU pool."""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, *,
                 enable_prefix_caching: bool = False, hooks=None):
        """``hooks``: an :class:`~paged_lib.engine.hooks.EngineHooks` (the block manager
        asks its ``swap_mapping``, ``block_hashes``, ``longest_cache_hit``,
        ``allocate_slots``, ``FreeBlockQueue`` and ``BlockTable``); ``None``, the
        library's own."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.hooks = hooks if hooks is not None else _LibraryHooks
        if not (isinstance(self.hooks.BlockTable, type)
                and issubclass(self.hooks.BlockTable, BlockTable)):
            raise ValueError(f"the BlockTable hook must be BlockTable or a subclass of it, got "
                             f"{self.hooks.BlockTable!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.gpu = (PrefixCachingAllocator(num_blocks, self.hooks.FreeBlockQueue)
                    if enable_prefix_caching else BlockAllocator(num_blocks))
        self.cpu = BlockAllocator(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self._asked: tuple[list[int], list] | None = None  # cache_hits' text and hashes

    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.gpu.num_blocks - self.gpu.num_free

    # ------------------------------------------------------------ prefill

    def allocate(self, seq: Sequence, num_tokens: int | None = None,
                 hits: list[int] = ()) -> list[Slot]:
        """A fresh GPU table for ``seq`` holding its first ``num_tokens`` tokens (default:
        all of them). The table adopts the cached blocks ``hits`` (:meth:`cache_hits`:
        its first ``len(hits)`` blocks, K/V already written, so ``seq.num_cached`` starts
        there); the slots returned are those of the tokens after them."""
        if seq.block_table is not None:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        count = seq.num_tokens if num_tokens is None else num_tokens
        asked, self._asked = self._asked, None
        if asked is not None and seq.token_ids[:len(asked[0])] == asked[0]:
            return self._allocate_slots(seq, asked, count, list(hits))
        for block in hits:  # out of the free queue first: allocate() must not evict them
            self.gpu.touch(block)
        table = self.hooks.BlockTable(self.gpu, self.block_size, hits, len(hits) * self.block_size)
        seq.block_table = table
        seq.num_cached = table.num_tokens
        return [table.append_token() for _ in range(count - table.num_tokens)]

    def _allocate_slots(self, seq: Sequence, asked: tuple[list[int], list], count: int,
                        hits: list[int]) -> list[Slot]:
        """The ``allocate_slots`` hook makes the table of the text ``cache_hits`` was
        asked about; its answer is checked before the engine relies on it."""
        bs, pool, (text, hashes) = self.block_size, self.gpu, asked
        got = self.hooks.allocate_slots(pool, list(text), list(hashes), bs,
                                        count - len(hits) * bs)
        if not (isinstance(got, tuple | list) and len(got) == 2
                and isinstance(got[0], list | tuple)):
            raise ValueError(f"allocate_slots returned {got!r}: expected (blocks, "
                             "num_computed_tokens)")
        blocks, computed = list(got[0]), got[1]
        story = (f"allocate_slots for a text of {len(text)} tokens whose first {len(hits)} "
                 f"blocks are cached in {hits}, {count - len(hits) * bs} tokens to compute "
                 f"now (block size {bs}), returned {got!r}")
        if computed != len(hits) * bs or blocks[:len(hits)] != hits \
                or len(blocks) != cdiv(count, bs):
            raise ValueError(f"{story}: expected {cdiv(count, bs)} blocks starting with the "
                             f"hits {hits}, and {len(hits) * bs} tokens computed")
        if any(pool.refcount(b) < 1 or b in pool.free_block_queue for b in blocks):
            raise ValueError(f"{story}: every block of the table must be held (ref count "
                             "at least 1) and out of the free queue")
        if [pool.block_hash.get(b) for b in blocks[:count // bs]] != hashes[:count // bs]:
            raise ValueError(f"{story}: the full blocks it fills must be cached under their "
                             "hashes when scheduled")
        table = self.hooks.BlockTable(pool, bs, blocks, count)
        seq.block_table, seq.num_cached = table, computed
        return [Slot(blocks[p // bs], p % bs) for p in range(computed, count)]

    # ------------------------------------------------------------ prefix caching (ch. 10)

    def cache_hits(self, token_ids: list[int]) -> list[int]:
        """The cached blocks a new table for ``token_ids`` can adopt: the
        ``longest_cache_hit`` hook over the ``block_hashes`` hook's hashes (``[]`` with
        prefix caching off). Pure: nothing changes until :meth:`allocate` takes them."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hashes = self.hooks.block_hashes(token_ids, bs)
        _check_hashes(hashes, len(token_ids) // bs, bs)
        self._asked = (list(token_ids), list(hashes))  # for allocate's allocate_slots
        hits = list(self.hooks.longest_cache_hit(hashes, self.gpu.lookup, len(token_ids), bs))
        want = [self.gpu.lookup(h) for h in hashes[:len(hits)]]
        if hits != want or len(hits) > max(len(token_ids) - 1, 0) // bs:
            raise ValueError(f"longest_cache_hit returned blocks {hits} for {len(token_ids)} "
                             f"tokens; the cached blocks of their leading hashes are {want} "
                             f"(at most (num_tokens - 1) // block_size of them)")
        return hits

    def hits_taken_from_free(self, hits: list[int]) -> int:
        """Free blocks that adopting ``hits`` takes: a hit on a free (cached) block takes
        it out of the free queue."""
        return sum(self.gpu.refcount(b) == 0 for b in hits)

    def check_allocation_fits(self, request_id: int, need: int, tokens: int,
                              hits: list[int]) -> None:
        """An admitted request's blocks must really be free: a ``num_required_blocks``
        hook that counts too few would make the allocation fail half way."""
        now = cdiv(tokens, self.block_size) - len(hits) + self.hits_taken_from_free(hits)
        if now > self.num_free_blocks:
            raise ValueError(f"num_required_blocks said request {request_id} needs "
                             f"{need} blocks, but its {tokens} tokens alone take {now} and only "
                             f"{self.num_free_blocks} are free: count every "
                             "block, a part-filled last one too")

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full blocks among ``seq``'s first ``num_tokens`` tokens (those
        whose K/V is written by the end of this step) when this step fills one.

        Called when the tokens are *scheduled* (as vLLM v1's ``allocate_slots``): a
        request admitted later in the same step hits them, which is sound because every
        layer writes the whole step's K/V before any attention reads it. A block whose
        hash another block already holds is cached too (vLLM's duplicated blocks: both
        stay findable, so evicting one does not lose the prefix)."""
        table, bs = seq.block_table, self.block_size
        if (not self.enable_prefix_caching or table is None or table.allocator is not self.gpu
                or num_tokens // bs <= seq.num_cached // bs):
            return
        full = num_tokens // bs
        hashes = self.hooks.block_hashes(seq.token_ids[:full * bs], bs)
        _check_hashes(hashes, full, bs)
        for block, h in zip(table.blocks[:full], hashes, strict=True):
            if self.gpu.block_hash.get(block) != h:
                self.gpu.cache_block(block, h)

    def fork_prompt(self, group: SequenceGroup) -> None:
        """Give every live sequence without a table a fork of the first one's (the cached
        prompt): shared blocks, ref counts up, nothing allocated."""
        seqs = group.live_seqs()
        for seq in seqs[1:]:
            seq.block_table = seqs[0].block_table.fork()
            seq.num_cached = seqs[0].num_cached

    # ------------------------------------------------------------ decode

    def blocks_to_append(self, seqs: list[Sequence], counts: list[int]) -> int:
        """Free blocks appending ``counts[i]`` tokens to ``seqs[i]``'s table takes."""
        return append_blocks_needed([s.block_table for s in seqs], counts)

    def append_slot(self, seq: Sequence) -> Slot:
        """The slot of ``seq``'s next token (copy-on-write if its last block is shared)."""
        return seq.block_table.append_token()

    def free(self, seq: Sequence) -> None:
        """Give back ``seq``'s blocks (ref counts down; a block shared stays in use)."""
        if seq.block_table is not None:
            seq.block_table.free()
            seq.block_table = None

    # ------------------------------------------------------------ swapping (chapter 07)

    def distinct_blocks(self, group: SequenceGroup) -> int:
        """Blocks a group holds, a shared block counted once (what a swap copies)."""
        return len({b for s in group.live_seqs() for b in s.block_table.blocks})

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return self.cpu is not None and self.distinct_blocks(group) <= self.cpu.num_free

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's tables to the CPU pool; ``(gpu, cpu)`` blocks to copy."""
        if self.cpu is None:
            raise ValueError("no CPU pool: create the engine with num_cpu_blocks > 0")
        return self._move(group, self.cpu)

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's tables back to the GPU pool; ``(cpu, gpu)`` blocks to copy."""
        return self._move(group, self.gpu)

    def _move(self, group: SequenceGroup, dst: BlockAllocator) -> list[tuple[int, int]]:
        seqs = group.live_seqs()
        needed = self.distinct_blocks(group)
        if needed > dst.num_free:
            raise OutOfBlocks(needed, dst.num_free, dst.num_blocks)
        tables = [s.block_table.blocks for s in seqs]
        pairs = self.hooks.swap_mapping(tables, dst.allocate)
        mapping = dict(pairs)
        _check_mapping(tables, pairs, mapping)
        old_tables = [s.block_table for s in seqs]
        for seq, blocks in zip(seqs, tables, strict=True):
            new_blocks = [mapping[b] for b in blocks]
            for b in new_blocks:  # each table holds one reference to each of its blocks
                dst.incref(b)
            seq.block_table = self.hooks.BlockTable(dst, self.block_size, new_blocks,
                                             seq.block_table.num_tokens)
        for dst_block in mapping.values():  # drop allocate()'s own reference
            dst.free(dst_block)
        for table in old_tables:  # the source blocks go back to their pool
            table.free()
        return pairs


def _check_mapping(tables: list[list[int]], pairs: list[tuple[int, int]],
                   mapping: dict[int, int]) -> None:
    """A swap mapping must copy every distinct source block exactly once."""
    sources = {b for t in tables for b in t}
    if len(pairs) != len(mapping) or set(mapping) != sources:
        raise ValueError(f"swap mapping {pairs} must name each block of {tables} exactly once "
                         "as a source (shared blocks too: copied once)")
    if len(set(mapping.values())) != len(mapping):
        raise ValueError(f"swap mapping {pairs} sends two blocks to one destination")


def _check_hashes(hashes: list, full: int, block_size: int) -> None:
    if len(hashes) != full:
        raise ValueError(f"block_hashes gave {len(hashes)} hashes for {full} full blocks "
                         f"of {block_size} tokens: one per full block, none for a "
                         "part-filled one")
