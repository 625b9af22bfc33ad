"""Graders of chapters 00-03 against typical wrong answers.

Each wrong answer is a mistake learners make (or a small bug planted in the solution);
its grader must print ❌ with a hint that names the mistake, and the solution ✅.
"""

from __future__ import annotations

import pytest

from paged_lib.accounting import SPECS
from paged_lib.blocks import BlockTable, Slot
from paged_lib.course.demos import your_counts
from paged_lib.course.grading import ch00, ch01, ch02, ch03
from paged_lib.course.grading.generated import small_sim


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


def append_frees_twice(table):  # copy-on-write leaving the shared block with two frees
    slot = append_ok(table)
    if slot.copy:
        table.allocator.free(slot.copy[0])
    return slot


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


def append_float(table):
    """Right but for floats: the last block is full when num_tokens / block_size == blocks."""
    offset = table._num_tokens % table.block_size
    if table._num_tokens / table.block_size == len(table._blocks):
        table._blocks.append(table.allocator.allocate())
        table._num_tokens += 1
        return Slot(table._blocks[-1], offset)
    return append_ok(table)


def todo(*args):
    raise NotImplementedError()


@pytest.mark.parametrize("answer, hint", [
    (append_stray_incref, "a stray incref"),
    (append_junk_copy, "copy=(src, dst): src is the shared block"),
    (append_copy_in_place, "nothing is copied (copy=None)"),
    (append_no_cow, "is shared (ref count > 1) and part-filled"),
    (append_keeps_shared, "drop its reference"),
    (append_frees_twice, "drop its reference (allocator.free(src)), once"),
    (append_not_atomic, "not atomic"),
    (append_copies_full_block, "starts a new block: nothing is written into the old"),
    (append_flipped_compare, "write in place, copy=None"),
    (append_off_by_one, "count the tokens before it"),
    (append_no_count, "num_tokens += 1"),
    # floats: right until num_tokens / block_size rounds (a block size past 2**53)
    (append_float, "53 bits"),
])
def test_03_1_wrong_answers_get_a_named_hint(capsys, answer, hint):
    out = verdict(capsys, ch03.check_append_token, answer)
    assert out.startswith("❌ [03.1]") and hint in out, out


def test_03_1_solution_passes_and_stub_is_not_attempted(capsys):
    assert verdict(capsys, ch03.check_append_token, append_ok).startswith("✅ [03.1]")
    # a copy as a list [src, dst]: the engine's list of copies would not match the library's
    listed = lambda t: (s := append_ok(t)).copy and Slot(s.block, s.offset, list(s.copy)) or s
    out = verdict(capsys, ch03.check_append_token, listed)
    assert out.startswith("❌ [03.1]") and "copy is a tuple (src, dst)" in out, out
    assert verdict(capsys, ch03.check_append_token, todo).startswith("⏳ [03.1]")
    out = verdict(capsys, ch03.check_append_token, BlockTable.append_token)
    assert out.startswith("❌ [03.1]") and "you passed the library's append_token" in out


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
    # the child's blocks reversed, or its num_tokens left at 0: named as a fork's, not an append's
    (lambda t: fork_ok(t).__class__(t.allocator, t.block_size, t.blocks[::-1], t.num_tokens),
     "the child gets the parent's blocks, in order"),
    (lambda t: setattr(child := fork_ok(t), "_num_tokens", 0) or child, "and num_tokens"),
])
def test_03_2_wrong_answers_get_a_named_hint(capsys, answer, hint):
    out = verdict(capsys, ch03.check_fork, answer)
    assert out.startswith("❌ [03.2]") and hint in out, out


def test_03_2_solution_passes(capsys):
    assert verdict(capsys, ch03.check_fork, fork_ok).startswith("✅ [03.2]")
    out = verdict(capsys, ch03.check_fork, BlockTable.fork)
    assert out.startswith("❌ [03.2]") and "you passed the library's fork" in out
    assert verdict(capsys, ch03.check_fork, todo).startswith("⏳ [03.2]")


# ------------------------------------- 03.1 and 03.2: crashes told with their state and rule


def append_reads_last_first(table):  # reads the last block before asking if there is one
    last, offset = table._blocks[-1], table._num_tokens % table.block_size
    return append_ok(table) if last is not None or offset else None


