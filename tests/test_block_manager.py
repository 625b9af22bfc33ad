"""The block manager without a model: counts before changes, swaps that keep sharing, no leaks."""

import random

import pytest

from paged_lib.blocks import BlockAllocator, BlockTable
from paged_lib.engine.block_manager import (
    BlockManager,
    append_blocks_needed,
    num_required_blocks,
    shared_prompt_blocks,
    swap_mapping,
)
from paged_lib.engine.hooks import EngineHooks
from paged_lib.engine.sequence import SamplingParams, Sequence, SequenceGroup


def counter(start=0):
    nxt = iter(range(start, 10_000))
    return lambda: next(nxt)


def test_swap_mapping_copies_shared_blocks_once_in_order():
    assert swap_mapping([[7, 3], [7, 5]], counter()) == [(7, 0), (3, 1), (5, 2)]
    assert swap_mapping([], counter()) == []
    assert swap_mapping([[4], [4], [4]], counter(9)) == [(4, 9)]


def test_append_blocks_needed_matches_what_appending_takes():
    """Random forks and appends: the count asked beforehand is exactly what it costs."""
    rng = random.Random(0)
    for trial in range(200):
        alloc = BlockAllocator(200)
        tables = [BlockTable(alloc, 4)]
        for _ in range(rng.randint(0, 9)):
            tables[0].append_token()
        for _ in range(rng.randint(0, 3)):
            tables.append(rng.choice(tables).fork())
        for _ in range(rng.randint(0, 3)):
            t = rng.choice(tables)
            for _ in range(rng.randint(0, 5)):
                t.append_token()
        group = rng.sample(tables, rng.randint(1, len(tables)))
        free_before = alloc.num_free
        predicted = append_blocks_needed(group)
        for t in group:
            t.append_token()
        assert free_before - alloc.num_free == predicted, f"trial {trial}"


def group_of(tables_tokens, bm: BlockManager) -> SequenceGroup:
    """A running group whose first sequence holds ``n`` tokens; the others fork it and
    append their own tokens."""
    first, *forks = tables_tokens
    root = Sequence(0, list(range(first)))
    bm.allocate(root)
    seqs = [root]
    for k, extra in enumerate(forks, start=1):
        s = Sequence(k, list(range(first)), block_table=root.block_table.fork())
        for _ in range(extra):
            s.output_token_ids.append(0)
            s.block_table.append_token()
        seqs.append(s)
    return SequenceGroup(0, seqs, SamplingParams(max_tokens=4, temperature=1.0, n=len(seqs)))


def test_swap_out_and_in_keeps_sharing_and_leaks_nothing():
    bm = BlockManager(num_blocks=16, block_size=4, num_cpu_blocks=16)
    group = group_of([10, 3, 0], bm)  # prompt of 10 tokens (3 blocks), two forks
    before = [s.block_table.blocks for s in group.seqs]
    distinct = len({b for t in before for b in t})
    # 3 prompt blocks shared; fork 1 copied the part-filled third on write and took a 4th
    assert bm.distinct_blocks(group) == distinct == 5
    out = bm.swap_out(group)
    assert len(out) == distinct and {g for g, _ in out} == {b for t in before for b in t}
    assert bm.num_free_blocks == 16 and bm.cpu.num_free == 16 - distinct
    back = bm.swap_in(group)
    cpu_to_gpu = dict(back)
    assert len(back) == distinct and bm.cpu.num_free == 16
    after = [s.block_table.blocks for s in group.seqs]
    # the same sharing pattern, through the two mappings
    to_cpu = dict(out)
    assert after == [[cpu_to_gpu[to_cpu[b]] for b in t] for t in before]
    for b in {b for t in after for b in t}:
        assert bm.gpu.refcount(b) == sum(t.count(b) for t in after)
    for s in group.seqs:
        bm.free(s)
    assert bm.num_free_blocks == 16


def test_a_wrong_swap_mapping_is_refused():
    bm = BlockManager(8, 4, 8, hooks=EngineHooks(swap_mapping=lambda tables, alloc: [
        (b, alloc()) for t in tables for b in t]))  # copies a shared block twice
    group = group_of([6, 0], bm)
    with pytest.raises(ValueError, match="exactly once"):
        bm.swap_out(group)


def test_swap_needs_a_cpu_pool():
    bm = BlockManager(8, 4)
    group = group_of([3], bm)
    assert not bm.can_swap_out(group)
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        bm.swap_out(group)


def test_shared_prompt_blocks_is_what_a_shared_recompute_takes():
    """Prompt once, then fork and append each tail: the count is exactly the cost."""
    assert shared_prompt_blocks(6, [3, 3], 4) == 5  # the docstring's example
    assert shared_prompt_blocks(64, [25] * 4, 4) == 16 + 4 * 7  # no part-filled block
    rng = random.Random(3)
    for _ in range(300):
        prompt_len, bs = rng.randint(1, 13), rng.choice([1, 2, 4, 5])
        tails = [rng.randint(0, 9) for _ in range(rng.randint(1, 4))]
        alloc = BlockAllocator(500)
        first = BlockTable(alloc, bs)
        for _ in range(prompt_len):
            first.append_token()
        tables = [first] + [first.fork() for _ in tails[1:]]
        for table, tail in zip(tables, tails, strict=True):
            for _ in range(tail):
                table.append_token()
        assert 500 - alloc.num_free == shared_prompt_blocks(prompt_len, tails, bs), \
            (prompt_len, bs, tails)


def test_num_required_blocks_counts_a_resumed_groups_prompt_once():
    params = SamplingParams(max_tokens=30, temperature=1.0, n=4)
    fresh = SequenceGroup(0, [Sequence(0, list(range(64)))], params)
    assert num_required_blocks(fresh, 4) == 16  # one sequence: the samples fork later
    resumed = SequenceGroup(1, [Sequence(i, list(range(64)), [1] * 25) for i in range(4)],
                            params)
    assert num_required_blocks(resumed, 4) == 16 + 4 * 7  # not 4 * 23 = 92
