"""Chapters 06-07's whole pieces (06.4 ``schedule_waiting``, 07.3 ``preempt_until_fits``)
against wrong answers of each kind: each gets ❌ with a hint naming the state that exposed
it; and the library's twins (and the helpers that do the same work) are refused."""

from __future__ import annotations

import pytest

from paged_lib.course.grading import ch06, ch07
from paged_lib.course.grading.scheduler_loops import serve_scenario
from paged_lib.engine.block_manager import shared_prompt_blocks
from paged_lib.engine.hooks import EngineHooks
from paged_lib.engine.policy import (
    choose_victim,
    preempt,
    preempt_until_fits,
    schedule_waiting,
    seqs_to_come,
)
from paged_lib.engine.requests import worst_case_blocks


def verdict(capsys, check, answer) -> str:
    check(answer)
    out = capsys.readouterr().out
    assert out.count("\n") <= 2, out  # one verdict line, at most one hint line
    return out


# ---------------------------------------------------------------- 06.4 schedule_waiting


def waiting_with(gate_swapped=True, gate_preempted=True, hol=True, watermark=True,
                 alone_rule=True, strict_watermark=False, n_as_live=False, chunk=True,
                 alone_ignores_running=False, token_budget=True, strict_tokens=False,
                 strict_seqs=False, n_always=False, chunk_watermark=True, beams_as_n=False,
                 whole_blocks=False):
    """A schedule_waiting with one planted mistake (defaults: correct; gate_swapped="tight":
    only while few blocks are free; alone_rule="unchunked": not for a first chunk)."""
    def schedule(waiting, step):
        tight = gate_swapped != "tight" or step.free_blocks <= step.watermark_blocks + 2
        if (gate_swapped and step.swapped and tight) or (gate_preempted and step.num_preempted):
            return
        k = 0
        while k < len(waiting):
            group = list(waiting)[k]
            if n_always:  # even after some of its samples finished
                num_seqs = group.params.num_seqs
            elif n_as_live or any(s.output_token_ids for s in group.seqs):
                num_seqs = len(group.live_seqs())
            elif beams_as_n:  # params.n: 1 for a beam group
                num_seqs = max(len(group.live_seqs()), group.params.n)
            else:
                num_seqs = max(len(group.live_seqs()), group.params.num_seqs)
            tokens = step.prefill_tokens(group)
            if step.chunked_prefill and chunk:
                tokens = min(tokens, step.tokens_left)
                if tokens < 1:
                    return
            need = step.blocks_needed(group, step.prefill_tokens(group) if whole_blocks
                                      else tokens)  # whole_blocks: the whole prefill's
            first_chunk = tokens < step.prefill_tokens(group)  # no watermark for it
            mark = step.watermark_blocks if watermark and (chunk_watermark or not
                                                           first_chunk) else 0
            left = step.free_blocks - need
            blocks_ok = left > mark if strict_watermark else left >= mark
            seqs = step.num_seqs + num_seqs
            seqs_ok = seqs < step.max_num_seqs if strict_seqs else seqs <= step.max_num_seqs
            tokens_ok = (tokens < step.tokens_left if strict_tokens
                         else tokens <= step.tokens_left) if token_budget else True
            alone = (alone_rule and step.is_empty()
                     and not (alone_rule == "unchunked" and step.chunked_prefill)
                     and (not step.prefill_first or not step.running or alone_ignores_running)
                     and need <= step.free_blocks and tokens <= step.tokens_left)
            if not ((blocks_ok and seqs_ok and tokens_ok) or alone):
                if hol:
                    return
                k += 1
                continue
            step.admit(group, tokens)
    return schedule


def test_06_4_a_correct_answer_passes(capsys):
    assert verdict(capsys, ch06.check_schedule_waiting,
                   waiting_with()).startswith("✅ [06.4]")