def append_by_position(table):  # allocates only for the first block, then indexes by position
    if not table._blocks:
        table._blocks.append(table.allocator.allocate())
    offset, block = table._num_tokens % table.block_size, table._blocks[-1]
    if offset == 0 and table._num_tokens:  # the last block is full: index past the end
        block = table._blocks[table._num_tokens // table.block_size]
    table._num_tokens += 1
    return Slot(block, offset)


def append_pops_the_free_list(table):  # takes blocks without allocate(): no OutOfBlocks
    def allocate():
        block = table.allocator.free_block_ids.popleft()
        table.allocator.ref_counts[block] = 1
        return block
    table.allocator.allocate = allocate
    return append_ok(table)


def append_sets_num_tokens(table):
    slot = append_ok(table)
    table._num_tokens -= 1
    table.num_tokens += 1  # a read-only property
    return slot


def append_decref(table):  # an allocator method that does not exist
    table.allocator.free = lambda block: table.allocator.decref(block)
    return append_ok(table)


def append_copy_as_two_fields(table):
    slot = append_ok(table)
    return Slot(slot.block, slot.offset, *slot.copy) if slot.copy else slot


def fork_per_token(table):
    for i in range(table.num_tokens):  # one incref per token, past the table's end
        table.allocator.incref(table.blocks[i])
    return fork_no_incref(table)


def fork_positions(table):
    for i in range(len(table.blocks)):  # the positions 0, 1, ..., not the block ids
        table.allocator.incref(i)
    return fork_no_incref(table)


@pytest.mark.parametrize("check, answer, state, hint", [
    (ch03.check_append_token, append_reads_last_first, "BlockTable(blocks=[], num_tokens=0",
     "the table holds no block yet"),
    (ch03.check_append_token, append_by_position, "IndexError",
     "last block is full (num_tokens % block_size == 0)"),
    (ch03.check_append_token, append_pops_the_free_list, "pop from an empty deque",
     "take a block only with allocator.allocate()"),
    (ch03.check_append_token, append_sets_num_tokens, "no setter", "read-only (change _blocks, "
     "_num_tokens)"),
    (ch03.check_append_token, append_decref, "decref", "free(block) (drops one reference)"),
    (ch03.check_append_token, append_copy_as_two_fields, "TypeError",
     "Slot(block, offset, copy=(src, dst))"),
    (ch03.check_fork, fork_per_token, "IndexError", "one entry per block, not one per token"),
    # Contrasts no longer override it (it passed once the free list came sorted)
    (ch03.check_fork, fork_positions, "cannot incref block", "not their positions 0, 1"),
    (ch03.check_fork, lambda t: fork_ok(t).__class__(t.allocator, t.block_size, t.blocks),
     "tokens at block size", "type(table)(allocator, block_size, blocks, num_tokens)"),
])
def test_03_1_03_2_crashes_name_the_state_and_the_mistake(capsys, check, answer, state, hint):
    out = verdict(capsys, check, answer)
    assert out.startswith("❌ [03.") and "your code raised" in out and " on BlockTable(" in out
    assert state in out and hint in out, out


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
    # child 2 writes in place, as if child 1's copy had left block 9 unshared
    (predictions(**{"child 2's slot": Slot(9, 8)}), "still shared after child 1 copied it"),
    # child 2 copies into the block child 1 already took
    (predictions(**{"child 2's slot": Slot(10, 8, (9, 10))}), "next block on the free list"),
    # off by one: the 41st token at offset 9 (40 tokens fill offsets 0 .. 7 of block 9)
    (predictions(**{"child 1's slot": Slot(10, 9, (9, 10))}), "offset 40 % 16 = 8"),
    # copy written (dst, src)
    (predictions(**{"child 1's slot": Slot(10, 8, (10, 9))}),
     "copy=(src, dst): src is the shared block"),
    # copy-on-write taken to copy the whole table: every old block drops to 1
    (predictions(**{"refs at the end": {5: 1, 2: 1, 9: 1, 10: 1, 11: 1}}),
     "blocks 5 and 2 were never written"),
    # counts in the order asked, as a list
    (predictions(**{"refs after the forks": [3, 3, 3]}), "as a dict {block: count}"),
])
def test_03_4_wrong_answers_get_a_named_hint(capsys, answer, hint):
    out = verdict(capsys, ch03.check_predictions, answer)
    assert out.startswith("❌ [03.4]") and hint in out, out


def test_03_4_solution_passes(capsys):
    assert verdict(capsys, ch03.check_predictions, predictions()).startswith("✅ [03.4]")


def test_03_4_a_slot_with_its_copy_as_a_list_passes(capsys):
    """Slot(10, 8, [9, 10]) and a plain (10, 8, (9, 10)) say what Slot(10, 8, (9, 10)) does."""
    listed = {k: Slot(s.block, s.offset, s.copy and list(s.copy)) for k, s in
              ch03.prediction_scenario().items() if isinstance(s, Slot)}
    assert verdict(capsys, ch03.check_predictions, predictions(**listed)).startswith("✅")
    plain = {k: [s.block, s.offset, s.copy and list(s.copy)] for k, s in listed.items()}
    assert verdict(capsys, ch03.check_predictions, predictions(**plain)).startswith("✅")


# ---------------------------------------------------------------- chapter 02

def _run(capsys, check, fn) -> str:
    return verdict(capsys, check, fn)


