"""Round 51's wrong answers to chapters 07-08 that the graders let through before: each
now gets ❌ with a hint naming the mistake, and a right answer of another shape stays ✅."""

from __future__ import annotations

import pytest

from paged_lib.course.grading import ch07, ch08

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def verdict(capsys, check, answer) -> str:
    check(answer)
    out = capsys.readouterr().out
    assert out.count("\n") <= 2, out  # one verdict line, at most one hint line
    return out


# ---------------------------------------------------------------- 07.3 preempt_until_fits


def _offered(group, step):
    after = step.running[step.running.index(group) + 1:]
    return [group] + [g for g in after if not step.ran(g)]


def preempt_swap_then_recompute(group, step):
    """A swap loop, then a recompute loop for the rest of the call once a victim cannot be
    swapped: a later victim that could be swapped is recomputed too."""
    if step.preemption == "swap":
        while step.blocks_needed > step.free_blocks:
            victim = step.hooks.choose_victim(_offered(group, step))
            if not (step.is_decoding(victim) and step.can_swap_out(victim)):
                break
            step.running.remove(victim)
            step.swap_out(victim)
            step.swapped.appendleft(victim)
            if victim is group:
                return False
    while step.blocks_needed > step.free_blocks:
        victim = step.hooks.choose_victim(_offered(group, step))
        step.running.remove(victim)
        step.free(victim)
        step.waiting.appendleft(victim)
        if victim is group:
            return False
    return True


def preempt_victims_put_back_after(group, step):
    """Right, in another shape: the victims are queued after the loop, extendleft in the
    order they were preempted (the same queues as appendleft one by one)."""
    freed, swapped, runs = [], [], True
    while step.blocks_needed > step.free_blocks:
        victim = step.hooks.choose_victim(_offered(group, step))
        step.running.remove(victim)
        if step.preemption == "swap" and step.is_decoding(victim) and step.can_swap_out(victim):
            step.swap_out(victim)
            swapped.append(victim)
        else:
            step.free(victim)
            freed.append(victim)
        if victim is group:
            runs = False
            break
    step.waiting.extendleft(freed)
    step.swapped.extendleft(swapped)
    return runs


def test_07_3_a_recompute_fallback_for_the_rest_of_the_call_is_told(capsys):
    out = verdict(capsys, ch07.check_preempt_until_fits, preempt_swap_then_recompute)
    assert out.startswith("❌ [07.3]") and "a victim part way through its prompt is " \
        "recomputed, then a decoding one swapped" in out, out
    assert "the library preempts request 2 (freed, to position 0 of waiting), request 1 " \
        "(swapped out, to position 0 of swapped)" in out, out
    assert "swap falls back to recompute, for that victim alone" in out, out


def test_07_3_victims_queued_after_the_loop_pass(capsys):
    assert verdict(capsys, ch07.check_preempt_until_fits,
                   preempt_victims_put_back_after).startswith("✅ [07.3]")


# ---------------------------------------------------------------- 08.2 beam_step


def _ranked(cum_logprobs, candidates, beam_width):
    flat = [(cum_logprobs[i] + lp, i, r, tok) for i, opts in enumerate(candidates)
            for r, (tok, lp) in enumerate(opts)]
    flat.sort(key=lambda c: (-c[0], c[1], c[2]))
    return flat[:beam_width]


def beam_frees_offerless_first(tables, cum_logprobs, candidates, beam_width):
    """Frees the beams that offer no candidate before ranking, the losers after: two dead
    beams are freed out of beam order when the higher one offered nothing."""
    for i, opts in enumerate(candidates):
        if not opts:
            tables[i].free()
    best, seen, out = _ranked(cum_logprobs, candidates, beam_width), set(), []
    for cum, i, _, tok in best:
        out.append((i, tables[i].fork() if i in seen else tables[i], tok, cum))
        seen.add(i)
    for i, opts in enumerate(candidates):
        if opts and i not in seen:
            tables[i].free()
    return out


def beam_frees_dead_before_forking(tables, cum_logprobs, candidates, beam_width):
    """Right, in another shape: the dead beams freed (in beam order) before the forks."""
    best = _ranked(cum_logprobs, candidates, beam_width)
    parents = {i for _, i, _, _ in best}
    for i, table in enumerate(tables):
        if i not in parents:
            table.free()
    seen, out = set(), []
    for cum, i, _, tok in best:
        out.append((i, tables[i].fork() if i in seen else tables[i], tok, cum))
        seen.add(i)
    return out


def test_08_2_dead_beams_freed_out_of_beam_order_are_told(capsys):
    out = verdict(capsys, ch08.check_beam_step, beam_frees_offerless_first)
    assert out.startswith("❌ [08.2]") and "two beams die at once" in out, out
    assert "the free list ends" in out and "in ascending beam index" in out, out


def test_08_2_dead_beams_freed_before_the_forks_pass(capsys):
    assert verdict(capsys, ch08.check_beam_step,
                   beam_frees_dead_before_forking).startswith("✅ [08.2]")
