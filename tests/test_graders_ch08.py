"""Chapter 08's graders against typical wrong answers: each gets ❌ with a hint naming it."""

from __future__ import annotations

import copy

import pytest
import torch

from paged_lib.course.demos import your_serving
from paged_lib.course.grading import ch08
from paged_lib.engine.beam_search import beam_step
from paged_lib.studies import sharing


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


def apply_flat(k_cache, v_cache, slot, key, value):
    """Addresses the slot in a flattened cache: .reshape copies a non-contiguous view."""
    if slot.copy is not None:
        src, dst = slot.copy
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]
    bs = k_cache.shape[1]
    for cache, x in ((k_cache, key), (v_cache, value)):
        cache.reshape(-1, *cache.shape[2:])[slot.block * bs + slot.offset] = x


def apply_new_tensor(k_cache, v_cache, slot, key, value):
    """Builds each updated cache anew and swaps it in through .data."""
    for cache, x in ((k_cache, key), (v_cache, value)):
        new = cache.clone()
        if slot.copy is not None:
            new[slot.copy[1]] = new[slot.copy[0]]
        new[slot.block, slot.offset] = x
        cache.data = new


def apply_library_copy(k_cache, v_cache, slot, key, value):
    """Leaves the copy-on-write half to the library's block copy."""
    from paged_lib.kernels.copy_blocks import copy_blocks

    if slot.copy is not None:
        copy_blocks([k_cache], [v_cache], [slot.copy])
    apply_no_copy(k_cache, v_cache, slot, key, value)


def apply_move(k_cache, v_cache, slot, key, value):
    """Moves the block: the sample no longer holds src, so it clears it after copying."""
    apply_ok(k_cache, v_cache, slot, key, value)
    if slot.copy is not None:
        k_cache[slot.copy[0]] = 0
        v_cache[slot.copy[0]] = 0


def apply_copy_on_contiguous(k_cache, v_cache, slot, key, value):
    """Copies through .contiguous() (a no-op on separate caches, a copy on FlashInfer's)."""
    if slot.copy is not None:
        src, dst = slot.copy
        for cache in (k_cache.contiguous(), v_cache.contiguous()):
            cache[dst] = cache[src]
    apply_no_copy(k_cache, v_cache, slot, key, value)


def apply_out_of_place(k_cache, v_cache, slot, key, value):
    """index_copy (not index_copy_) returns a new tensor: the copy never reaches the cache."""
    if slot.copy is not None:
        src, dst = slot.copy
        k_cache = k_cache.index_copy(0, torch.tensor([dst]), k_cache[src][None])
        v_cache = v_cache.index_copy(0, torch.tensor([dst]), v_cache[src][None])
    apply_no_copy(k_cache, v_cache, slot, key, value)


def apply_prefix_after_write(k_cache, v_cache, slot, key, value):
    """Right: the token first, then only the slots the sample reads (before its offset)."""
    apply_no_copy(k_cache, v_cache, slot, key, value)
    if slot.copy is not None:
        src, dst = slot.copy
        k_cache[dst, :slot.offset] = k_cache[src, :slot.offset]
        v_cache[dst, :slot.offset] = v_cache[src, :slot.offset]