@pytest.mark.parametrize("mech, wrong, hint", [
    # the oracle knows the final length, so "nothing is reserved" (it is, from the start)
    ("reserve exactly the final length, first-fit (Orca Oracle)", {"internal", "reserved"},
     "still held from the start (reserved)"),
    # the last block's empty rest taken for internal fragmentation that remains
    ("allocate on demand", {"reserved"}, "at most the rest of the last block"),
    ("equal-size blocks through a block table", {"external", "reserved"},
     "says nothing about reserving ahead"),
    ("round the output up to a power of two (Orca Pow2)", None, "set(), not None"),
])
def test_02_1_more_wrong_answers(capsys, mech, wrong, hint):
    answer = {k: set(v) for k, v in ch02.MECHANISMS.items()} | {mech: wrong}
    out = _run(capsys, ch02.check_waste_removed, lambda: answer)
    assert out.startswith("❌ [02.1]") and hint in out, out


def test_02_1_waste_removed(capsys):
    right = lambda: {k: set(v) for k, v in ch02.MECHANISMS.items()}  # noqa: E731
    assert _run(capsys, ch02.check_waste_removed, right).startswith("✅ [02.1]")
    for mech, wrong, hint in [
        ("allocate on demand", {"reserved", "internal", "external"}, "does not say *where*"),
        ("equal-size blocks through a block table", {"external", "internal"},
         "says nothing about reserving ahead"),
        ("reserve exactly the final length, first-fit (Orca Oracle)", set(),
         "no internal fragmentation"),
        ("round the output up to a power of two (Orca Pow2)", {"internal"}, "removes none"),
    ]:
        out = _run(capsys, ch02.check_waste_removed, lambda m=mech, w=wrong: right() | {m: w})
        assert out.startswith("❌ [02.1]") and hint in out, out
    assert "no answer" in _run(capsys, ch02.check_waste_removed,
                               lambda: {"allocate on demand": {"reserved"}})
    typo = lambda: right() | {"allocate on demand": {"reservd"}}  # noqa: E731
    assert "unknown waste kind" in _run(capsys, ch02.check_waste_removed, typo)
    assert _run(capsys, ch02.check_waste_removed, todo).startswith("⏳ [02.1]")


@pytest.mark.parametrize("answer, hint", [
    (lambda n, length, m: (n, m - n, 0), "split the free slots"),
    (lambda n, length, m: (n, length - n, m - n), "holds max_len"),
    (lambda n, length, m: (n, length - n, float(m - length)), "whole numbers"),
    (lambda n, length, m: (n + 1, length - n - 1, m - length), "token states = num_tokens"),
    (lambda n, length, m: n, "expected a tuple"),
])
def test_02_2_orca_max_wrong_answers(capsys, answer, hint):
    out = _run(capsys, ch02.check_orca_max_slots, answer)
    assert out.startswith("❌ [02.2]") and hint in out, out


def test_02_2_solution_passes(capsys):
    right = lambda n, length, m: (n, length - n, m - length)  # noqa: E731
    assert _run(capsys, ch02.check_orca_max_slots, right).startswith("✅ [02.2]")


def derivation(**changes):
    answers = ch02.derivation_answers()
    answers.update(changes)
    return lambda: answers


@pytest.mark.parametrize("answer, hint", [
    (derivation(**{"oracle: free slots": 124}), "B leaves, its chunk is free again"),
    (derivation(**{"oracle: largest hole": 324}), "two holes"),
    (derivation(**{"oracle: external fragmentation": 0}), "no single hole"),
    (derivation(**{"paged: blocks A holds": 15}), "round up"),
    (derivation(**{"paged: free blocks": 26.0}), "whole numbers"),
    (derivation(**{"paged: D admitted": "yes"}), "True or False"),
    (derivation(**{"paged: empty slots held": 5}), "for A and C"),
    (derivation(**{"max: slots A never uses": 512 - 100}), "A ends at prompt + output"),
])
def test_02_3_derivation_wrong_answers(capsys, answer, hint):
    out = _run(capsys, ch02.check_derivation, answer)
    assert out.startswith("❌ [02.3]") and hint in out, out


def test_02_3_derivation_solution_and_numbers(capsys):
    assert _run(capsys, ch02.check_derivation, derivation()).startswith("✅ [02.3]")
    # by hand: 1024 - 300 - 400 free; holes 200 and 124; A stores 100 + 151 = 251 tokens
    assert ch02.derivation_answers() == {
        "max: slots A never uses": 212, "oracle: free slots": 324,
        "oracle: largest hole": 200, "oracle: external fragmentation": 324,
        "paged: blocks A holds": 16, "paged: free blocks": 64 - 16 - 22,
        "paged: D admitted": True, "paged: empty slots held": 5 + 1}


def test_02_3_a_numpy_bool_is_a_bool(capsys):
    """D admitted computed from numpy counts is np.True_: a right answer."""
    import numpy as np

    out = _run(capsys, ch02.check_derivation, derivation(**{"paged: D admitted": np.True_}))
    assert out.startswith("✅ [02.3]"), out


