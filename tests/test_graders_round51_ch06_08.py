"""Round 51's wrong answers to chapters 07-08 that the graders let through before: each
now gets ❌ with a hint naming the mistake, and a right answer of another shape stays ✅."""

from __future__ import annotations

import pytest

from paged_lib.course.grading import ch06, ch07, ch08

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def verdict(capsys, check, answer) -> str:
    check(answer)
    out = capsys.readouterr().out
    assert out.count("\n") <= 2, out  # one verdict line, at most one hint line
    return out


# ---------------------------------------------------------------- 06.2, 06.4: hints


def required_prompt_plus_outputs(group, block_size):
    """One live sequence counted as its prompt's blocks plus its outputs' blocks: the
    first outputs fill the prompt's last block, so this counts one block too many."""
    seqs, prompt = group.live_seqs(), len(group.prompt_token_ids)
    if len(seqs) == 1:
        return -(-prompt // block_size) + -(-len(seqs[0].output_token_ids) // block_size)
    shared = -(-prompt // block_size)
    return shared + sum(-(-s.num_tokens // block_size) - shared for s in seqs) + (
        len(seqs) - 1 if prompt % block_size else 0)


def waiting_planned_up_front(waiting, step):
    """Every waiting group's prefill tokens read before admitting any: a prefix the first
    admitted group cached shortens the next one's, and admit refuses the stale count."""
    if step.swapped or step.num_preempted:
        return
    plan = [(g, step.prefill_tokens(g)) for g in list(waiting)]
    for group, tokens in plan:
        if step.chunked_prefill:
            tokens = min(tokens, step.tokens_left)
            if tokens < 1:
                return
        need = step.blocks_needed(group, tokens)
        seqs = len(group.live_seqs()) if any(s.output_token_ids for s in group.seqs) else max(
            len(group.live_seqs()), group.params.num_seqs)
        ok = tokens <= step.tokens_left
        fits = ok and step.free_blocks - need >= step.watermark_blocks and (
            step.num_seqs + seqs <= step.max_num_seqs)
        alone = step.is_empty() and (not step.prefill_first or not step.running) and ok and (
            need <= step.free_blocks)
        if not (fits or alone):
            return
        step.admit(group, tokens)


def test_06_2_prompt_blocks_plus_output_blocks_is_told_the_text_is_one(capsys):
    out = verdict(capsys, ch06.check_num_required_blocks, required_prompt_plus_outputs)
    assert out.startswith("❌ [06.2]") and "1 live sequence(s) preempted by recompute" in out, out
    assert "not the prompt's blocks plus the outputs' blocks" in out, out


def test_06_4_prefill_tokens_read_before_the_loop_is_told_the_prefix(capsys):
    out = verdict(capsys, ch06.check_schedule_waiting, waiting_planned_up_front)
    assert out.startswith("❌ [06.4]") and "enable_prefix_caching=True" in out, out
    assert "its first prefill has 12 tokens to compute" in out, out
    assert "asked when it is the head (a group admitted just before it may have cached" in out


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