@pytest.mark.parametrize("answer,hint", [
    (apply_move, "other samples still read block 7, so it stays as it is"),
    (apply_copy_on_contiguous, "here k_cache and v_cache are views of one tensor"),
    (apply_out_of_place, "an out-of-place op"),
    (apply_library_copy, "called the library's copy_blocks"),
    (apply_flat, "here k_cache and v_cache are views of one tensor"),
    (apply_new_tensor, "here k_cache and v_cache are views of one tensor"),
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
    out = verdict(capsys, ch08.check_apply_slot, apply_prefix_after_write)
    assert out.startswith("✅ [08.1]"), out
    out = verdict(capsys, ch08.check_apply_slot, sharing.apply_slot)
    assert out.startswith("❌ [08.1]") and "you passed the library's apply_slot" in out, out


def test_apply_slot_not_attempted(capsys):
    def todo(*args):
        raise NotImplementedError

    assert verdict(capsys, ch08.check_apply_slot, todo).startswith("⏳ [08.1]")


def test_cow_walkthrough_flow_and_ref_counts():
    """Chapter 08's copy-on-write example (08.1's named run) with the library."""
    from paged_lib.blocks import BlockTable
    from paged_lib.course.grading.toy_pool import busy_pool

    allocator = busy_pool(12, ch08._EXAMPLE.free)
    prompt = BlockTable(allocator, 4)
    for _ in range(3):
        prompt.append_token()
    samples = [prompt] + [prompt.fork() for _ in range(3)]
    assert prompt.blocks == [7] and allocator.refcount(7) == 4
    slot = samples[2].append_token()
    assert slot.copy == (7, slot.block) and slot.offset == 3
    assert (allocator.refcount(7), allocator.refcount(slot.block)) == (3, 1)


# ---------------------------------------------------------------- 08.2 beam_step


def ranked(cum_logprobs, candidates):
    scored = [(cum_logprobs[i] + lp, i, r, tok)
              for i, opts in enumerate(candidates) for r, (tok, lp) in enumerate(opts)]
    return sorted(scored, key=lambda c: (-c[0], c[1], c[2]))


def step_ok(tables, cum_logprobs, candidates, beam_width):
    chosen = ranked(cum_logprobs, candidates)[:beam_width]
    used, new = set(), []
    for cum, parent, _, token in chosen:
        new.append((parent, tables[parent].fork() if parent in used else tables[parent],
                    token, cum))
        used.add(parent)
    for i, table in enumerate(tables):
        if i not in used:
            table.free()
    return new


def step_frees_in_reverse(tables, cum_logprobs, candidates, beam_width):
    """Right beams and ref counts, but the dead beams freed from the last one back."""
    chosen = ranked(cum_logprobs, candidates)[:beam_width]
    used, new = set(), []
    for cum, parent, _, token in chosen:
        new.append((parent, tables[parent].fork() if parent in used else tables[parent],
                    token, cum))
        used.add(parent)
    for i in reversed(range(len(tables))):
        if i not in used:
            tables[i].free()
    return new


def step_token_ties(tables, cum_logprobs, candidates, beam_width):
    """Breaks a tie by the lower token id instead of the candidate's rank."""
    by_token = [[c for _, c in sorted(enumerate(opts), key=lambda rc: (-rc[1][1], rc[1][0]))]
                for opts in candidates]
    return step_ok(tables, cum_logprobs, by_token, beam_width)


def step_sorted_set(tables, cum_logprobs, candidates, beam_width):
    """Keeps the chosen parents in a set, assuming it iterates in the order they came."""
    chosen = ranked(cum_logprobs, candidates)[:beam_width]
    parents = {parent for _, parent, _, _ in chosen}
    used, new = set(), []
    for parent in parents:
        for cum, p, _, token in chosen:
            if p == parent:
                new.append((p, tables[p].fork() if p in used else tables[p], token, cum))
                used.add(p)
    for i, table in enumerate(tables):
        if i not in used:
            table.free()
    return new


def step_no_free(tables, cum_logprobs, candidates, beam_width):
    chosen = ranked(cum_logprobs, candidates)[:beam_width]
    used, new = set(), []
    for cum, parent, _, token in chosen:
        new.append((parent, tables[parent].fork() if parent in used else tables[parent],
                    token, cum))
        used.add(parent)
    return new


def step_fork_every_child(tables, cum_logprobs, candidates, beam_width):
    chosen = ranked(cum_logprobs, candidates)[:beam_width]
    new = [(parent, tables[parent].fork(), token, cum) for cum, parent, _, token in chosen]
    for i, table in enumerate(tables):
        if i not in {p for p, _, _, _ in new}:
            table.free()
    return new


def step_fork_all_then_free_old(tables, cum_logprobs, candidates, beam_width):
    """Every continuation gets a fork, then every old table is freed: right memory, extra work."""
    chosen = ranked(cum_logprobs, candidates)[:beam_width]
    new = [(parent, tables[parent].fork(), token, cum) for cum, parent, _, token in chosen]
    for table in tables:
        table.free()
    return new


def step_width_per_beam(tables, cum_logprobs, candidates, beam_width):
    """Keeps each beam's own beam_width best continuations instead of beam_width in all."""
    chosen = ranked(cum_logprobs, candidates)
    used, new = set(), []
    for cum, parent, _, token in chosen:
        new.append((parent, tables[parent].fork() if parent in used else tables[parent],
                    token, cum))
        used.add(parent)
    for i, table in enumerate(tables):
        if i not in used:
            table.free()
    return new


def step_frees_continuing_parent(tables, cum_logprobs, candidates, beam_width):
    """Gives the parent's table to its first child, forks the others, then frees every old
    table, the parents that go on included."""
    new = step_ok(tables, cum_logprobs, candidates, beam_width)
    used = {p for p, _, _, _ in new}
    for i in used:
        tables[i].free()
    return new


def step_shallow_copy(tables, cum_logprobs, candidates, beam_width):
    """A further child gets copy.copy(parent's table): a new object, but no new holder."""
    chosen = ranked(cum_logprobs, candidates)[:beam_width]
    used, new = set(), []
    for cum, parent, _, token in chosen:
        new.append((parent, copy.copy(tables[parent]) if parent in used else tables[parent],
                    token, cum))
        used.add(parent)
    for i, table in enumerate(tables):
        if i not in used:
            table.free()
    return new


def step_by_this_logprob(tables, cum_logprobs, candidates, beam_width):
    return step_ok(tables, [0.0] * len(tables), candidates, beam_width)


def step_per_beam(tables, cum_logprobs, candidates, beam_width):
    """Each beam keeps its own best candidate (no competition across beams)."""
    picks = [(cum_logprobs[i] + opts[0][1], i, 0, opts[0][0])
             for i, opts in enumerate(candidates)]
    rest = [c for c in ranked(cum_logprobs, candidates) if c[2] > 0]
    chosen = (picks + rest)[:beam_width]
    used, new = set(), []
    for cum, parent, _, token in chosen:
        new.append((parent, tables[parent].fork() if parent in used else tables[parent],
                    token, cum))
        used.add(parent)
    for i, table in enumerate(tables):
        if i not in used:
            table.free()
    return new


def step_step_logprob_as_cum(tables, cum_logprobs, candidates, beam_width):
    new = step_ok(tables, cum_logprobs, candidates, beam_width)
    return [(p, t, tok, cum - cum_logprobs[p]) for p, t, tok, cum in new]


def step_free_first(tables, cum_logprobs, candidates, beam_width):
    chosen = ranked(cum_logprobs, candidates)[:beam_width]
    for table in tables:
        table.free()
    return [(parent, tables[parent].fork(), token, cum) for cum, parent, _, token in chosen]


def step_same_table(tables, cum_logprobs, candidates, beam_width):
    new = step_ok(tables, cum_logprobs, candidates, beam_width)
    return [(p, tables[p], tok, cum) for p, _, tok, cum in new]


def step_worst_first(tables, cum_logprobs, candidates, beam_width):
    new = step_ok(tables, cum_logprobs, candidates, beam_width)
    return new[::-1]


def step_fixed_width(tables, cum_logprobs, candidates, beam_width):
    """Reads beam_width candidates of every beam (there may be fewer after EOS)."""
    trimmed = [[candidates[i][r] for r in range(beam_width)] for i in range(len(tables))]
    return step_ok(tables, cum_logprobs, trimmed, beam_width)


def step_rank_first_ties(tables, cum_logprobs, candidates, beam_width):
    scored = [(cum_logprobs[i] + lp, i, r, tok)
              for i, opts in enumerate(candidates) for r, (tok, lp) in enumerate(opts)]
    chosen = sorted(scored, key=lambda c: (-c[0], c[2], c[1]))[:beam_width]
    used, new = set(), []
    for cum, parent, _, token in chosen:
        new.append((parent, tables[parent].fork() if parent in used else tables[parent],
                    token, cum))
        used.add(parent)
    for i, table in enumerate(tables):
        if i not in used:
            table.free()
    return new


def step_keeps_empty_beams(tables, cum_logprobs, candidates, beam_width):
    """Frees the beams that lost, but not those that offered no candidate at all."""
    chosen = ranked(cum_logprobs, candidates)[:beam_width]
    used, new = set(), []
    for cum, parent, _, token in chosen:
        new.append((parent, tables[parent].fork() if parent in used else tables[parent],
                    token, cum))
        used.add(parent)
    for i, table in enumerate(tables):
        if i not in used and candidates[i]:
            table.free()
    return new


def step_pads_to_width(tables, cum_logprobs, candidates, beam_width):
    """Always beam_width new beams: the best one again where candidates ran short."""
    chosen = ranked(cum_logprobs, candidates)[:beam_width]
    chosen += [chosen[0]] * (beam_width - len(chosen))
    used, new = set(), []
    for cum, parent, _, token in chosen:
        new.append((parent, tables[parent].fork() if parent in used else tables[parent],
                    token, cum))
        used.add(parent)
    for i, table in enumerate(tables):
        if i not in used:
            table.free()
    return new


def step_by_parent(tables, cum_logprobs, candidates, beam_width):
    new = step_ok(tables, cum_logprobs, candidates, beam_width)
    return sorted(new, key=lambda b: b[0])


def step_sorting(key=None, reverse=False):
    """beam_step ranking (score, beam, candidate's rank, token) tuples by ``sort(key, reverse)``."""
    def step(tables, cum_logprobs, candidates, beam_width):
        scored = [(cum_logprobs[i] + lp, i, r, tok)
                  for i, opts in enumerate(candidates) for r, (tok, lp) in enumerate(opts)]
        scored.sort(key=key, reverse=reverse)
        used, new = set(), []
        for cum, parent, _, token in scored[:beam_width]:
            new.append((parent, tables[parent].fork() if parent in used else tables[parent],
                        token, cum))
            used.add(parent)
        for i, table in enumerate(tables):
            if i not in used:
                table.free()
        return new
    return step


_TIE_ORDER = "your new beams are in score order, but an exact tie goes the other way"


@pytest.mark.parametrize("answer,hint", [
    # sort(reverse=True) on the whole tuples: on a tie the later beam / candidate wins
    (step_sorting(reverse=True), [_TIE_ORDER, "expected [(0, 1), (0, 2), (0, 3)]",
                                  "the lower beam index goes first, then the earlier candidate"]),
    # a tie broken by the higher token id, then by the later beam
    (step_sorting(key=lambda c: (c[0], c[3]), reverse=True), [_TIE_ORDER, "token id does not"]),
    (step_sorting(key=lambda c: (c[0], c[1]), reverse=True),
     [_TIE_ORDER, "[(2, 7), (1, 6), (0, 4)], expected [(0, 4), (0, 5), (1, 6)]",
      "the lower beam index goes first"]),
    (step_sorting(key=lambda c: (-c[0], c[1], -c[2])), [_TIE_ORDER, "then the earlier "
                                                         "candidate in that beam's list"]),
    # a tie broken by the lower token id, across beams or within one
    (step_sorting(key=lambda c: (-c[0], c[3])), ["not to the lower token id"]),
    (step_sorting(key=lambda c: (-c[0], c[1], c[3])), ["not to the lower token id"]),
])
def test_beam_step_tie_orders_get_the_tie_hint(capsys, answer, hint):
    out = verdict(capsys, ch08.check_beam_step, answer)
    assert out.startswith("❌ [08.2]") and all(h in out for h in hint), out
    assert "not by parent" not in out, out


@pytest.mark.parametrize("key,reverse", [(lambda c: c[0], True), (lambda c: -c[0], False)])
def test_beam_step_stable_sort_on_the_score_alone_is_right(capsys, key, reverse):
    """Python's sort is stable (reverse=True too): candidates listed beam by beam keep
    that order on a tie, which is the library's tie order."""
    out = verdict(capsys, ch08.check_beam_step, step_sorting(key=key, reverse=reverse))
    assert out.startswith("✅ [08.2]"), out


@pytest.mark.parametrize("answer,hint", [
    (step_fixed_width, "a beam may offer fewer than beam_width candidates, or none"),
    (step_rank_first_ties, "the lower beam index goes first"),
    (step_keeps_empty_beams, "a beam with no candidates has no continuation either"),
    (step_pads_to_width, "fewer only if there are fewer candidates in all"),
    (step_by_parent, "list the new beams best first"),
    (lambda *a: beam_step(*a), "your function called the library's beam_step"),
    (step_no_free, "free() the table of every old beam that nobody continues"),
    (step_token_ties, "not to the lower token id"),
    (step_sorted_set, "best first"),
    (step_fork_every_child, "the first child continues its parent's own table"),
    (step_by_this_logprob, "not by this step's logprob alone"),
    (step_per_beam, "compete across all beams"),
    (step_step_logprob_as_cum, "cum_logprob = cum_logprobs[parent] + the candidate's"),
    (step_free_first, "free only the beams nobody continues, after the forks"),
    (step_same_table, "each child after the first gets parent.fork()"),
    (step_worst_first, "best first"),
    (step_fork_all_then_free_old, "you freed its table and gave its first child (new beam 0) "
                                  "a fork of it"),
    (step_fork_all_then_free_old, "a reference taken and given back"),
    (step_width_per_beam, "the width bounds the whole search"),
    (step_frees_continuing_parent, "got a freed table"),
    (step_shallow_copy, "new beams' tables but its ref count is"),
    (step_frees_in_reverse, "free the dead beams' tables in ascending beam index"),
])
def test_beam_step_wrong_answers(capsys, answer, hint):
    out = verdict(capsys, ch08.check_beam_step, answer)
    assert out.startswith("❌ [08.2]") and hint in out, out


def test_beam_step_right_answers(capsys):
    from paged_lib.engine.beam_search import beam_step

    assert verdict(capsys, ch08.check_beam_step, step_ok).startswith("✅ [08.2]")
    out = verdict(capsys, ch08.check_beam_step, beam_step)
    assert out.startswith("❌ [08.2]") and "you passed the library's beam_step" in out, out


def test_beam_step_not_attempted(capsys):
    def todo(*args):
        raise NotImplementedError

    assert verdict(capsys, ch08.check_beam_step, todo).startswith("⏳ [08.2]")


def test_a_learner_step_runs_a_whole_beam_search():
    mine = ch08.run_beam_search(step_ok, seed=3)
    assert mine == sharing.record_beam_search(seed=3)[0]


def test_demo_on_right_answers(capsys):
    figs = your_serving.chapter_08(apply_ok, step_ok)
    out = capsys.readouterr().out
    assert "paged attention equals SDPA" in out
    assert "tree equals the library's" in out
    assert "beams equal the engine's own" in out
    assert len(figs) == 1


def test_demo_before_the_exercises_says_what_to_finish(capsys):
    def todo(*args):
        raise NotImplementedError

    assert your_serving.chapter_08(todo, todo) == []
    out = capsys.readouterr().out
    assert out.count("⏳") == 3 and "exercise 08.1" in out and "exercise 08.2" in out


def test_demo_reports_a_missing_copy(capsys):
    def todo(*args):
        raise NotImplementedError

    your_serving.chapter_08(apply_no_copy, todo)
    out = capsys.readouterr().out
    assert "DIFFERS from SDPA" in out and out.count("⏳") == 2


def test_beam_step_is_served_in_the_engine_too(capsys, monkeypatch):
    """The last stage serves random beam workloads: a wrong ranking changes the schedule."""
    monkeypatch.setattr(ch08, "_SCRIPTED", [])
    out = verdict(capsys, ch08.check_beam_step, step_by_this_logprob)
    assert out.startswith("❌ [08.2]") and "random workload" in out, out


def step_float32_tensor(tables, cum_logprobs, candidates, beam_width):
    """Ranks a torch tensor of the scores (a stable argsort: ties to the lower beam).
    torch.tensor of Python floats is float32: two scores 1e-9 apart come out equal, so
    the lower beam wins where the higher score should. The engine's real scores never
    come that near; the scripted near tie does."""
    flat = [(cum_logprobs[i] + lp, i, tok)
            for i, opts in enumerate(candidates) for tok, lp in opts]
    order = torch.argsort(torch.tensor([s for s, _, _ in flat]), descending=True,
                          stable=True)[:beam_width].tolist() if flat else []
    used, new = set(), []
    for k in order:
        cum, parent, token = flat[k]
        new.append((parent, tables[parent].fork() if parent in used else tables[parent],
                    token, cum))
        used.add(parent)
    for i, table in enumerate(tables):
        if i not in used:
            table.free()
    return new


def test_beam_step_ranked_in_float32_fails_on_the_near_tie(capsys):
    out = verdict(capsys, ch08.check_beam_step, step_float32_tensor)
    assert out.startswith("❌ [08.2]") and "scenario 'a near tie" in out, out
    assert "less than float32 can tell" in out and "(float64)" in out, out
    assert "new beams as (parent, token) [(0, 3), (0, 5)], expected [(1, 4), (0, 3)]" in out