@pytest.mark.parametrize("wrong, state, hint", [
    (waiting_with(gate_swapped=False), "2 group(s) swapped out", "they come back first"),
    (waiting_with(gate_preempted=False), "1 group(s) preempted this step",
     "a step that preempts admits nobody"),
    (waiting_with(hol=False), "yours admits request 0 (5 tokens), request 2",
     "head-of-line blocking"),
    (waiting_with(watermark=False), "1 free blocks (watermark 2)",
     "at least watermark_blocks must stay free"),
    (waiting_with(strict_watermark=True), "1 free blocks (watermark 0)",
     "leaving exactly watermark_blocks free is allowed"),
    (waiting_with(alone_rule=False), "a long request alone in an empty step",
     "a group alone in an empty step joins"),
    (waiting_with(n_as_live=True), "request 0 (3 sequence(s)", "a fresh n > 1 group"),
    (waiting_with(n_always=True), "request 2 (2 of its 3 sequences live, 1 finished",
     "a group that has sampled brings only its live sequences"),
    (waiting_with(chunk=False), "9 tokens to prefill, 8 of them now",
     "a first chunk of min(tokens, step.tokens_left)"),
    (waiting_with(alone_ignores_running=True), "prefill_first, 1 group(s) running",
     "alone only if nobody is running either"),
    (waiting_with(token_budget=False), "16 of 16 tokens left", "the token budget"),
    (waiting_with(strict_tokens=True), "16 of 16 tokens left",
     "reaching max_num_batched_tokens exactly is allowed"),
    (waiting_with(strict_seqs=True), "3 of 4 sequences running",
     "reaching max_num_seqs exactly is allowed"),
    (waiting_with(chunk_watermark=False), "12 tokens to prefill, 7 of them now, 2 blocks); "
     "2 free blocks (watermark 1)", "a first chunk keeps it too"),
    (waiting_with(whole_blocks=True), "10 tokens to prefill, 4 of them now, 1 blocks); 1 free",
     "the blocks are the chunk's (step.blocks_needed(group, chunk))"),
    (waiting_with(beams_as_n=True), "request 2 (3 sequence(s), 4 tokens to prefill",
     "a fresh n > 1 group (samples or beams) its n"),
])
def test_06_4_wrong_answers_are_told_with_their_state(capsys, wrong, state, hint):
    out = verdict(capsys, ch06.check_schedule_waiting, wrong)
    assert out.startswith("❌ [06.4]") and state in out and hint in out, out
    assert "the library admits" in out and "yours" in out, out


def test_06_4_an_answer_that_raises_is_told_at_its_step(capsys):
    def admits_twice(waiting, step):  # pops the group, which step.admit does itself
        if waiting and not step.swapped and not step.num_preempted:
            group = waiting.popleft()
            step.admit(group, step.prefill_tokens(group))
    out = verdict(capsys, ch06.check_schedule_waiting, admits_twice)
    assert out.startswith("❌ [06.4]") and "(ties)', at engine step 2" in out, out
    assert "raised ValueError: admit(request 0, 9): it is not waiting" in out, out
    assert "takes the group out of waiting itself" in out, out


@pytest.mark.parametrize("twin, name", [
    (lambda w, s: schedule_waiting(w, s), "schedule_waiting"),
    (schedule_waiting, "schedule_waiting"),
    (lambda w, s: waiting_with()(w, s) if not w or seqs_to_come(w[0]) else None,
     "seqs_to_come"),
])
def test_06_4_the_library_is_refused(capsys, twin, name):
    out = verdict(capsys, ch06.check_schedule_waiting, twin)
    assert out.startswith("❌ [06.4]") and f"library's {name}" in out, out


def test_06_4_the_engines_can_admit_is_refused(capsys):
    def through_hooks(waiting, step):  # step.hooks.can_admit is the library's here
        if step.swapped or step.num_preempted:
            return
        while waiting:
            group = waiting[0]
            tokens = step.prefill_tokens(group)
            if not step.hooks.can_admit(step.blocks_needed(group, tokens), 1, tokens,
                                        step.budget()):
                return
            step.admit(group, tokens)
    out = verdict(capsys, ch06.check_schedule_waiting, through_hooks)
    assert out.startswith("❌ [06.4]") and "library's can_admit" in out, out


# ---------------------------------------------------------------- 07.3 preempt_until_fits


