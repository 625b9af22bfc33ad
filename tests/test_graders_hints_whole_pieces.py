"""The whole-piece engine graders (06.4, 07.3, 08.2, 10.4) on combined options and rarer
states: wrong pieces that once passed, or failed with a hint that named another mistake,
get ❌ with the state and the rule they break."""

from __future__ import annotations

import functools

import pytest
from test_graders_ch06_07_pieces import waiting_with
from test_graders_ch10 import alloc

from paged_lib.course.grading import ch06, ch07, ch08, ch10

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def verdict(capsys, check, answer) -> str:
    check(answer)
    out = capsys.readouterr().out
    assert out.count("\n") <= 2, out
    return out


def test_06_4_the_alone_rule_holds_for_a_first_chunk_too(capsys):
    """No exception for a group alone in an empty step under chunked prefill: it passed
    (no case put a first chunk alone into the watermark); then its hint blamed the chunk."""
    out = verdict(capsys, ch06.check_schedule_waiting, waiting_with(alone_rule="unchunked"))
    assert out.startswith("❌ [06.4]") and "a first chunk alone in an empty step" in out, out
    assert "or with chunked prefill its first chunk), even into the watermark" in out, out


def test_07_3_a_group_part_way_through_its_prefill_is_a_candidate(capsys):
    """Offering choose_victim only the decoding groups was caught, told 'the latest goes
    first'; the hint now names the candidates."""
    def preempt(group, step):
        while step.blocks_needed > step.free_blocks:
            after = step.running[step.running.index(group) + 1:]
            offered = [group] + [g for g in after if not step.ran(g) and step.is_decoding(g)]
            v = step.hooks.choose_victim(offered)
            step.running.remove(v)
            if step.preemption == "swap" and step.is_decoding(v) and step.can_swap_out(v):
                step.swap_out(v)
                step.swapped.appendleft(v)
            else:
                step.free(v)
                step.waiting.appendleft(v)
            if v is group:
                return False
        return True

    out = verdict(capsys, ch07.check_preempt_until_fits, preempt)
    assert out.startswith("❌ [07.3]") and "part way through a prefill" in out, out
    assert "a group part way through its prefill" in out and "decoding or not" in out, out


def test_10_4_a_first_chunk_after_a_hit_counts_from_the_hit(capsys):
    """A chunk's end taken as max_new_tokens itself (not after the hit) passed: no case,
    and 1 of 16 workloads, asked for a chunk after a cache hit."""
    out = verdict(capsys, ch10.check_allocate_slots,
                  functools.partial(alloc, chunk_from_zero=True))
    assert out.startswith("❌ [10.4]") and "a hit of 3 blocks, then a first chunk" in out, out
    assert "its budget counts only the tokens it computes" in out, out


def test_08_2_scores_added_in_float32_are_told_so(capsys):
    """A vectorised beam_step scoring in a float32 tensor was told only the formula."""
    import torch

    def beam_step(tables, cum, cands, width):
        flat = [(i, r, t, lp) for i, o in enumerate(cands) for r, (t, lp) in enumerate(o)]
        if not flat:
            scores = []
        else:
            scores = (torch.tensor([cum[i] for i, *_ in flat])
                      + torch.tensor([lp for *_, lp in flat])).tolist()
        order = sorted(range(len(flat)), key=lambda k: (-scores[k], flat[k][0], flat[k][1]))
        used, out = set(), []
        for k in order[:width]:
            p, t = flat[k][0], flat[k][2]
            out.append((p, tables[p].fork() if p in used else tables[p], t, scores[k]))
            used.add(p)
        for i, table in enumerate(tables):
            if i not in used:
                table.free()
        return out

    out = verdict(capsys, ch08.check_beam_step, beam_step)
    assert out.startswith("❌ [08.2]") and "cum_logprob" in out, out
    assert "a float32 tensor (torch.tensor's default) rounds it" in out, out


def test_06_4_prefill_first_has_its_own_scenario(capsys):
    """prefill_first was drawn by 1 of the 16 random workloads, the only place an alone
    rule that forgot the running groups was caught: a named scenario now serves it."""
    out = verdict(capsys, ch06.check_schedule_waiting, waiting_with(alone_ignores_running=True))
    assert out.startswith("❌ [06.4]") and "in 'prefill_first, watermark 2" in out, out
    assert "with prefill_first it is alone only if nobody is running" in out, out


def test_06_4_nobody_joins_while_swapped_even_with_blocks_free(capsys):
    """Admitting while a group is swapped out when blocks seemed plenty passed: the one
    swap scenario never had free blocks then, and 1 of 16 workloads swapped."""
    out = verdict(capsys, ch06.check_schedule_waiting, waiting_with(gate_swapped="tight"))
    assert out.startswith("❌ [06.4]") and "1 group(s) swapped out" in out, out
    assert "nobody new is admitted while any is swapped" in out, out
