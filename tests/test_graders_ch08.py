"""Chapter 08's graders against typical wrong answers: each gets ❌ with a hint naming it."""

from __future__ import annotations

import pytest

from paged_lib import sharing
from paged_lib.grading import ch08


def verdict(capsys, check, answer) -> str:
    check(answer)
    out = capsys.readouterr().out
    assert out.count("\n") <= 2, out  # one verdict line, at most one hint line
    return out


# ---------------------------------------------------------------- 08.1 apply_slot


def apply_ok(k_cache, v_cache, slot, key, value):
    if slot.copy is not None:
        src, dst = slot.copy
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]
    k_cache[slot.block, slot.offset] = key
    v_cache[slot.block, slot.offset] = value


def apply_no_copy(k_cache, v_cache, slot, key, value):
    k_cache[slot.block, slot.offset] = key
    v_cache[slot.block, slot.offset] = value


def apply_k_only(k_cache, v_cache, slot, key, value):
    if slot.copy is not None:
        k_cache[slot.copy[1]] = k_cache[slot.copy[0]]
    apply_no_copy(k_cache, v_cache, slot, key, value)


def apply_copy_after_write(k_cache, v_cache, slot, key, value):
    apply_no_copy(k_cache, v_cache, slot, key, value)
    if slot.copy is not None:
        src, dst = slot.copy
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]


def apply_reversed(k_cache, v_cache, slot, key, value):
    if slot.copy is not None:
        src, dst = slot.copy
        k_cache[src] = k_cache[dst]
        v_cache[src] = v_cache[dst]
    apply_no_copy(k_cache, v_cache, slot, key, value)


def apply_into_src(k_cache, v_cache, slot, key, value):
    block = slot.copy[0] if slot.copy else slot.block
    k_cache[block, slot.offset] = key
    v_cache[block, slot.offset] = value


def apply_whole_block(k_cache, v_cache, slot, key, value):
    """Writes the token into every slot of the block from its offset on."""
    apply_ok(k_cache, v_cache, slot, key, value)
    k_cache[slot.block, slot.offset:] = key
    v_cache[slot.block, slot.offset:] = value


@pytest.mark.parametrize("answer,hint", [
    (apply_no_copy, "copy the whole block src into dst first"),
    (apply_k_only, "in K *and* V"),
    (apply_copy_after_write, "a copy made afterwards overwrites it"),
    (apply_reversed, "copy goes from src to dst"),
    (apply_into_src, "never into the shared src"),
    (apply_whole_block, "touch only block dst"),
])
def test_apply_slot_wrong_answers(capsys, answer, hint):
    out = verdict(capsys, ch08.check_apply_slot, answer)
    assert out.startswith("❌ [08.1]") and hint in out, out


def test_apply_slot_right_answers(capsys):
    assert verdict(capsys, ch08.check_apply_slot, apply_ok).startswith("✅ [08.1]")
    assert verdict(capsys, ch08.check_apply_slot, sharing.apply_slot).startswith("✅ [08.1]")


def test_apply_slot_not_attempted(capsys):
    def todo(*args):
        raise NotImplementedError

    assert verdict(capsys, ch08.check_apply_slot, todo).startswith("⏳ [08.1]")


def test_notes_exercise_4_flow_and_ref_counts():
    got = ch08.notes_exercise_4()
    assert got["prompt blocks"] == [7] and got["ref 7 after forks"] == 4
    slot = got["sample 3 writes"]
    assert slot.copy == (7, slot.block) and slot.offset == 3
    assert got["refs after"] == {7: 3, slot.block: 1}


# ---------------------------------------------------------------- 08.2 beam_step


def step_ok(tables, parents):
    freed = [i for i in range(len(tables)) if i not in parents]
    for i in freed:
        tables[i].free()
    new, seen = [], set()
    for p in parents:
        new.append(tables[p].fork() if p in seen else tables[p])
        seen.add(p)
    return sharing.BeamStep(new, [t.append_token() for t in new], freed)


def step_no_free(tables, parents):
    freed = [i for i in range(len(tables)) if i not in parents]
    new, seen = [], set()
    for p in parents:
        new.append(tables[p].fork() if p in seen else tables[p])
        seen.add(p)
    return sharing.BeamStep(new, [t.append_token() for t in new], freed)


def step_fork_every_child(tables, parents):
    freed = [i for i in range(len(tables)) if i not in parents]
    for i in freed:
        tables[i].free()
    new = [tables[p].fork() for p in parents]
    slots = [t.append_token() for t in new]
    for p in sorted(set(parents)):
        tables[p].free()
    return sharing.BeamStep(new, slots, freed)


def step_append_before_fork(tables, parents):
    freed = [i for i in range(len(tables)) if i not in parents]
    for i in freed:
        tables[i].free()
    new, slots, seen = [], [], set()
    for p in parents:
        table = tables[p].fork() if p in seen else tables[p]
        seen.add(p)
        new.append(table)
        slots.append(table.append_token())
    return sharing.BeamStep(new, slots, freed)


def step_free_last(tables, parents):
    freed = [i for i in range(len(tables)) if i not in parents]
    new, seen = [], set()
    for p in parents:
        new.append(tables[p].fork() if p in seen else tables[p])
        seen.add(p)
    slots = [t.append_token() for t in new]
    for i in freed:
        tables[i].free()
    return sharing.BeamStep(new, slots, freed)


def step_no_fork(tables, parents):
    freed = [i for i in range(len(tables)) if i not in parents]
    for i in freed:
        tables[i].free()
    new = [tables[p] for p in parents]
    return sharing.BeamStep(new, [t.append_token() for t in new], freed)


def step_tuple(tables, parents):
    result = step_ok(tables, parents)
    return result.tables, result.slots


@pytest.mark.parametrize("answer,hint", [
    (step_no_free, "free the table of every beam that has no child"),
    (step_fork_every_child, "the first child continues its parent's own table"),
    (step_append_before_fork, "fork before any child appends"),
    (step_free_last, "free the dead beams' tables first"),
    (step_no_fork, "each child after the first gets parent.fork()"),
    (step_tuple, "return sharing.BeamStep"),
])
def test_beam_step_wrong_answers(capsys, answer, hint):
    out = verdict(capsys, ch08.check_beam_step, answer)
    assert out.startswith("❌ [08.2]") and hint in out, out


def test_beam_step_right_answers(capsys):
    assert verdict(capsys, ch08.check_beam_step, step_ok).startswith("✅ [08.2]")
    assert verdict(capsys, ch08.check_beam_step, sharing.beam_step).startswith("✅ [08.2]")


def test_a_learner_step_runs_a_whole_beam_search():
    mine = ch08.run_beam_search(step_ok, seed=3)
    assert mine == sharing.record_beam_search(seed=3)[0]


def test_twins_name_library_objects():
    import importlib

    for ex_id, dotted in ch08.TWINS.items():
        module, name = dotted.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), name)), ex_id