def snapshot_ok(prompt_lens, output_lens, step, slots):
    """02.4's solution (the grader's own batch_snapshot refuses a call from a learner)."""
    total = [0, 0, 0]
    for p, o in zip(prompt_lens, output_lens, strict=True):
        for k, v in enumerate(slots(p + step + 1, p + o) if step < o else ()):
            total[k] += v
    return tuple(total)


def _snapshot_off_by_one(prompt_lens, output_lens, step, slots):
    return snapshot_ok(prompt_lens, output_lens, max(step - 1, 0), slots)


def _snapshot_keeps_finished(prompt_lens, output_lens, step, slots):
    total = [0, 0, 0]
    for p, o in zip(prompt_lens, output_lens, strict=True):
        for k, v in enumerate(slots(p + min(step, o - 1) + 1, p + o)):
            total[k] += v
    return tuple(total)


def _snapshot_float(prompt_lens, output_lens, step, slots):
    return tuple(float(v) for v in snapshot_ok(prompt_lens, output_lens, step, slots))


def _snapshot_with(prompt_lens, output_lens, step, slots, *, bug):
    total = [0, 0, 0]
    for p, o in zip(prompt_lens, output_lens, strict=True):
        running = step <= o if bug == "step <= o" else step < o
        tokens = p + step if bug == "no +1" else p + step + 1
        final = o if bug == "final = output" else p + o
        if running:
            for k, v in enumerate(slots(tokens, final)):
                total[k] += v
    return tuple(total)


def _snapshot_cumulative(prompt_lens, output_lens, step, slots):
    """Summed over steps 0 .. step, as if the question were the slot-steps so far."""
    total = [0, 0, 0]
    for s in range(step + 1):
        for k, v in enumerate(snapshot_ok(prompt_lens, output_lens, s, slots)):
            total[k] += v
    return tuple(total)


@pytest.mark.parametrize("answer, hint", [
    (_snapshot_off_by_one, "prompt + s + 1"),
    (_snapshot_keeps_finished, "takes part while step < output_len"),
    (_snapshot_float, "whole numbers"),
    (lambda *a: _snapshot_with(*a, bug="step <= o"), "only while step < output_len"),
    (lambda *a: _snapshot_with(*a, bug="no +1"), "prompt + s + 1"),
    (lambda *a: _snapshot_with(*a, bug="final = output"), "prompt + output (not the output"),
    (_snapshot_cumulative, "not summed over steps 0 .. step"),
    (lambda *a: snapshot_ok(*a)[0], "return three numbers"),
])
def test_02_4_batch_snapshot_wrong_answers(capsys, answer, hint):
    out = _run(capsys, ch02.check_batch_snapshot, answer)
    assert out.startswith("❌ [02.4]") and hint in out, out


def test_02_4_solution_passes(capsys):
    assert _run(capsys, ch02.check_batch_snapshot, snapshot_ok).startswith("✅ [02.4]")


SIMULATOR = """def simulate_paged(requests, capacity_tokens, block_size):
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    arrivals = deque((max(0, math.ceil(requests[i].arrival)), i) for i in order)
    done, blocks = [0] * len(requests), [0] * len(requests)
    queue, running = deque(), []
    num_free = capacity_tokens // block_size
    out = dict.fromkeys(("token_states", "reserved", "internal", "external", "preemptions"), 0)

    def blocks_needed(i):  # for its prompt, the tokens it produced, and this step's token
        return cdiv(requests[i].prompt_len + done[i] + 1, block_size)

    t = 0
    while arrivals or queue or running:
        while arrivals and arrivals[0][0] <= t:
            queue.append(arrivals.popleft()[1])
        if not queue and not running:
            t = arrivals[0][0]
            continue
        while sum(blocks_needed(i) - blocks[i] for i in running) > num_free:
            victim = running.pop()
            num_free += blocks[victim]
            blocks[victim] = 0
            queue.appendleft(victim)
            out["preemptions"] += 1
        for i in running:
            num_free -= blocks_needed(i) - blocks[i]
            blocks[i] = blocks_needed(i)
        while queue and blocks_needed(queue[0]) <= num_free:
            i = queue.popleft()
            blocks[i] = blocks_needed(i)
            num_free -= blocks[i]
            running.append(i)
        for i in running:
            tokens = requests[i].prompt_len + done[i] + 1
            held = blocks[i] * block_size
            will_use = min(held, requests[i].prompt_len + requests[i].output_len)
            out["token_states"] += tokens
            out["reserved"] += will_use - tokens
            out["internal"] += held - will_use
        if queue:
            out["external"] += num_free * block_size + capacity_tokens % block_size
        t += 1
        for i in running:
            done[i] += 1
            if done[i] == requests[i].output_len:
                num_free += blocks[i]
                blocks[i] = 0
        running = [i for i in running if done[i] < requests[i].output_len]
    out["num_steps"] = t
    return out
"""

