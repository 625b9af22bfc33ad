"""The generated stage of the numeric pieces' graders (09.3, 11.3, 05.5):
paged_lib.course.grading.generated.numeric with 11.3's cases (ch11_quant) and 05.5's
(numeric_decode).

For each piece: the cases are seeded and reach states no fixed case does; a wrong answer
that every fixed case lets through gets ❌ from the generated stage with a shrunk story
that names the state; and the three likeliest mistakes get ❌ with a hint that names them.
"""

import math

import pytest
import torch
import triton
import triton.language as tl
from stage_verdicts import verdict

import paged_lib  # noqa: F401  # isort: split
from paged_lib.course.grading import ch05, ch09, ch11, ch11_quant
from paged_lib.course.grading.generated import numeric, numeric_decode
from paged_lib.device import interpreter_on

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_cases_are_seeded_and_reach_states_the_fixed_cases_do_not():
    assert numeric.tile_cases() == numeric.tile_cases()
    assert ch11_quant.int8_cases() == ch11_quant.int8_cases()
    assert numeric_decode.decode_cases() == numeric_decode.decode_cases()
    tiles = numeric.states(numeric.tile_cases())
    assert tiles["float16 with scores past 88"] and tiles["tied scores"]
    assert tiles["tiny scores"] and tiles["groups of 7"] and tiles["block size 12"]
    int8 = numeric.states(ch11_quant.int8_cases())
    assert int8["values below float32's tiny"] and int8["a call into 3 or more blocks"]
    assert int8["block size 7"] and int8["more than 2 KV heads"]
    decode = numeric.states(numeric_decode.decode_cases())
    assert decode["a scale that is not 1 / sqrt(HEAD_DIM)"] and decode["GROUP 5"]
    assert decode["tied scores"] and decode["tiny scores"] and decode["one KV head"]


# ------------------------------------------------------------------ 09.3 attend_tiles


