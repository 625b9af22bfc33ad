"""Block allocator and block tables: unit tests plus a stateful property test.

The property test drives random create / append / fork / free sequences and keeps a
model of physical memory: every token id is written into a simulated pool
``[num_blocks][block_size]`` at the slot ``append_token`` returns (copying a block first
when ``Slot.copy`` says so). After every step each live table must read back exactly
its own tokens, which is what a kernel reading through the table would see.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from paged_lib.blocks import BlockAllocator, BlockTable, OutOfBlocks, Slot
from paged_lib.course.grading.toy_pool import busy_pool


def grow(table: BlockTable, n: int) -> list[Slot]:
    return [table.append_token() for _ in range(n)]


# ---------------------------------------------------------------- the allocator


def test_allocator_hands_out_blocks_in_free_list_order_and_reuses_oldest_freed():
    allocator = BlockAllocator(4)
    assert [allocator.allocate() for _ in range(3)] == [0, 1, 2]
    allocator.free(1)
    allocator.free(0)
    assert list(allocator.free_block_ids) == [3, 1, 0]
    assert [allocator.allocate() for _ in range(3)] == [3, 1, 0]
    assert allocator.num_free == 0


def test_ref_counts_follow_incref_and_free():
    allocator = BlockAllocator(2)
    b = allocator.allocate()
    allocator.incref(b)
    assert allocator.refcount(b) == 2
    allocator.free(b)
    assert allocator.refcount(b) == 1 and allocator.num_free == 1
    allocator.free(b)
    assert allocator.refcount(b) == 0 and allocator.num_free == 2


def test_out_of_blocks_says_what_was_needed_and_what_is_free():
    allocator = BlockAllocator(64)
    for _ in range(64):
        allocator.allocate()
    with pytest.raises(OutOfBlocks, match=r"^need 1 block, 0 free \(pool of 64\)$") as info:
        allocator.allocate()
    assert (info.value.needed, info.value.num_free, info.value.num_blocks) == (1, 0, 64)
    assert isinstance(info.value, RuntimeError)
    assert "need 3 blocks, 1 free (pool of 64)" == str(OutOfBlocks(3, 1, 64))


@pytest.mark.parametrize("num_blocks", [0, -3])
def test_pool_needs_a_block(num_blocks):
    with pytest.raises(ValueError, match="at least 1 block"):
        BlockAllocator(num_blocks)


def test_double_free_raises_and_changes_nothing():
    allocator = BlockAllocator(3)
    b = allocator.allocate()
    allocator.free(b)
    before = (list(allocator.free_block_ids), list(allocator.ref_counts))
    with pytest.raises(ValueError, match="block 0 is already free"):
        allocator.free(b)
    assert (list(allocator.free_block_ids), list(allocator.ref_counts)) == before


@pytest.mark.parametrize("block", [-1, 3, 100])
@pytest.mark.parametrize("method", ["free", "incref", "refcount"])
def test_unknown_block_is_rejected(method, block):
    allocator = BlockAllocator(3)
    allocator.allocate()
    with pytest.raises(ValueError, match=rf"unknown block {block}: this pool has blocks 0..2"):
        getattr(allocator, method)(block)
    assert allocator.ref_counts == [1, 0, 0]


def test_incref_of_a_free_block_raises():
    allocator = BlockAllocator(2)
    with pytest.raises(ValueError, match="cannot incref block 1: it is free"):
        allocator.incref(1)
    assert allocator.ref_counts == [0, 0]


# ---------------------------------------------------------------- the block table


def test_worked_example_40_tokens_in_blocks_5_2_9():
    """Chapter 03's example: 40 tokens, block size 16 -> blocks 5, 2, 9 filled 16, 16, 8."""
    allocator = busy_pool(12, (5, 2, 9))
    table = BlockTable(allocator, block_size=16)
    slots = grow(table, 40)
    assert table.blocks == [5, 2, 9]
    assert table.num_tokens == 40 and table.last_block_fill == 8
    assert slots[0] == Slot(5, 0) and slots[15] == Slot(5, 15)
    assert slots[16] == Slot(2, 0) and slots[39] == Slot(9, 7)
    assert allocator.num_free == 0


