"""Chapters 05-07's graders: wrong answers that once passed, or got a hint that did not name
their mistake, get ❌ with one that does; right answers of other shapes get ✅."""

from __future__ import annotations

import pytest
import torch

import paged_lib  # noqa: F401  (sets up the interpreter before anything Triton)
from paged_lib.course.grading import ch05
from paged_lib.device import interpreter_on

pytestmark = pytest.mark.usefixtures("one_torch_thread")
needs_interpreter = pytest.mark.skipif(not interpreter_on(),
                                       reason="the load trace needs Triton's interpreter")


def _verdict(capsys, check, answer) -> str:
    check(answer)
    return capsys.readouterr().out


def _fails(capsys, check, answer, ex_id: str, words: str) -> None:
    out = _verdict(capsys, check, answer)
    assert out.startswith(f"❌ [{ex_id}]") and words in out, (words, out)


# ------------------------------------------------------------------------ chapter 05

def _slots_shifts(block_tables, seq_ids, positions, block_size):
    """Wrong: pos >> log2(block_size) and pos & (block_size - 1), right for powers of two."""
    shift, pos = block_size.bit_length() - 1, positions.clamp(min=0)
    slots = block_tables.long()[seq_ids, pos >> shift] * block_size + (pos & (block_size - 1))
    return torch.where(positions >= 0, slots, -1)


def _merge_positive_only(out, lse):
    """Wrong: a segment whose log-sum-exp is <= 0 taken for an empty one."""
    keep = lse > 0
    keep = keep if keep.any() else torch.isfinite(lse)
    w = torch.exp(lse[keep] - lse[keep].max())
    return (w[:, None] * out[keep]).sum(0) / w.sum()


def test_05_6_and_05_7_wrong_answers_that_passed(capsys):
    _fails(capsys, ch05.check_slot_mapping, _slots_shifts, "05.6",
           "powers of two and fails with others: use // and %")
    _fails(capsys, ch05.check_merge_partials, _merge_positive_only, "05.7",
           "lse <= 0 is a segment like any other")