def preempt_with(pick="hook", skip_ran=True, cpu_fallback=True, prefill_fallback=True,
                 front=True, loop=True, swap=True, false_when_self=True, eager=False,
                 swapped_front=True, offer_all_not_ran=False, swappable_only=False,
                 queue_by_mode=False, count_tables=False, swap_by_outputs=False,
                 offered_once=False):
    """A preempt_until_fits with one planted mistake (defaults: correct)."""
    def preempt_fn(group, step):
        first = True
        short = step.blocks_needed - step.free_blocks  # count_tables: counted once
        offered = None
        while (short > 0 if count_tables else step.blocks_needed > step.free_blocks) or (
                eager and first and step.running[-1] is not group
                and not step.ran(step.running[-1])):
            first = False
            if pick == "anyone":
                others = [g for g in step.running if g is not group]
            else:
                others = step.running[step.running.index(group) + 1:]
            if not (offered_once and offered):  # offered_once: the first list kept
                offered = [group] + [g for g in others if not (skip_ran and step.ran(g))]
            if offer_all_not_ran:  # every group that has not run, older ones too
                offered = [g for g in step.running if not step.ran(g)]
            if swappable_only and step.preemption == "swap":  # pass over the unswappable
                offered = [g for g in offered if step.is_decoding(g)
                           and step.can_swap_out(g)] or offered
            if pick == "asker":
                victim = offered[0]
            elif pick == "latest":  # chosen inline, not asked of the engine's rule
                victim = offered[-1]
            elif pick == "library":  # the library's rule, not the engine's
                victim = choose_victim(offered)
            else:
                victim = step.hooks.choose_victim(offered)
            if count_tables:  # each sample's table counted, shared blocks too
                short -= sum(len(s.block_table.blocks) for s in victim.live_seqs()
                             if s.block_table)
            step.running.remove(victim)
            swapping = step.preemption == "swap" and swap
            if swap_by_outputs:  # a group prefilled again after a recompute has outputs
                swapping = swapping and any(s.output_token_ids for s in victim.seqs)
            elif prefill_fallback:
                swapping = swapping and step.is_decoding(victim)
            if cpu_fallback:
                swapping = swapping and step.can_swap_out(victim)
            if swapping:
                step.swap_out(victim)
                (step.swapped.appendleft if front and swapped_front
                 else step.swapped.append)(victim)
            else:
                step.free(victim)
                queue = step.swapped if queue_by_mode and step.preemption == "swap" \
                    else step.waiting
                (queue.appendleft if front else queue.append)(victim)
            if victim is group:
                return not false_when_self
            if not loop:
                return True
        return True
    return preempt_fn


@pytest.mark.parametrize("sc", ch06.SCENARIOS + ch07.SCENARIOS, ids=lambda sc: sc.name[:40])
def test_06_4_and_07_3_scenarios_fit_and_end(sc):
    """Each scenario's requests fit the pool alone (the engine refuses one that never fits:
    it would be preempted forever) and every one finishes before the step limit."""
    bs, pool = sc.options["block_size"], sc.options["num_blocks"]
    for prompt, max_tokens, _, n, *_ in sc.requests:
        length = prompt if isinstance(prompt, int) else len(prompt)
        assert worst_case_blocks(length, max_tokens, abs(n), bs) <= pool, sc.name
    finished = serve_scenario(sc, EngineHooks(**dict(sc.hooks)), [None])[3][0]
    assert None not in finished.values(), sc.name


def test_07_3_a_correct_answer_passes(capsys):
    assert verdict(capsys, ch07.check_preempt_until_fits,
                   preempt_with()).startswith("✅ [07.3]")