def test_blocks_are_taken_only_when_a_token_needs_one():
    allocator = BlockAllocator(8)
    table = BlockTable(allocator, block_size=4)
    used = []
    for _ in range(9):
        table.append_token()
        used.append(8 - allocator.num_free)
    assert used == [1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert table.last_block_fill == 1


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size must be at least 1, got 0"):
        BlockTable(BlockAllocator(4), 0)


def test_fork_shares_every_block_and_allocates_nothing():
    allocator = BlockAllocator(8)
    parent = BlockTable(allocator, block_size=4)
    grow(parent, 6)
    child = parent.fork()
    assert child.blocks == parent.blocks == [0, 1]
    assert child.num_tokens == 6
    assert allocator.ref_counts[:2] == [2, 2] and allocator.num_free == 6


def test_copy_on_write_when_the_last_block_is_shared():
    allocator = BlockAllocator(8)
    parent = BlockTable(allocator, block_size=4)
    grow(parent, 6)  # blocks [0, 1], fill 4 + 2
    child = parent.fork()
    assert child.append_token() == Slot(block=2, offset=2, copy=(1, 2))
    assert child.blocks == [0, 2] and parent.blocks == [0, 1]
    assert allocator.ref_counts[:3] == [2, 1, 1]
    # Block 1 is the parent's alone now: it writes in place.
    assert parent.append_token() == Slot(block=1, offset=2)


def test_a_shared_full_last_block_needs_no_copy():
    allocator = BlockAllocator(4)
    parent = BlockTable(allocator, block_size=2)
    grow(parent, 2)
    child = parent.fork()
    assert child.append_token() == Slot(block=1, offset=0)
    assert allocator.ref_counts[:2] == [2, 1]


def test_out_of_blocks_leaves_table_and_allocator_unchanged():
    allocator = BlockAllocator(2)
    parent = BlockTable(allocator, block_size=2)
    grow(parent, 3)  # blocks [0, 1], pool now empty
    child = parent.fork()
    before = (child.blocks, child.num_tokens, list(allocator.ref_counts),
              list(allocator.free_block_ids))
    with pytest.raises(OutOfBlocks, match=r"need 1 block, 0 free \(pool of 2\)"):
        child.append_token()  # copy-on-write needs a block
    assert (child.blocks, child.num_tokens, list(allocator.ref_counts),
            list(allocator.free_block_ids)) == before
    with pytest.raises(OutOfBlocks):
        grow(parent, 2)  # parent's block 1 is shared too
    assert parent.num_tokens == 3


def test_free_returns_blocks_tail_first_and_keeps_shared_ones():
    allocator = BlockAllocator(6)
    parent = BlockTable(allocator, block_size=2)
    grow(parent, 6)  # blocks [0, 1, 2]
    child = parent.fork()
    child.free()
    assert allocator.ref_counts[:3] == [1, 1, 1] and allocator.num_free == 3
    parent.free()
    assert list(allocator.free_block_ids) == [3, 4, 5, 2, 1, 0]
    assert parent.blocks == [] and parent.num_tokens == 0


@pytest.mark.parametrize("use", [lambda t: t.append_token(), lambda t: t.fork(),
                                 lambda t: t.free()], ids=["append_token", "fork", "free"])
def test_a_freed_table_cannot_be_used(use):
    table = BlockTable(BlockAllocator(2), block_size=2)
    table.append_token()
    table.free()
    with pytest.raises(ValueError, match="this BlockTable was freed"):
        use(table)


def test_repr_names_blocks_and_tokens():
    table = BlockTable(busy_pool(12, (5, 2, 9)), block_size=16)
    grow(table, 40)
    assert repr(table) == "BlockTable(blocks=[5, 2, 9], num_tokens=40, block_size=16)"


# ---------------------------------------------------------------- property test


class PagedMemory(RuleBasedStateMachine):
    """Random create / append / fork / free against a model of physical memory."""

    tables = Bundle("tables")

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # id(table) -> token ids written to it
        self.objects: dict[int, BlockTable] = {}  # live tables (freed ones stay in the
        # bundle, so ids are never reused; rules on them must raise ValueError)
        self.next_token = 0

    @initialize(target=tables, num_blocks=st.integers(1, 32),
                block_size=st.sampled_from([4, 2, 3, 1]), prompt_len=st.integers(1, 6))
    def make_pool(self, num_blocks, block_size, prompt_len):
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.pool: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        return self.create(prompt_len)

    def _track(self, table: BlockTable, tokens: list[int]) -> BlockTable:
        self.live[id(table)] = tokens
        self.objects[id(table)] = table
        return table

    def _state(self, table: BlockTable) -> tuple:
        return (table.blocks, table.num_tokens, list(self.allocator.ref_counts),
                list(self.allocator.free_block_ids))

    @rule(target=tables, prompt_len=st.integers(1, 6))
    def create(self, prompt_len):
        table = self._track(BlockTable(self.allocator, self.block_size), [])
        self._append(table, prompt_len)
        return table

    @rule(table=tables, n=st.integers(1, 4))
    def append(self, table, n):
        if id(table) not in self.live:
            with pytest.raises(ValueError, match="freed"):
                table.append_token()
            return
        self._append(table, n)

    def _append(self, table: BlockTable, n: int) -> None:
        """Append up to ``n`` tokens, writing each into the model pool; stop at OutOfBlocks."""
        for _ in range(n):
            before = self._state(table)
            needs_block = table.num_tokens % self.block_size == 0 or \
                self.allocator.refcount(table.blocks[-1]) > 1
            try:
                slot = table.append_token()
            except OutOfBlocks:
                assert needs_block and self.allocator.num_free == 0
                assert self._state(table) == before
                return
            assert 0 <= slot.offset < self.block_size
            if slot.copy is not None:
                src, dst = slot.copy
                assert dst == slot.block and src != dst
                self.pool[dst] = list(self.pool[src])
            self.pool[slot.block][slot.offset] = self.next_token
            self.live[id(table)].append(self.next_token)
            self.next_token += 1

    @rule(target=tables, table=tables, n=st.integers(0, 3))
    def fork(self, table, n):
        """Fork (as parallel sampling does), then the child decodes ``n`` tokens."""
        if id(table) not in self.live:
            with pytest.raises(ValueError, match="freed"):
                table.fork()
            return self._track(BlockTable(self.allocator, self.block_size), [])
        num_free = self.allocator.num_free
        child = table.fork()
        assert self.allocator.num_free == num_free
        self._track(child, list(self.live[id(table)]))
        self._append(child, n)
        return child

    @rule(table=tables)
    def free(self, table):
        if id(table) not in self.live:
            with pytest.raises(ValueError, match="freed"):
                table.free()
            return
        table.free()
        del self.live[id(table)], self.objects[id(table)]

    @invariant()
    def tables_read_back_their_own_tokens(self):
        if not hasattr(self, "allocator"):
            return
        bs = self.block_size
        for key, tokens in self.live.items():
            table = self.objects[key]
            assert table.num_tokens == len(tokens)
            assert len(table.blocks) == -(-len(tokens) // bs)
            read = [self.pool[table.blocks[t // bs]][t % bs] for t in range(len(tokens))]
            assert read == tokens

    @invariant()
    def ref_counts_count_holders_and_free_list_is_consistent(self):
        if not hasattr(self, "allocator"):
            return
        holders = [0] * self.allocator.num_blocks
        for table in self.objects.values():
            assert len(set(table.blocks)) == len(table.blocks)
            for b in table.blocks:
                holders[b] += 1
        assert [self.allocator.refcount(b) for b in range(len(holders))] == holders
        free = list(self.allocator.free_block_ids)
        assert len(free) == len(set(free)) == self.allocator.num_free
        assert set(free) == {b for b, n in enumerate(holders) if n == 0}

    def teardown(self):
        if not hasattr(self, "allocator"):
            return
        for table in self.objects.values():
            table.free()
        assert self.allocator.num_free == self.allocator.num_blocks
        assert not any(self.allocator.ref_counts)


PagedMemory.TestCase.settings = settings(
    max_examples=300, stateful_step_count=25, derandomize=True, deadline=None)
TestPagedMemory = PagedMemory.TestCase


# ---------------------------------------------------------------- pictures


@pytest.fixture
def close_figures():
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


def test_draw_pool_of_the_worked_example(close_figures):
    from matplotlib.figure import Figure

    from paged_lib.course.viz import blocks as viz

    allocator = busy_pool(12, (5, 2, 9))
    table = BlockTable(allocator, 16)
    grow(table, 40)
    state = viz.snapshot({"A": table}, allocator, "40 tokens")
    assert state.tables == {"A": ([5, 2, 9], 40)} and state.free_block_ids == []
    assert viz.block_fills(state) == {5: 16, 2: 16, 9: 8}
    fig = viz.draw_pool(state)
    assert isinstance(fig, Figure)
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert {"L0→#5", "L1→#2", "L2→#9", "16/16", "8/16", "#11", "40 tokens"} <= texts | {
        fig.axes[0].get_title(loc="left")}
    assert isinstance(viz.draw_block_tables({"A": table}, allocator), Figure)


def test_pictures_show_ref_counts_of_shared_blocks(close_figures):
    from paged_lib.course.viz import blocks as viz

    allocator = BlockAllocator(6)
    parent = BlockTable(allocator, 4)
    grow(parent, 6)
    child = parent.fork()
    texts = [t.get_text() for t in viz.draw_block_tables(
        {"parent": parent, "child": child}, allocator).axes[0].texts]
    assert texts.count("ref 2") == 2 and "free list (next first): 2 3 4 5" in texts
    with pytest.raises(ValueError, match="share a block size"):
        viz.snapshot({"a": parent, "b": BlockTable(allocator, 2)}, allocator)


def test_grow_requests_takes_and_returns_blocks(close_figures):
    from paged_lib.course.viz import blocks as viz

    states = list(viz.grow_requests())
    assert states[0].tables == {} and states[-1].free_block_ids != []
    assert sorted(states[-1].free_block_ids) == list(range(5))
    assert any("waits (need 1 block, 0 free (pool of 5))" in s.caption for s in states)
    assert any("finished" in s.caption for s in states)
    owners: dict[int, set[str]] = {}
    for s in states:
        holders = [0] * s.num_blocks
        for name, (blocks, _) in s.tables.items():
            for b in blocks:
                holders[b] += 1
                owners.setdefault(b, set()).add(name)
        assert holders == s.ref_counts
        assert sorted(s.free_block_ids) == [b for b in range(s.num_blocks) if not holders[b]]
    assert any(len(names) > 1 for names in owners.values())  # a returned block was reused
    fig = viz.draw_frames([states[1], states[-1]])
    assert len(fig.axes) == 2


def test_grow_requests_reports_a_pool_too_small():
    from paged_lib.course.viz import blocks as viz

    with pytest.raises(RuntimeError, match="every request waits for a block"):
        list(viz.grow_requests(num_blocks=4))


def test_stepper_replays_states(close_figures):
    import ipywidgets

    from paged_lib.course.viz import blocks as viz

    states = list(viz.grow_requests())
    widget = viz.stepper(states)
    assert isinstance(widget, ipywidgets.VBox)
    play, slider = widget.children[0].children
    assert slider.max == play.max == len(states) - 1
    slider.value = 7  # redraws without error


# ---------------------------------------------------------------- adopting, blocks_needed


def test_a_table_adopts_blocks_without_counting_them():
    allocator = BlockAllocator(4)
    blocks = [allocator.allocate(), allocator.allocate()]
    table = BlockTable(allocator, 4, blocks, 6)
    blocks.append(99)  # the table keeps its own copy
    assert table.blocks == [0, 1] and table.num_tokens == 6 and table.last_block_fill == 2
    assert allocator.ref_counts[:2] == [1, 1]
    assert table.append_token() == Slot(1, 2)
    with pytest.raises(ValueError, match="6 tokens at block size 4 need 2 blocks, got 1"):
        BlockTable(allocator, 4, [0], 6)


def test_fork_keeps_the_subclass():
    class Mine(BlockTable):
        pass

    table = Mine(BlockAllocator(4), 2)
    grow(table, 3)
    assert type(table.fork()) is Mine


@pytest.mark.parametrize("tokens, shared, new, want", [
    (0, False, 1, 1), (0, False, 0, 0), (3, False, 1, 0), (4, False, 1, 1),
    (3, True, 1, 1), (3, True, 2, 2), (4, True, 1, 1), (2, True, 7, 3),
])
def test_blocks_needed_counts_copy_on_write(tokens, shared, new, want):
    allocator = BlockAllocator(16)
    table = BlockTable(allocator, 4)
    grow(table, tokens)
    if shared:
        table.fork()
    assert table.blocks_needed(new) == want
    free = allocator.num_free
    grow(table, new)
    assert free - allocator.num_free == want  # what appending really took


def test_learner_tables_drive_the_pictures():
    from paged_lib.course.viz import blocks as viz

    class Mine(BlockTable):
        pass

    assert list(viz.grow_requests(table_cls=Mine)) == list(viz.grow_requests())
    frames = viz.fork_and_write(table_cls=Mine, allocator=BlockAllocator(8))
    assert frames == viz.fork_and_write()
    assert [s.ref_counts[:4] for s in frames] == [
        [1, 1, 0, 0], [3, 3, 0, 0], [3, 2, 1, 0], [3, 1, 1, 1], [3, 1, 1, 1]]
    assert "copy block 1 into block 2" in frames[2].caption
    assert "write in place" in frames[4].caption