def test_05_6_padding_tested_as_minus_one_passes(capsys):
    def slots(block_tables, seq_ids, positions, block_size):  # != -1 rather than >= 0
        pos = positions.clamp(min=0)
        flat = block_tables.reshape(-1).long()[seq_ids * block_tables.shape[1] + pos // block_size]
        return torch.where(positions != -1, flat * block_size + pos % block_size, -1)
    assert _verdict(capsys, ch05.check_slot_mapping, slots).startswith("✅ [05.6]")


# isort: split
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _attention_short(q_ptr, k_ptr, v_ptr, out_ptr, N, scale, D: tl.constexpr,
                     TILE: tl.constexpr):
    """Wrong: the loop stops at N - 1, so the last key is never visited (N % TILE == 1)."""
    b = tl.program_id(0)
    d, t = tl.arange(0, D), tl.arange(0, TILE)
    q = tl.load(q_ptr + b * D + d)
    m_i, l_i, acc = float("-inf"), 0.0, tl.zeros([D], tl.float32)
    for start in range(0, N - 1, TILE):
        tok = start + t
        offs = (b * N + tok[:, None]) * D + d[None, :]
        k = tl.load(k_ptr + offs, mask=(tok < N)[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=(tok < N)[:, None], other=0.0)
        s = tl.where(tok < N, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha, p = tl.exp(m_i - m_new), tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    tl.store(out_ptr + b * D + d, acc / l_i)


@triton.jit
def _attention_by_lse(q_ptr, k_ptr, v_ptr, out_ptr, N, scale, D: tl.constexpr,
                      TILE: tl.constexpr):
    """Right, another shape: each tile normalised on its own, merged by log-sum-exp."""
    b = tl.program_id(0).to(tl.int64)
    d, t = tl.arange(0, D), tl.arange(0, TILE)
    q = tl.load(q_ptr + b * D + d) * scale
    lse, o = float("-inf"), tl.zeros([D], tl.float32)
    for start in range(0, N, TILE):
        tok = start + t
        offs = (b * N + tok[:, None]) * D + d[None, :]
        k = tl.load(k_ptr + offs, mask=(tok < N)[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=(tok < N)[:, None], other=0.0)
        s = tl.where(tok < N, tl.sum(k * q[None, :], axis=1), float("-inf"))
        p = tl.exp(s - tl.max(s, axis=0))
        tile_lse = tl.max(s, axis=0) + tl.log(tl.sum(p, axis=0))
        m = tl.maximum(lse, tile_lse)
        new = m + tl.log(tl.exp(lse - m) + tl.exp(tile_lse - m))
        o = o * tl.exp(lse - new) + tl.sum(p[:, None] * v, axis=0) / tl.sum(p, axis=0) \
            * tl.exp(tile_lse - new)
        lse = new
    tl.store(out_ptr + b * D + d, o)


@triton.jit
def _tile_block_ptr(x_ptr, out_ptr, M, N, stride_x, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """Block pointers: this Triton raises NotImplementedError (not a stub: no ⏳)."""
    start = (tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N)
    x = tl.make_block_ptr(x_ptr, (M, N), (stride_x, 1), start, (BLOCK_M, BLOCK_N), (1, 0))
    out = tl.make_block_ptr(out_ptr, (M, N), (N, 1), start, (BLOCK_M, BLOCK_N), (1, 0))
    tl.store(out, 2 * tl.load(x, boundary_check=(0, 1)), boundary_check=(0, 1))


@needs_interpreter
def test_05_4_a_key_never_visited_is_named(capsys):
    _fails(capsys, ch05.check_online_attention, _attention_short, "05.4",
           "never read K at token 0")
    assert _verdict(capsys, ch05.check_online_attention, _attention_by_lse).startswith("✅")


@needs_interpreter
def test_05_1_a_feature_triton_lacks_is_not_taken_for_a_stub(capsys):
    _fails(capsys, ch05.check_scale_tile, _tile_block_ptr, "05.1",
           "Triton raised NotImplementedError: Block pointers")


# ------------------------------------------------------------------- chapters 06-07
# isort: split
from paged_lib.course.grading import ch06, ch07  # noqa: E402


def _waiting_shrinking_chunks(waiting, step):
    """Wrong: a first chunk cut down until its blocks fit, instead of waiting."""
    if step.swapped or step.num_preempted:
        return
    while waiting:
        group = waiting[0]
        seqs = (len(group.live_seqs()) if any(s.output_token_ids for s in group.seqs)
                else max(len(group.live_seqs()), group.params.num_seqs))
        tokens = step.prefill_tokens(group)
        if step.chunked_prefill:
            tokens = min(tokens, step.tokens_left)
            if tokens < 1:
                return
            while tokens > 1 and step.free_blocks - step.blocks_needed(
                    group, tokens) < step.watermark_blocks:
                tokens -= 1
        need = step.blocks_needed(group, tokens)
        fits = (step.free_blocks - need >= step.watermark_blocks and tokens <= step.tokens_left
                and step.num_seqs + seqs <= step.max_num_seqs)
        alone = (step.is_empty() and not (step.prefill_first and step.running)
                 and need <= step.free_blocks and tokens <= step.tokens_left)
        if not (fits or alone):
            return
        step.admit(group, tokens)


def _preempt_asker_lost(group, step):
    """Wrong: when the group asking is the victim, it is freed but put in no queue."""
    while step.blocks_needed > step.free_blocks:
        after = step.running[step.running.index(group) + 1:]
        victim = step.hooks.choose_victim([group] + [g for g in after if not step.ran(g)])
        step.running.remove(victim)
        if (step.preemption == "swap" and step.is_decoding(victim)
                and step.can_swap_out(victim)):
            step.swap_out(victim)
            step.swapped.appendleft(victim)
        else:
            step.free(victim)
            if victim is not group:
                step.waiting.appendleft(victim)
        if victim is group:
            return False
    return True


def test_06_4_a_chunk_shrunk_to_fit_is_named(capsys):
    _fails(capsys, ch06.check_schedule_waiting, _waiting_shrinking_chunks, "06.4",
           "never shrunk to fit the free blocks")


def test_07_3_a_victim_in_no_queue_is_named(capsys):
    out = _verdict(capsys, ch07.check_preempt_until_fits, _preempt_asker_lost)
    assert out.startswith("❌ [07.3]") and "lost, to position -1 of no queue" in out, out
    assert "then put it at the front of step.swapped or step.waiting" in out, out


def _required_first_seq(group, block_size):
    """Wrong: a group with one live sequence measured by group.seqs[0], maybe a finished one."""
    live, prompt = group.live_seqs(), len(group.prompt_token_ids)
    if len(live) == 1:
        return -(-group.seqs[0].num_tokens // block_size)
    shared = -(-prompt // block_size)
    return shared + sum(-(-s.num_tokens // block_size) - shared for s in live) + (
        len(live) - 1 if prompt % block_size else 0)


def test_06_2_shrinking_keeps_a_live_sequence(capsys):
    """A waiting group has a live sequence: the shrunk case told keeps one (it showed a
    group of 0 live sequences, a state the spec does not have)."""
    out = _verdict(capsys, ch06.check_num_required_blocks, _required_first_seq)
    assert out.startswith("❌ [06.2]") and "count only group.live_seqs()" in out, out
    assert "0 live sequence(s)" not in out and "1 live sequence(s)" in out, out