def tiles(q, k_cache, v_cache, block_table, seq_len, tile, *, dtype=None, m0=-math.inf,
          kv_of=lambda i, h, kv: i // (h // kv)):
    """An online softmax over tiles; ``dtype``: the type it computes in (default: the
    spec's), ``m0``: the running max it starts from, ``kv_of``: the KV heads of the
    query heads ``i``."""
    h, d = q.shape
    bs, kv = k_cache.shape[1], k_cache.shape[2]
    if seq_len == 0:
        return torch.zeros_like(q)
    dt = dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    heads = kv_of(torch.arange(h), h, kv)
    qf = q.to(dt) * d ** -0.5
    m = torch.full((h,), m0, dtype=dt)
    den, acc = torch.zeros(h, dtype=dt), torch.zeros(h, d, dtype=dt)
    for start in range(0, seq_len, tile):
        pos = torch.arange(start, min(start + tile, seq_len))
        blocks = block_table[pos // bs].long()
        k = k_cache[blocks, pos % bs][:, heads].to(dt)
        v = v_cache[blocks, pos % bs][:, heads].to(dt)
        s = torch.einsum("hd,thd->ht", qf, k)
        m_new = torch.maximum(m, s.amax(1))
        p, c = torch.exp(s - m_new[:, None]), torch.exp(m - m_new)
        den, acc, m = c * den + p.sum(1), c[:, None] * acc + torch.einsum("ht,thd->hd", p, v), \
            m_new
    return (acc / den[:, None]).to(q.dtype)


def tiles_in_q_dtype(q, k_cache, v_cache, block_table, seq_len, tile):
    """Computes in q's own dtype (float16 too): right in float32 and float64, and close
    enough in float16 while scores are a few units apart."""
    return tiles(q, k_cache, v_cache, block_table, seq_len, tile, dtype=q.dtype)


def test_09_3_the_solution_and_right_answers_pass_the_generated_cases():
    for answer in (tiles, ):
        assert verdict(ch09.check_attend_tiles, answer)[0] == "✅"


def test_09_3_a_float16_accumulation_is_caught_only_by_the_generated_cases(monkeypatch):
    assert verdict(ch09.check_attend_tiles, tiles_in_q_dtype, monkeypatch)[0] == "✅"
    mark, message, hint = verdict(ch09.check_attend_tiles, tiles_in_q_dtype)
    assert mark == "❌" and message.startswith("generated case"), message
    assert "float16" in message and "scores a few units apart, all far from 0" in message
    assert "passes in float32 and fails in float16" in hint


@pytest.mark.parametrize("wrong, words", [
    (tiles_in_q_dtype, "passes in float32 and fails in float16"),
    (lambda *a: tiles(*a, m0=0.0), "starting from -inf (not 0)"),
    (lambda *a: tiles(*a, kv_of=lambda i, h, kv: i % kv), "h % num_kv_heads"),
])
def test_09_3_likely_mistakes_are_named(wrong, words):
    mark, _, hint = verdict(ch09.check_attend_tiles, wrong)
    assert mark == "❌" and words in hint, hint


# ------------------------------------------------------------------ 11.3 write_int8_blocks

TINY = torch.finfo(torch.float32).tiny


def int8_write(x, data, scale, slots, *, shifts=False, requantise=True, fresh=True,
               rnd=torch.round, code=None):
    """The block write; ``shifts``: block and offset by >> and & (powers of two only);
    ``code(v, scale)``: how a new value becomes a code (default ``rnd(v / scale)``)."""
    bs = data.shape[1]
    if shifts:
        blocks, offsets = slots >> (bs.bit_length() - 1), slots & (bs - 1)
    else:
        blocks, offsets = slots // bs, slots % bs
    for b in torch.unique(blocks).tolist():
        here = blocks == b
        vals = x[here].float()
        need = vals.abs().amax(dim=(0, 2)) / 127
        old = scale[b].clone()
        if fresh and bool((offsets[here] == 0).any()):
            old.zero_()
        old = torch.nan_to_num(old, nan=0.0)
        new = torch.where(need > old, torch.maximum(need, 2 * old), old).clamp(min=TINY)
        if requantise:
            ratio = torch.where(old > 0, old / new, torch.zeros_like(old))
            data[b] = rnd(data[b].float() * ratio[None, :, None]).clamp(-127, 127).to(
                torch.int8)
        scale[b] = new
        new_codes = (code or (lambda v, s: rnd(v / s)))(vals, new[None, :, None])
        data[b, offsets[here]] = new_codes.clamp(-127, 127).to(torch.int8)


def int8_shifts(x, data, scale, slots):
    return int8_write(x, data, scale, slots, shifts=True)


def test_11_3_the_solution_passes_the_generated_cases():
    assert verdict(ch11.check_write_int8_blocks, int8_write)[0] == "✅"


def test_11_3_shifts_for_block_and_offset_are_caught_only_by_the_generated_cases(
        monkeypatch):
    assert verdict(ch11.check_write_int8_blocks, int8_shifts, monkeypatch)[0] == "✅"
    mark, message, hint = verdict(ch11.check_write_int8_blocks, int8_shifts)
    assert mark == "❌" and message.startswith("generated case"), message
    assert "(not a power of two)" in message and "which the call does not write" in message
    assert "slot // block_size" in hint


@pytest.mark.parametrize("wrong, words", [
    (int8_shifts, "not a power of two"),
    (lambda *a: int8_write(*a, requantise=False), "must be requantised"),
    (lambda *a: int8_write(*a, fresh=False), "starts the block afresh"),
    (lambda *a: int8_write(*a, rnd=torch.trunc), "do not truncate"),
])
def test_11_3_likely_mistakes_are_named(wrong, words):
    mark, _, hint = verdict(ch11.check_write_int8_blocks, wrong)
    assert mark == "❌" and words in hint, hint


# ------------------------------------------------------------------ 05.5 the decode kernel

needs_interpreter = pytest.mark.skipif(not interpreter_on(),
                                       reason="the load trace needs Triton's interpreter")


@triton.jit
def _decode(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale,
            max_blocks, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
            GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BUG: tl.constexpr = 0):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + g
    if BUG == 3:  # query head h paired with KV head h % NUM_KV_HEADS
        heads = kv_head + g * NUM_KV_HEADS
    rows = (g < GROUP)[:, None]
    q_offs = (seq * NUM_KV_HEADS * GROUP + heads[:, None]) * HEAD_DIM + d[None, :]
    if BUG == 5:  # the query tile's padding rows loaded too: past q's end, last program
        q = tl.load(q_ptr + q_offs)
    else:
        q = tl.load(q_ptr + q_offs, mask=rows, other=0.0)
    if BUG == 1:  # the scale every model "has": 1 / sqrt(HEAD_DIM), not the argument
        scale = 1.0 / tl.sqrt(HEAD_DIM * 1.0)
    seq_len = tl.load(seq_lens_ptr + seq)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * max_blocks + j).to(tl.int64)
        valid = j * BLOCK_SIZE + t < seq_len
        if BUG == 4:  # one slot too many
            valid = j * BLOCK_SIZE + t <= seq_len
        offs = ((block * BLOCK_SIZE + t[:, None]) * NUM_KV_HEADS + kv_head) * HEAD_DIM \
            + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        if BUG == 2:  # nothing rescaled when the running max grows
            alpha = tl.full([GROUP_PAD], 1.0, tl.float32)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    tl.store(out_ptr + q_offs, acc / l_i[:, None], mask=rows)


class Bugged:
    """The kernel launched with ``BUG=bug``."""

    def __init__(self, bug: int):
        self.bug = bug

    def __getitem__(self, grid):
        return lambda *a, **kw: _decode[grid](*a, BUG=self.bug, **kw)


@needs_interpreter
def test_05_5_the_solution_passes_the_generated_cases():
    assert verdict(ch05.check_paged_decode_kernel, _decode)[0] == "✅"


@needs_interpreter
def test_05_5_a_kernel_that_ignores_its_scale_is_caught_only_by_the_generated_cases(
        monkeypatch):
    wrong = Bugged(1)
    assert verdict(ch05.check_paged_decode_kernel, wrong, monkeypatch)[0] == "✅"
    mark, message, hint = verdict(ch05.check_paged_decode_kernel, wrong)
    assert mark == "❌" and message.startswith("generated case"), message
    assert "scale 1 / sqrt(1.125 x HEAD_DIM)" in message or "scale 1 / sqrt(1.5" in message
    assert "multiply the scores by the kernel's scale argument" in hint


@needs_interpreter
@pytest.mark.parametrize("bug, words", [
    (1, "scale argument"), (2, "exp(m_old - m_new)"), (3, "not h % num_kv_heads"),
    (4, "valid = position < seq_len")])
def test_05_5_likely_mistakes_are_named(bug, words):
    mark, _, hint = verdict(ch05.check_paged_decode_kernel, Bugged(bug))
    assert mark == "❌" and words in hint, hint
