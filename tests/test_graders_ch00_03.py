"""Graders of chapters 00-03 against typical wrong answers.

Each wrong answer is a mistake learners make (or a small bug planted in the solution);
its grader must print ❌ with a hint that names the mistake, and the solution ✅.
"""

from __future__ import annotations

import pytest

from paged_lib.blocks import BlockTable, Slot
from paged_lib.grading import ch03


def verdict(capsys, check, answer) -> str:
    check(answer)
    out = capsys.readouterr().out
    assert out.count("\n") <= 2, out  # one verdict line, at most one hint line
    return out


# ---------------------------------------------------------------- 03.1 append_token


def append_ok(table):
    offset = table._num_tokens % table.block_size
    copy = None
    if offset == 0:
        table._blocks.append(table.allocator.allocate())
    elif table.allocator.refcount(table._blocks[-1]) > 1:
        src, dst = table._blocks[-1], table.allocator.allocate()
        table.allocator.free(src)
        table._blocks[-1] = dst
        copy = (src, dst)
    table._num_tokens += 1
    return Slot(table._blocks[-1], offset, copy)


def append_stray_incref(table):
    offset = table._num_tokens % table.block_size
    if offset == 0:
        block = table.allocator.allocate()
        table.allocator.incref(block)
        table._blocks.append(block)
        table._num_tokens += 1
        return Slot(block, 0)
    return append_ok(table)


def append_junk_copy(table):
    slot = append_ok(table)
    return Slot(slot.block, slot.offset, slot.copy and slot.copy[::-1])


def append_copy_in_place(table):
    slot = append_ok(table)
    return Slot(slot.block, slot.offset, slot.copy or (slot.block, slot.block))


def append_no_cow(table):
    offset = table._num_tokens % table.block_size
    if offset == 0:
        table._blocks.append(table.allocator.allocate())
    table._num_tokens += 1
    return Slot(table._blocks[-1], offset)


def append_keeps_shared(table):
    offset = table._num_tokens % table.block_size
    if offset and table.allocator.refcount(table._blocks[-1]) > 1:
        src, dst = table._blocks[-1], table.allocator.allocate()
        table._blocks[-1] = dst
        table._num_tokens += 1
        return Slot(dst, offset, (src, dst))
    return append_ok(table)


def append_not_atomic(table):
    offset = table._num_tokens % table.block_size
    if offset and table.allocator.refcount(table._blocks[-1]) > 1:
        src = table._blocks[-1]
        table.allocator.free(src)
        dst = table.allocator.allocate()
        table._blocks[-1] = dst
        table._num_tokens += 1
        return Slot(dst, offset, (src, dst))
    return append_ok(table)


def append_copies_full_block(table):
    offset = table._num_tokens % table.block_size
    if table._blocks and table.allocator.refcount(table._blocks[-1]) > 1:
        src, dst = table._blocks[-1], table.allocator.allocate()
        table.allocator.free(src)
        if offset == 0:
            table._blocks.append(dst)
        else:
            table._blocks[-1] = dst
        table._num_tokens += 1
        return Slot(dst, offset, (src, dst))
    return append_ok(table)


def append_flipped_compare(table):
    offset = table._num_tokens % table.block_size
    copy = None
    if offset == 0:
        table._blocks.append(table.allocator.allocate())
    elif table.allocator.refcount(table._blocks[-1]) >= 1:
        src, dst = table._blocks[-1], table.allocator.allocate()
        table.allocator.free(src)
        table._blocks[-1] = dst
        copy = (src, dst)
    table._num_tokens += 1
    return Slot(table._blocks[-1], offset, copy)


def append_off_by_one(table):
    offset = (table._num_tokens + 1) % table.block_size
    if offset == 0:
        table._blocks.append(table.allocator.allocate())
    table._num_tokens += 1
    return Slot(table._blocks[-1] if table._blocks else -1, offset)


def append_no_count(table):
    slot = append_ok(table)
    table._num_tokens -= 1
    return slot


def todo(*args):
    raise NotImplementedError()


@pytest.mark.parametrize("answer, hint", [
    (append_stray_incref, "a stray incref"),
    (append_junk_copy, "copy=(src, dst): src is the shared block"),
    (append_copy_in_place, "nothing is copied (copy=None)"),
    (append_no_cow, "is shared (ref count > 1) and part-filled"),
    (append_keeps_shared, "drop its reference"),
    (append_not_atomic, "not atomic"),
    (append_copies_full_block, "starts a new block: nothing is written into the old"),
    (append_flipped_compare, "write in place, copy=None"),
    (append_off_by_one, "count the tokens before it"),
    (append_no_count, "num_tokens += 1"),
])
def test_03_1_wrong_answers_get_a_named_hint(capsys, answer, hint):
    out = verdict(capsys, ch03.check_append_token, answer)
    assert out.startswith("❌ [03.1]") and hint in out, out


def test_03_1_solution_passes_and_stub_is_not_attempted(capsys):
    assert verdict(capsys, ch03.check_append_token, append_ok).startswith("✅ [03.1]")
    assert verdict(capsys, ch03.check_append_token, todo).startswith("⏳ [03.1]")
    assert verdict(capsys, ch03.check_append_token, BlockTable.append_token).startswith("✅")


# ---------------------------------------------------------------- 03.2 fork


def fork_ok(table):
    for block in table.blocks:
        table.allocator.incref(block)
    return type(table)(table.allocator, table.block_size, table.blocks, table.num_tokens)