# Planted bugs: (what the solution says, the bug, words the hint must contain)
SIM_BUGS = [
    ("requests[i].prompt_len + done[i] + 1, block_size)",
     "requests[i].prompt_len + done[i], block_size)", "prompt_len + k"),
    ("tokens = requests[i].prompt_len + done[i] + 1",
     "tokens = requests[i].prompt_len + done[i]", "prompt_len + k"),
    ("return cdiv(requests[i].prompt_len + done[i] + 1, block_size)",
     "return cdiv(requests[i].prompt_len + requests[i].output_len, block_size)",
     "taken one at a time"),
    ("        if queue:\n            out[\"external\"]",
     "        if True:\n            out[\"external\"]", "nothing is external"),
    ("math.ceil(requests[i].arrival)", "math.floor(requests[i].arrival)", "ceil(a)"),
    ("math.ceil(requests[i].arrival)", "round(requests[i].arrival)", "round(a) and int(a) say 2"),
    ("math.ceil(requests[i].arrival)", "int(requests[i].arrival + 0.5)", "ceil(a)"),
    ("key=lambda i: requests[i].arrival", "key=lambda i: i", "in order of arrival"),
    ("victim = running.pop()", "victim = running.pop(0)", "most recently admitted"),
    ("while sum(blocks_needed(i) - blocks[i] for i in running) > num_free:",
     "while sum(blocks_needed(i) - blocks[i] for i in running) > num_free + 99:",
     "preempt the most recently admitted"),
    ("while queue and blocks_needed(queue[0]) <= num_free:",
     "while queue and blocks_needed(queue[0]) < num_free:", "first come, first served"),
    ("            queue.appendleft(victim)", "            queue.append(victim)",
     "head of the queue"),
    ("out[\"external\"] += num_free * block_size + capacity_tokens % block_size",
     "out[\"external\"] += num_free * block_size", "capacity % block_size"),
    ("out[\"num_steps\"] = t", "out[\"num_steps\"] = t / 1", "whole numbers"),
    ("            if done[i] == requests[i].output_len:",
     "            if done[i] == requests[i].output_len + 1:", "a loop that never ends"),
]


def _compile(source):
    namespace = {}
    exec(compile("import math\nfrom collections import deque\n"
                 "from paged_lib.util import cdiv\n" + source, "<learner>", "exec"), namespace)
    return namespace["simulate_paged"]


@pytest.mark.parametrize("old, new, hint", SIM_BUGS, ids=[b[1][:40] for b in SIM_BUGS])
def test_02_5_planted_bugs_get_a_named_hint(capsys, monkeypatch, old, new, hint):
    monkeypatch.setattr(small_sim, "SIM_TIME_LIMIT_S", 1.0)  # a hung bug fails fast
    assert SIMULATOR.count(old) == 1, old
    out = _run(capsys, ch02.check_paged_simulator, _compile(SIMULATOR.replace(old, new)))
    assert out.startswith("❌ [02.5]") and hint in out, out


@pytest.mark.parametrize("old, new, hint", [
    ("math.ceil(requests[i].arrival)", "round(requests[i].arrival)", "ceil(a) (3.2: 4)"),
    ("key=lambda i: requests[i].arrival", "key=lambda i: i", "not of the list"),
    ("key=lambda i: requests[i].arrival", "key=lambda i: math.ceil(requests[i].arrival)",
     "not of the list or of the step ceil(a)"),
])
def test_02_5_generated_traces_tell_the_arrival_rules_apart(capsys, monkeypatch, old, new,
                                                            hint):
    """Without the named traces, the generated ones still catch them, named by a contrast."""
    monkeypatch.setattr(ch02, "SIM_TRACES", [])
    out = _run(capsys, ch02.check_paged_simulator, _compile(SIMULATOR.replace(old, new)))
    assert out.startswith("❌ [02.5] A time-stepped paged simulator: generated") and hint in out


def test_02_5_solution_passes_and_matches_on_the_full_trace(capsys):
    simulate_paged = _compile(SIMULATOR)
    assert _run(capsys, ch02.check_paged_simulator, simulate_paged).startswith("✅ [02.5]")
    assert _run(capsys, ch02.check_paged_simulator, todo).startswith("⏳ [02.5]")


# ---------------------------------------------------------------- chapter 00