@pytest.mark.parametrize("wrong, state, hint", [
    (preempt_with(pick="asker"), "request 2 needs 1 free blocks and 0 are free",
     "the latest admitted goes first"),
    (preempt_with(pick="anyone"), "request 1 (admitted at step 5, 2 sequence(s), part way "
     "through a prefill, 5 blocks), request 2 (admitted at step 6",
     "never preempt a group admitted before the one asking"),
    (preempt_with(skip_ran=False), "ran this step",
     "a group that already ran this step cannot be preempted"),
    (preempt_with(cpu_fallback=False), "the CPU pool has 5 free blocks; the engine's "
     "choose_victim takes the oldest admitted first (the group asking): your "
     "preempt_until_fits raised OutOfBlocks",
     "swap falls back to recompute"),
    (preempt_with(prefill_fallback=False), "part way through a prefill",
     "a group part way through a prefill cannot be swapped"),
    (preempt_with(front=False), "to position 0 of waiting", "FRONT of its queue"),
    (preempt_with(loop=False), "the library preempts request 2 (freed, to position 1 of "
     "waiting), request 1", "keep preempting"),
    (preempt_with(swap=False), "preemption 'swap'", "copies a decoding victim"),
    (preempt_with(false_when_self=False), "the library preempts request 1",
     "False when it was preempted itself"),
    (preempt_with(eager=True), "needs 0 free blocks and 6 are free",
     "nobody at all when they already fit"),
    (preempt_with(swapped_front=False), "to position 0 of swapped",
     "a victim swapped out goes to the FRONT of step.swapped"),
    (preempt_with(pick="latest"), "the engine's choose_victim takes the oldest admitted first",
     "ask step.hooks.choose_victim for the victim: the engine's rule may be another one"),
    (preempt_with(pick="library"), "the engine's choose_victim takes the oldest admitted first",
     "ask step.hooks.choose_victim for the victim: the engine's rule may be another one"),
    # wrong rules a learner deriving the loop from its goal may write
    (preempt_with(offer_all_not_ran=True), "request 1 (admitted at step 5, 2 sequence(s), "
     "part way through a prefill, 4 blocks), request 2", "even one that has not run yet"),
    (preempt_with(swappable_only=True), "the CPU pool has 4 free blocks: the library preempts "
     "request 0 (freed, to position 0 of waiting)", "it is still the victim, recomputed"),
    (preempt_with(queue_by_mode=True), "yours preempts request 1 (freed, to position 0 of "
     "swapped)", "it is prefilled again from its text, from step.waiting"),
    (preempt_with(count_tables=True), "random workload 14 for your preempt_until_fits",
     "one victim may free too few (a group shares blocks"),
    (preempt_with(swap_by_outputs=True), "request 1 (admitted at step 5, 2 sequence(s), part "
     "way through a prefill, 4 blocks)] (admission order); preemption 'swap'",
     "outputs or not: a recomputed group prefills them again"),
    (preempt_with(offered_once=True), "raised ValueError: list.remove(x): x not in list",
     "a victim is offered once: build the list again"),
])
def test_07_3_wrong_answers_are_told_with_their_state(capsys, wrong, state, hint):
    out = verdict(capsys, ch07.check_preempt_until_fits, wrong)
    assert out.startswith("❌ [07.3]") and state in out and hint in out, out


@pytest.mark.parametrize("twin, name", [
    (lambda g, s: preempt_until_fits(g, s), "preempt_until_fits"),
    (preempt_until_fits, "preempt_until_fits"),
    (lambda g, s: preempt_with()(g, s) if s.blocks_needed <= s.free_blocks
     else (preempt(g, s), False)[1], "preempt"),
])
def test_07_3_the_library_is_refused(capsys, twin, name):
    out = verdict(capsys, ch07.check_preempt_until_fits, twin)
    assert out.startswith("❌ [07.3]") and f"library's {name}" in out, out


def test_07_3_not_attempted(capsys):
    def stub(*args):
        raise NotImplementedError()
    assert verdict(capsys, ch07.check_preempt_until_fits, stub).startswith("⏳ [07.3]")
    assert verdict(capsys, ch06.check_schedule_waiting, stub).startswith("⏳ [06.4]")


# ---------------------------------------------------------------- helpers that are the exercise


def test_06_1_and_06_2_refuse_the_helpers_that_do_the_same_work(capsys):
    import torch

    from paged_lib.kernels import slot_mapping_from_positions
    from paged_lib.model import AttentionMetadata

    def via_kernel_helper(tables, seq_lens, query_lens, bs):
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
        ids = torch.tensor([s for s, (n, q) in enumerate(zip(seq_lens, query_lens, strict=True))
                            for _ in range(n - q, n)])
        pos = torch.tensor([p for n, q in zip(seq_lens, query_lens, strict=True)
                            for p in range(n - q, n)])
        return AttentionMetadata(slot_mapping_from_positions(padded, ids, pos, bs), padded,
                                 torch.tensor(seq_lens, dtype=torch.int32),
                                 torch.tensor(query_lens, dtype=torch.int32), pos)
    out = verdict(capsys, ch06.check_build_metadata, via_kernel_helper)
    assert out.startswith("❌ [06.1]") and "slot_mapping_from_positions" in out, out

    def via_shared(group, bs):
        seqs, prompt = group.live_seqs(), len(group.prompt_token_ids)
        if len(seqs) == 1:
            return -(-seqs[0].num_tokens // bs)
        return shared_prompt_blocks(prompt, [s.num_tokens - prompt for s in seqs], bs)
    out = verdict(capsys, ch06.check_num_required_blocks, via_shared)
    assert out.startswith("❌ [06.2]") and "library's shared_prompt_blocks" in out, out