def fork_no_incref(table):
    return type(table)(table.allocator, table.block_size, table.blocks, table.num_tokens)


def fork_incref_last_only(table):
    if table.blocks:
        table.allocator.incref(table.blocks[-1])
    return fork_no_incref(table)


def fork_alias(table):
    child = fork_ok(table)
    child._blocks = table._blocks
    return child


def fork_copies(table):
    blocks = [table.allocator.allocate() for _ in table.blocks]
    return type(table)(table.allocator, table.block_size, blocks, table.num_tokens)


def fork_plain_class(table):
    for block in table.blocks:
        table.allocator.incref(block)
    return BlockTable(table.allocator, table.block_size, table.blocks, table.num_tokens)


@pytest.mark.parametrize("answer, hint", [
    (fork_no_incref, "incref every block"),
    (fork_incref_last_only, "incref every block"),
    (fork_alias, "its own copy of the block list"),
    (fork_copies, "fork allocates nothing"),
    (lambda t: t, "returned the parent itself"),
    (lambda t: [], "expected a BlockTable"),
    (fork_plain_class, "type(table)"),
])
def test_03_2_wrong_answers_get_a_named_hint(capsys, answer, hint):
    out = verdict(capsys, ch03.check_fork, answer)
    assert out.startswith("❌ [03.2]") and hint in out, out


def test_03_2_solution_passes(capsys):
    assert verdict(capsys, ch03.check_fork, fork_ok).startswith("✅ [03.2]")
    assert verdict(capsys, ch03.check_fork, BlockTable.fork).startswith("✅ [03.2]")
    assert verdict(capsys, ch03.check_fork, todo).startswith("⏳ [03.2]")


# ---------------------------------------------------------------- 03.3 free_block


def free_ok(block, ref_counts, free_block_ids):
    if not 0 <= block < len(ref_counts):
        raise ValueError(f"unknown block {block}")
    if ref_counts[block] == 0:
        raise ValueError(f"block {block} is already free")
    ref_counts[block] -= 1
    if ref_counts[block] == 0:
        free_block_ids.append(block)


def free_negative_index(block, ref_counts, free_block_ids):
    if block >= len(ref_counts) or ref_counts[block] == 0:
        raise ValueError("bad block")
    ref_counts[block] -= 1
    if ref_counts[block] == 0:
        free_block_ids.append(block)


def free_forced(block, ref_counts, free_block_ids):
    if not 0 <= block < len(ref_counts) or ref_counts[block] == 0:
        raise ValueError("bad block")
    ref_counts[block] = 0
    free_block_ids.append(block)


def free_left(block, ref_counts, free_block_ids):
    free_ok(block, ref_counts, [])
    if ref_counts[block] == 0:
        free_block_ids.appendleft(block)


def free_no_double_check(block, ref_counts, free_block_ids):
    if not 0 <= block < len(ref_counts):
        raise ValueError("bad block")
    ref_counts[block] = max(ref_counts[block] - 1, 0)
    if ref_counts[block] == 0:
        free_block_ids.append(block)


def free_always_returns(block, ref_counts, free_block_ids):
    if not 0 <= block < len(ref_counts) or ref_counts[block] == 0:
        raise ValueError("bad block")
    ref_counts[block] -= 1
    free_block_ids.append(block)


@pytest.mark.parametrize("answer, hint", [
    (free_negative_index, "refuse negative blocks"),
    (free_forced, "so one remains"),
    (free_left, "*right* end"),
    (free_no_double_check, "double free"),
    (free_always_returns, "must not go back on the free list yet"),
])
def test_03_3_wrong_answers_get_a_named_hint(capsys, answer, hint):
    out = verdict(capsys, ch03.check_free_block, answer)
    assert out.startswith("❌ [03.3]") and hint in out, out


def test_03_3_solution_passes(capsys):
    assert verdict(capsys, ch03.check_free_block, free_ok).startswith("✅ [03.3]")


# ---------------------------------------------------------------- 03.4 predictions


def predictions(**changes):
    answers = ch03.prediction_scenario()
    answers.update(changes)
    return lambda: answers


@pytest.mark.parametrize("answer, hint", [
    (predictions(**{"child 1's slot": Slot(9, 8)}), "copies it into the next free block"),
    (predictions(**{"refs after the forks": {5: 2, 2: 2, 9: 2}}), "adds one holder"),
    (predictions(**{"parent's slot": Slot(12, 8, (9, 12))}), "one holder is written in place"),
    (predictions(**{"refs at the end": {5: 3, 2: 3, 9: 3, 10: 1, 11: 1}}),
     "took one reference off block 9"),
])
def test_03_4_wrong_answers_get_a_named_hint(capsys, answer, hint):
    out = verdict(capsys, ch03.check_predictions, answer)
    assert out.startswith("❌ [03.4]") and hint in out, out


def test_03_4_solution_passes(capsys):
    assert verdict(capsys, ch03.check_predictions, predictions()).startswith("✅ [03.4]")


def test_twins_name_real_library_objects():
    import importlib

    for module in (ch03,):
        for ex_id, dotted in module.TWINS.items():
            mod, _, rest = dotted.partition(".blocks.")
            obj = importlib.import_module(mod + ".blocks")
            for part in rest.split("."):
                obj = getattr(obj, part)
            assert callable(obj), (ex_id, dotted)