@pytest.mark.parametrize("answer, hint", [
    (lambda n, b: n // b, "round up, not down"),
    (lambda n, b: n // b + 1, "exactly full"),
    (lambda n, b: (n + b) // b, "exactly full"),
    (lambda n, b: __import__("math").ceil(n / b), "53 bits"),
    (lambda n, b: float(-(-n // b)), "expected an int"),
    (lambda n, b: -(-n // b) if n < 1000 else n // b, "round up, not down"),
])
def test_00_1_wrong_answers_get_a_named_hint(capsys, answer, hint):
    out = verdict(capsys, ch00.check_ceil_div, answer)
    assert out.startswith("❌ [00.1]") and hint in out, out


def test_00_1_solution_passes_and_the_demo_launches_its_grid(capsys):
    assert verdict(capsys, ch00.check_ceil_div, lambda n, b: (n + b - 1) // b).startswith("✅")
    your_counts.chapter_00(lambda n, b: n // b)  # 7 programs: the last 104 elements never written
    assert "launched 7 programs; 896 of 1000 outputs" in capsys.readouterr().out
    your_counts.chapter_00(todo)
    assert capsys.readouterr().out.startswith("⏳")


# ---------------------------------------------------------------- chapter 01


def kv_ok(s):
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * s.dtype_bytes


@pytest.mark.parametrize("answer, hint", [
    (lambda s: 2 * s.num_layers * s.num_kv_heads * (s.hidden_size // s.num_heads)
     * s.dtype_bytes, "spec.head_dim"),
    (lambda s: s.num_layers * s.num_kv_heads * s.head_dim * s.dtype_bytes, "multiply by 2"),
    (lambda s: 2 * s.num_layers * s.num_heads * s.head_dim * s.dtype_bytes, "num_kv_heads"),
    (lambda s: 2 * s.num_layers * s.hidden_size * s.dtype_bytes, "only KV heads are cached"),
    (lambda s: 2 * s.num_layers * s.num_kv_heads * s.head_dim, "multiply by spec.dtype_bytes"),
    (lambda s: float(kv_ok(s)), "expected an int"),
    (lambda s: kv_ok(s) / 1, "expected an int"),
])
def test_01_1_wrong_answers_get_a_named_hint(capsys, answer, hint):
    out = verdict(capsys, ch01.check_kv_bytes_per_token, answer)
    assert out.startswith("❌ [01.1]") and hint in out, out


@pytest.mark.parametrize("answer, hint", [
    (lambda n, b: n // b, "round up, not down"),
    (lambda n, b: __import__("math").ceil(n / b), "53 bits"),
    (lambda n, b: n / b, "not / or math.ceil"),  # 0 / 16 = 0.0: a float
    (lambda n, b: float(-(-n // b)), "expected an int"),
    (lambda n, b: n // b + 1, "exactly full"),
])
def test_01_2_wrong_answers_get_a_named_hint(capsys, answer, hint):
    out = verdict(capsys, ch01.check_logical_blocks, answer)
    assert out.startswith("❌ [01.2]") and hint in out, out


def fill_ok(n, b):
    return 0.0 if n == 0 else ((n - 1) % b + 1) / b


@pytest.mark.parametrize("answer, hint", [
    (lambda n, b: (n % b) / b, "multiple of block_size"),
    (lambda n, b: 100 * fill_ok(n, b), "not a percentage"),
    (lambda n, b: ((n - 1) % b + 1) / b, "0 tokens: 0.0"),
    (lambda n, b: ((n - 1) % b) / b if n else 0.0, "one token off"),
    # the empty share (right at 1000 and 40 tokens, where half the block is empty)
    (lambda n, b: 1 - fill_ok(n, b), "the empty share of the last block"),
    # the fill of all blocks together
    (lambda n, b: n / (-(-n // b) * b) if n else 0.0, "the fill of all the blocks together"),
    (lambda n, b: (n % b or b) // b if n else 0.0, "`//` floors the fraction"),
    (lambda n, b: (n % b or b) / b, "there is no last block"),  # 0 tokens: 1.0
])
def test_01_3_wrong_answers_get_a_named_hint(capsys, answer, hint):
    out = verdict(capsys, ch01.check_last_block_fill, answer)
    assert out.startswith("❌ [01.3]") and hint in out, out


def max_ok(spec, budget, ctx, bs):
    return (budget // (bs * kv_ok(spec))) // -(-ctx // bs)


@pytest.mark.parametrize("answer, hint", [
    (lambda spec, budget, ctx, bs: budget // (ctx * kv_ok(spec)), "whole blocks"),
    (lambda spec, budget, ctx, bs: (budget // (bs * kv_ok(spec))) / -(-ctx // bs),
     "expected an int"),
    (lambda spec, budget, ctx, bs: float(max_ok(spec, budget, ctx, bs)), "expected an int"),
    (lambda spec, budget, ctx, bs: (budget // (bs * kv_ok(spec))) // (ctx // bs),
     "occupy 63 blocks"),
    # a block taken for one token: 16 times too many blocks
    (lambda spec, budget, ctx, bs: budget // kv_ok(spec) // -(-ctx // bs),
     "a block holds block_size = 16 tokens"),
    # the budget's last partial block counted
    (lambda spec, budget, ctx, bs: -(-budget // (bs * kv_ok(spec))) // -(-ctx // bs),
     "smaller than a block is unusable"),
    (lambda spec, budget, ctx, bs: round((budget // (bs * kv_ok(spec))) / -(-ctx // bs)),
     "round the number of requests down"),
    # 01.1's "forgot K and V" carried over
    (lambda spec, budget, ctx, bs: max_ok(spec, 2 * budget, ctx, bs), "did it multiply by 2"),
])
def test_01_4_wrong_answers_get_a_named_hint(capsys, answer, hint):
    out = verdict(capsys, ch01.check_max_requests, answer)
    assert out.startswith("❌ [01.4]") and hint in out, out


def test_01_solutions_pass_and_the_demo_draws_the_learners_numbers(capsys):
    import matplotlib.pyplot as plt

    assert verdict(capsys, ch01.check_kv_bytes_per_token, kv_ok).startswith("✅ [01.1]")
    assert verdict(capsys, ch01.check_logical_blocks,
                   lambda n, b: (n + b - 1) // b).startswith("✅ [01.2]")
    assert verdict(capsys, ch01.check_last_block_fill, fill_ok).startswith("✅ [01.3]")
    assert verdict(capsys, ch01.check_max_requests, max_ok).startswith("✅ [01.4]")
    fig = your_counts.chapter_01(lambda s: kv_ok(s) // 2)
    assert "some differ" in capsys.readouterr().out
    heights = [p.get_height() for p in fig.axes[0].patches if p.get_height() > 0]
    assert heights[0] == kv_ok(next(iter(SPECS.values()))) / 2 / 1024
    plt.close("all")


TWIN_MESSAGE = "which is what you are asked to write"


def _calls(dotted_attr):
    """An answer that hands its arguments to the library object ``module:attr``."""
    import importlib

    module, attr = dotted_attr.split(":")

    def answer(*args, **kwargs):
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj(*args, **kwargs)
    return answer


@pytest.mark.parametrize("check, answer, ex_id, name", [
    (ch00.check_ceil_div, _calls("paged_lib.util:cdiv"), "00.1", "cdiv"),
    (ch01.check_kv_bytes_per_token, _calls("paged_lib.accounting:kv_bytes_per_token"), "01.1",
     "kv_bytes_per_token"),
    (ch01.check_logical_blocks, _calls("paged_lib.accounting:num_blocks"), "01.2", "num_blocks"),
    # every library function doing the job refuses, not only the exercise's own twin
    (ch00.check_ceil_div, _calls("paged_lib.accounting:num_blocks"), "00.1", "num_blocks"),
    (ch00.check_ceil_div, _calls("triton:cdiv"), "00.1", "cdiv (triton.cdiv)"),
    (ch01.check_logical_blocks, _calls("paged_lib.util:cdiv"), "01.2", "cdiv"),
    (ch01.check_logical_blocks, _calls("triton:cdiv"), "01.2", "cdiv (triton.cdiv)"),
    (ch01.check_kv_bytes_per_token, lambda s: _calls("paged_lib.accounting:kv_bytes")(s, 1),
     "01.1", "kv_bytes"),
    (ch01.check_kv_bytes_per_token, lambda s: _calls("paged_lib.parallel:kv_bytes_per_rank")(
        s, 1, 1), "01.1", "kv_bytes_per_rank"),
    (ch01.check_kv_bytes_per_token, lambda s: _calls(
        "paged_lib.studies.tp_layout:kv_bytes_per_rank")(s, 1, 1), "01.1", "kv_bytes_per_rank"),
    (ch01.check_kv_bytes_per_token, lambda s: _calls(
        "paged_lib.studies.kv_quant_eval:kv_bytes_per_token_quant")(s, "auto").auto_bytes,
     "01.1", "kv_bytes_per_token_quant"),
    (ch01.check_kv_bytes_per_token, lambda s: _calls(
        "paged_lib.course.demos.engine_compare:kv_bytes_per_block")(s, 1), "01.1",
     "kv_bytes_per_block"),
    (ch01.check_kv_bytes_per_token, _calls("paged_lib.bench.floor:kv_bytes_per_token"), "01.1",
     "kv_bytes_per_token"),
    (ch02.check_orca_max_slots, lambda n, length, m: _calls(
        "paged_lib.fragmentation:request_slots")("orca-max", n, length, max_len=m), "02.2",
     "request_slots"),
    (ch02.check_paged_simulator, lambda reqs, cap, bs: _calls(
        "paged_lib.fragmentation:simulate_timeline")(reqs, "paged", cap, bs), "02.5",
     "simulate_timeline"),
    (ch03.check_append_token, lambda table: BlockTable.append_token(table), "03.1",
     "BlockTable.append_token"),
    (ch03.check_append_token, lambda table: table.append_token(), "03.1",
     "BlockTable.append_token"),
    (ch03.check_fork, lambda table: table.fork(), "03.2", "BlockTable.fork"),
    (ch03.check_append_token, lambda t: __import__("paged_lib.engine.block_manager").engine.
     block_manager.BlockManager.append_slot(None, __import__("types").SimpleNamespace(
         block_table=t)), "03.1", "BlockManager.append_slot"),
    # a grader's own reference, imported by the learner
    (ch01.check_last_block_fill, _calls("paged_lib.course.grading.generated.small_ints:fill"),
     "01.3", "fill"),
    (ch02.check_derivation, _calls("paged_lib.course.grading.ch02:derivation_answers"), "02.3",
     "derivation_answers"),
    (ch02.check_batch_snapshot, _calls("paged_lib.course.grading.ch02:batch_snapshot"), "02.4",
     "batch_snapshot"),
    (ch02.check_paged_simulator, _calls(
        "paged_lib.course.grading.generated.small_sim:reference_paged"), "02.5", "reference_paged"),
    (ch03.check_predictions, _calls("paged_lib.course.grading.ch03:prediction_scenario"), "03.4",
     "prediction_scenario"),
])
def test_an_answer_that_calls_the_library_twin_fails(capsys, check, answer, ex_id, name):
    out = verdict(capsys, check, answer)
    assert out.startswith(f"❌ [{ex_id}]"), out
    assert f"your function called the library's {name}" in out and TWIN_MESSAGE in out, out


def test_03_3_free_block_that_calls_the_allocators_free_fails(capsys):
    from paged_lib.blocks import BlockAllocator

    def via_library(block, ref_counts, free_block_ids):
        alloc = BlockAllocator.__new__(BlockAllocator)
        alloc.ref_counts, alloc.free_block_ids = ref_counts, free_block_ids
        alloc._num_blocks = len(ref_counts)
        BlockAllocator.free(alloc, block)

    out = verdict(capsys, ch03.check_free_block, via_library)
    assert out.startswith("❌ [03.3]") and "BlockAllocator.free" in out and TWIN_MESSAGE in out


def test_the_twin_passed_itself_fails_and_every_patch_is_undone(capsys):
    from paged_lib.accounting import num_blocks
    from paged_lib.util import cdiv

    out = verdict(capsys, ch00.check_ceil_div, cdiv)
    assert out.startswith("❌ [00.1]") and "you passed the library's cdiv" in out, out
    assert verdict(capsys, ch01.check_logical_blocks, num_blocks).startswith("❌ [01.2]")
    assert BlockTable.append_token.__qualname__ == "BlockTable.append_token"
    assert verdict(capsys, ch03.check_append_token, append_ok).startswith("✅ [03.1]")
    assert cdiv(17, 16) == 2  # a guard would refuse a call from tests/
    import triton

    assert triton.cdiv(17, 16) == 2  # (its guard refuses every caller: Triton calls it)


def test_one_rule_for_integer_types_numpy_ints_pass_floats_do_not(capsys):
    """Where a count is asked for, int and numpy integers pass; 3.0 and True do not."""
    import numpy as np

    def kv(spec):
        return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * spec.dtype_bytes

    assert verdict(capsys, ch01.check_kv_bytes_per_token,
                   lambda s: np.int64(kv(s))).startswith("✅ [01.1]")
    assert verdict(capsys, ch02.check_orca_max_slots, lambda n, length, m: (
        np.int64(n), np.int32(length - n), np.int64(m - length))).startswith("✅ [02.2]")
    for answer in (lambda s: float(kv(s)), lambda s: np.float64(kv(s))):
        out = verdict(capsys, ch01.check_kv_bytes_per_token, answer)
        assert out.startswith("❌ [01.1]") and "expected an int" in out, out
    out = verdict(capsys, ch02.check_orca_max_slots,
                  lambda n, length, m: (float(n), length - n, m - length))
    assert out.startswith("❌ [02.2]") and "expected an int" in out, out


def test_03_1_never_prints_03_4s_answers(capsys):
    """A ❌ of 03.1 shows an expected Slot: it must not be one of 03.4's predictions."""
    answers = ch03.prediction_scenario()
    shown = {str(answers[k]) for k in ("child 1's slot", "child 2's slot", "parent's slot")}

    def no_copy(table):  # writes into the shared block: fails at the first fork
        offset = table._num_tokens % table.block_size
        if offset == 0:
            table._blocks.append(table.allocator.allocate())
        table._num_tokens += 1
        return Slot(table._blocks[-1], offset, None)
    out = verdict(capsys, ch03.check_append_token, no_copy)
    assert out.startswith("❌ [03.1]") and not any(s in out for s in shown), out


def test_a_twin_held_before_the_check_still_refuses(capsys):
    """Aliases made before the check (a default argument, a partial) reach the twin too."""
    import functools

    from paged_lib.util import cdiv

    def by_default(n, b, _impl=cdiv):
        return _impl(n, b)

    held = functools.partial(cdiv)
    for answer in (by_default, lambda n, b: held(n, b)):
        out = verdict(capsys, ch00.check_ceil_div, answer)
        assert out.startswith("❌ [00.1]") and "called the library's cdiv" in out, out
    assert cdiv(17, 16) == 2 and cdiv.__code__.co_name == "cdiv"  # its own code again
