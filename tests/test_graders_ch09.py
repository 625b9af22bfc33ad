"""Chapter 09's graders against typical wrong answers: each gets ❌ with a hint naming it."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from paged_lib.course.demos import your_counts
from paged_lib.course.grading import ch09
from paged_lib.studies.block_size import choose_block_size, internal_waste
from paged_lib.util import cdiv


def verdict(capsys, check, answer) -> str:
    check(answer)
    out = capsys.readouterr().out
    assert out.count("\n") <= 2, out  # one verdict line, at most one hint line
    return out


def _bad_input(lengths, b):
    if b < 1 or len(lengths) == 0 or min(lengths) < 1:
        raise ValueError("bad input")


def waste_with(blocks=lambda n, b: cdiv(n, b), over="held", per_seq=False, check=True,
               cast=float):
    """An internal_waste with one planted mistake (defaults: correct)."""
    def fn(lengths, b):
        if check:
            _bad_input(lengths, b)
        held = [blocks(n, b) * b for n in lengths]
        if per_seq:
            return cast(sum((h - n) / h for h, n in zip(held, lengths, strict=True))
                        / len(lengths))
        den = sum(held) if over == "held" else sum(lengths)
        return cast((sum(held) - sum(lengths)) / den)
    return fn


def test_09_1_a_correct_answer_passes_and_the_library_is_refused(capsys):
    assert verdict(capsys, ch09.check_internal_waste, waste_with()).startswith("✅ [09.1]")
    out = verdict(capsys, ch09.check_internal_waste, internal_waste)
    assert out.startswith("❌ [09.1]") and "internal_waste" in out


@pytest.mark.parametrize("wrong, hint", [
    (waste_with(blocks=lambda n, b: n // b + 1), "off by one block"),
    (waste_with(blocks=lambda n, b: n // b), "partly filled last block is not counted"),
    (waste_with(per_seq=True), "averaged over sequences instead of over slots"),
    (waste_with(over="tokens"), "divided by the tokens"),
    (lambda lengths, b: 1 - waste_with()(lengths, b), "returned the filled share"),
    (lambda lengths, b: 0.0, "whole blocks"),  # every last block counted as full
    (waste_with(check=False), "raises ValueError"),
    (lambda lengths, b: (sum(cdiv(n, b) * b for n in lengths) - sum(lengths))
     // sum(cdiv(n, b) * b for n in lengths), "integer division"),
    (lambda lengths, b: f"{waste_with()(lengths, b):.3f}", "as a float"),
])
def test_09_1_wrong_answers_get_a_named_hint(capsys, wrong, hint):
    out = verdict(capsys, ch09.check_internal_waste, wrong)
    assert out.startswith("❌ [09.1]") and hint in out, out


def _own_waste(lengths, b):  # the learner's own 09.1 (09.2 refuses the library's)
    return waste_with()(lengths, b)


def choice_with(pick="largest", strict=False, none="least", waste=None, check=True,
                cast=int):
    """A choose_block_size with one planted mistake (defaults: correct)."""
    def fn(lengths, allowed, budget):
        if check and (not allowed or not 0 <= budget < 1):
            raise ValueError("bad input")
        w = {b: (waste or _own_waste)(lengths, b) for b in allowed}
        fits = [b for b in allowed if (w[b] < budget if strict else w[b] <= budget)]
        if fits:
            return cast({"largest": max(fits), "smallest": min(fits), "first": fits[0]}[pick])
        if none == "largest":
            return cast(max(allowed))
        if none == "tie-larger":
            return cast(min(w, key=lambda b: (w[b], -b)))
        return cast(min(w, key=lambda b: (w[b], b)))
    return fn


def _per_seq_waste(lengths, b):
    return sum((cdiv(n, b) * b - n) / (cdiv(n, b) * b) for n in lengths) / len(lengths)


def test_09_2_a_correct_answer_passes_and_the_library_is_refused(capsys):
    assert verdict(capsys, ch09.check_choose_block_size, choice_with()).startswith("✅ [09.2]")
    out = verdict(capsys, ch09.check_choose_block_size, choose_block_size)
    assert out.startswith("❌ [09.2]") and "choose_block_size" in out


@pytest.mark.parametrize("wrong, hint", [
    (choice_with(pick="smallest"), "the largest one is asked"),
    (choice_with(pick="first"), "allowed is not sorted"),
    (choice_with(strict=True), "exactly at max_waste fits"),
    (choice_with(none="largest"), "the one that wastes least"),
    (choice_with(none="tie-larger"), "return the smaller"),
    (choice_with(waste=_per_seq_waste), "averaged over sequences"),
    (choice_with(cast=float), "an int"),
    (choice_with(check=False), "raises ValueError"),
])
def test_09_2_wrong_answers_get_a_named_hint(capsys, wrong, hint):
    out = verdict(capsys, ch09.check_choose_block_size, wrong)
    assert out.startswith("❌ [09.2]") and hint in out, out


def test_09_demo_runs_on_the_library_answers(capsys):
    your_counts.chapter_09(waste_with(), choice_with())
    out = capsys.readouterr().out
    assert "sharegpt: waste" in out and "alpaca: waste" in out and "FlashMLA" in out


# ---------------------------------------------------------------- the issue's classes


def _float32_waste(lengths, b):
    held = sum(cdiv(n, b) * b for n in lengths)
    return float(np.float32(held - sum(lengths)) / np.float32(held))


def test_09_1_float32_then_cast_gets_named(capsys):
    def fn(lengths, b):
        _bad_input(lengths, b)
        return _float32_waste(lengths, b)

    out = verdict(capsys, ch09.check_internal_waste, fn)
    assert out.startswith("❌ [09.1]") and "computed in float32, then cast" in out, out


def choice_smallest_fallback(lengths, allowed, budget):
    if not allowed or not 0 <= budget < 1:
        raise ValueError("bad input")
    fits = [b for b in allowed if _own_waste(lengths, b) <= budget]
    return max(fits) if fits else min(allowed)  # right whenever the sizes divide each other


def choice_in_set_order(lengths, allowed, budget):
    if not allowed or not 0 <= budget < 1:
        raise ValueError("bad input")
    best = None
    for b in set(allowed):  # small sets of small sizes come out sorted; others do not
        if _own_waste(lengths, b) <= budget:
            best = b
    return best if best is not None else _least(lengths, allowed)


def _least(lengths, allowed):
    w = {b: _own_waste(lengths, b) for b in allowed}
    return min(w, key=lambda b: (w[b], b))


def choice_by(waste):
    def fn(lengths, allowed, budget):
        if not allowed or not 0 <= budget < 1:
            raise ValueError("bad input")
        w = {b: waste(lengths, b) for b in allowed}
        fits = [b for b in allowed if w[b] <= budget]
        return max(fits) if fits else min(w, key=lambda b: (w[b], b))
    return fn


choice_float32 = choice_by(_float32_waste)


@pytest.mark.parametrize("wrong, state, hint", [
    (choice_smallest_fallback, "not powers of two", "the smallest size does only when"),
    (choice_in_set_order, "a long trace", "a set is not either"),
    (choice_float32, "exactly the budget of 0.1", "the waste computed in float32"),
])
def test_09_2_the_issues_classes_get_named(capsys, wrong, state, hint):
    out = verdict(capsys, ch09.check_choose_block_size, wrong)
    assert out.startswith("❌ [09.2]") and state in out and hint in out, out


def choice_fitting(fits):
    """A choose_block_size deciding "within the budget" by ``fits(held, tokens, budget)``."""
    def fn(lengths, allowed, budget):
        if not allowed or not 0 <= budget < 1:
            raise ValueError("bad input")
        held = {b: sum(cdiv(n, b) * b for n in lengths) for b in allowed}
        within = [b for b in allowed if fits(held[b], sum(lengths), budget)]
        return max(within) if within else _least(lengths, allowed)
    return fn


_AT_03 = "choose_block_size([7], [10, 1], 0.3)"
_AT_035 = "choose_block_size([13], [20, 4], 0.35)"


@pytest.mark.parametrize("wrong, state, hint", [
    # a learner's answer: the library returns 10 there, the float 0.3 being a hair below 3/10
    (choice_fitting(lambda h, t, m: Fraction(h - t, h) <= Fraction(m)), _AT_03 + " (size 10 "
     "wastes 3/10", ["the waste equals the budget as the float you are given",
                     "compared as exact fractions with Fraction(max_waste)"]),
    (choice_fitting(lambda h, t, m: (h - t) / h <= float(np.float32(m))), _AT_035,
     ["the waste equals the budget as the floats you are given",
      "max_waste rounded to float32"]),
    (choice_fitting(lambda h, t, m: bool(np.float32(h - t) / np.float32(h) <= m)),
     "choose_block_size([23040] * 10000 + [23039], [25600, 256], 0.1)",
     ["the waste is a hair above the budget", "in float32 (torch's default dtype"]),
    (choice_fitting(lambda h, t, m: bool(torch.tensor(h - t) / torch.tensor(h) <= m)),
     "one slot more than 0.1 of 256,025,600", ["the waste is a hair above the budget"]),
    (choice_fitting(lambda h, t, m: 1 - t / h <= m), _AT_03,
     ["the waste computed as 1 - tokens / held"]),
    (choice_fitting(lambda h, t, m: h - t <= m * h), "choose_block_size([5, 25, 45, 42], "
     "[20, 5], 0.35)", ["the budget multiplied out"]),
])
def test_09_2_a_waste_at_a_budget_a_float_holds_approximately(capsys, wrong, state, hint):
    """The budget is the float the learner is given, compared with the float 09.1 returns:
    exact fractions, float32 on either side, and other roundings are told apart."""
    out = verdict(capsys, ch09.check_choose_block_size, wrong)
    assert out.startswith("❌ [09.2]") and state in out and all(h in out for h in hint), out


def test_09_2_the_at_budget_cases_are_what_the_library_says():
    assert choose_block_size([7], [10, 1], 0.3) == 10  # 3 / 10 == 0.3 as floats
    assert Fraction(3, 10) > Fraction(0.3)  # what an exact comparison sees
    assert choose_block_size([13], [20, 4], 0.35) == 20 and float(np.float32(0.35)) < 0.35
    assert choose_block_size([5, 25, 45, 42], [20, 5], 0.35) == 20 and 0.35 * 180 < 63
    assert choose_block_size([23040] * 10_000 + [23039], [25600, 256], 0.1) == 256


@pytest.mark.parametrize("fits", [
    lambda h, t, m: Fraction(h - t, h) <= Fraction(str(m)),  # the decimal the learner typed
    lambda h, t, m: (h - t) / h <= m + 1e-12,  # a tolerance far below one slot
])
def test_09_2_other_readings_that_agree_with_the_float_pass(capsys, fits):
    assert verdict(capsys, ch09.check_choose_block_size, choice_fitting(fits)).startswith(
        "✅ [09.2]")


# ---------------------------------------------------------------- 09.3 attend_tiles


def tiles_with(block_of="block", rescale=True, kv="group", scale=True, wide=None,
               whole_tiles=False, mask=True, at_once=False, empty="zeros"):
    """An attend_tiles with one planted mistake (defaults: correct)."""
    def fn(q, k_cache, v_cache, block_table, seq_len, tile):
        h, d = q.shape
        bs, nkv = k_cache.shape[1], k_cache.shape[2]
        dt = wide or (torch.float64 if q.dtype == torch.float64 else torch.float32)
        heads = torch.arange(h) // (h // nkv) if kv == "group" else torch.arange(h) % nkv
        qf = q.to(dt) * (d ** -0.5 if scale else 1.0)
        m = torch.full((h,), -math.inf, dtype=dt)
        den, acc = torch.zeros(h, dtype=dt), torch.zeros(h, d, dtype=dt)
        table = torch.as_tensor(block_table).long()
        end = seq_len // tile * tile if whole_tiles else seq_len
        step = max(seq_len, 1) if at_once else tile
        for start in range(0, end, step):
            stop = min(start + step, seq_len)
            if not mask:  # whole blocks, slots past the end included
                stop = min(-(-stop // bs) * bs, table.numel() * bs)
            pos = torch.arange(start, stop)
            blocks = table[pos // bs] if block_of == "block" else table[pos // tile]
            k = k_cache[blocks, pos % bs].to(dt)[:, heads]
            v = v_cache[blocks, pos % bs].to(dt)[:, heads]
            s = torch.einsum("hd,thd->ht", qf, k)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new) if rescale else torch.ones_like(m)
            p = torch.exp(s - m_new[:, None])
            den = den * alpha + p.sum(-1)
            acc = acc * alpha[:, None] + torch.einsum("ht,thd->hd", p, v)
            m = m_new
        if end == 0 and empty == "zeros":
            return torch.zeros_like(q)
        return (acc / den[:, None]).to(q.dtype)
    return fn


def test_09_3_a_correct_answer_passes_and_the_library_is_refused(capsys):
    assert verdict(capsys, ch09.check_attend_tiles, tiles_with()).startswith("✅ [09.3]")

    def delegating(q, k_cache, v_cache, block_table, seq_len, tile):
        from paged_lib.attention import paged_blockwise_attention

        return paged_blockwise_attention(q, k_cache, v_cache, block_table, seq_len)

    out = verdict(capsys, ch09.check_attend_tiles, delegating)
    assert out.startswith("❌ [09.3]") and "library's" in out, out


@pytest.mark.parametrize("shown", ["torch_backend", "reference"])
def test_09_3_what_chapter_04_shows_reads_too_much_at_once(capsys, shown):
    """Chapter 04 shows the torch backend's decode and the float64 reference (so they are
    not refused as twins); both read whole segments or sequences, never a tile."""
    from paged_lib.kernels import reference, torch_backend

    def delegating(q, k_cache, v_cache, block_table, seq_len, tile):
        table = torch.as_tensor(block_table)[None].clamp(min=0)
        lens = torch.tensor([seq_len], dtype=torch.int32)
        if shown == "torch_backend":
            return torch_backend.paged_attention_torch(q[None], k_cache, v_cache, table, lens,
                                                       q.shape[-1] ** -0.5)[0]
        return reference.ref_paged_attention(q[None], k_cache, v_cache, table, lens)[0] \
            .to(q.dtype)

    out = verdict(capsys, ch09.check_attend_tiles, delegating)
    assert out.startswith("❌ [09.3]") and "not the whole sequence at once" in out, out


def test_09_3_the_c_kernel_is_refused(capsys):
    """The C decode kernel reads by pointer, unseen by the read tracking, and passed the
    float16 and float32 cases; it is refused, not told its float64 ValueError."""
    from paged_lib.kernels import cpu_decode

    def delegating(q, k_cache, v_cache, block_table, seq_len, tile):
        table = torch.as_tensor(block_table)[None].clamp(min=0)
        lens = torch.tensor([seq_len], dtype=torch.int32)
        return cpu_decode.paged_attention_cpu(q[None], k_cache, v_cache, table, lens,
                                              q.shape[-1] ** -0.5)[0]

    out = verdict(capsys, ch09.check_attend_tiles, delegating)
    assert out.startswith("❌ [09.3]") and "library's paged_attention_cpu" in out, out


@pytest.mark.parametrize("wrong, state, hint", [
    (tiles_with(rescale=False), "blocks of 4, tiles of 4", "exp(m_old - m_new)"),
    (tiles_with(block_of="tile"), "tiles of 2 (two tiles per block)", "whatever the tile"),
    (tiles_with(kv="mod"), "blocks of 4, tiles of 4", "h // (num_heads // num_kv_heads)"),
    (tiles_with(scale=False), "blocks of 4, tiles of 4", "sqrt(head_dim)"),
    (tiles_with(wide=torch.float32), "float64", "computed in float32"),
    (tiles_with(whole_tiles=True), "blocks of 4, tiles of 4 (a tile is a block), 13 tokens",
     "the last tile holds what is left"),
    (tiles_with(mask=False), "blocks of 4, tiles of 4", "NaN: a slot past the sequence's end"),
    (tiles_with(at_once=True), "blocks of 4, tiles of 4", "not the whole sequence at once"),
    (tiles_with(empty="nan"), "an empty sequence", "return zeros"),
])
def test_09_3_wrong_answers_get_a_named_hint(capsys, wrong, state, hint):
    out = verdict(capsys, ch09.check_attend_tiles, wrong)
    assert out.startswith("❌ [09.3]") and state in out and hint in out, out


def tiles_written(heads="repeat_interleave", rescale=("l", "acc"), running_max=True,
                  factor="old - new", result="q"):
    """An attend_tiles written as a learner may (the heads expanded with a tensor method,
    [h, 1] running state, matmuls), with one planted slip (defaults: correct)."""
    def fn(q, k_cache, v_cache, block_table, seq_len, tile):
        h, d = q.shape
        bs, nkv = k_cache.shape[1], k_cache.shape[2]
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        qf = q.to(dt) / math.sqrt(d)
        m = torch.full((h, 1), -math.inf, dtype=dt)
        l, acc = torch.zeros(h, 1, dtype=dt), torch.zeros(h, d, dtype=dt)  # noqa: E741
        for start in range(0, seq_len, tile):
            pos = torch.arange(start, min(start + tile, seq_len))
            blocks = block_table[pos // bs].long()
            k = k_cache[blocks, pos % bs].to(dt)  # [t, num_kv_heads, d]
            v = v_cache[blocks, pos % bs].to(dt)
            if heads == "repeat_interleave":
                k, v = k.repeat_interleave(h // nkv, dim=1), v.repeat_interleave(h // nkv, dim=1)
            else:  # kv0, kv1, kv0, kv1, ...: query head h reads KV head h % num_kv_heads
                k, v = k.repeat(1, h // nkv, 1), v.repeat(1, h // nkv, 1)
            s = torch.bmm(k.transpose(0, 1), qf[:, :, None])[:, :, 0]  # [h, t]
            m_new = torch.maximum(m, s.max(-1, keepdim=True).values) if running_max \
                else torch.zeros_like(m)
            a = torch.exp(m - m_new) if factor == "old - new" else torch.where(
                m.isinf(), torch.ones_like(m), torch.exp(m_new - m))
            if not running_max:
                a = torch.ones_like(m)
            p = torch.exp(s - m_new)
            l = (l * a if "l" in rescale else l) + p.sum(-1, keepdim=True)  # noqa: E741
            pv = torch.bmm(p[:, None, :], v.transpose(0, 1))[:, 0]
            acc = (acc * a if "acc" in rescale else acc) + pv
            m = m_new
        if seq_len == 0:
            return torch.zeros_like(q)
        out = acc / l
        return out if result == "working dtype" else out.to(q.dtype)
    return fn


def test_09_3_a_learner_style_answer_passes(capsys):
    assert verdict(capsys, ch09.check_attend_tiles, tiles_written()).startswith("✅ [09.3]")


@pytest.mark.parametrize("wrong, state, hint", [
    # a learner's two answers that got the catch-all hint ("... folded into the running
    # max, denominator and accumulator")
    (tiles_written(heads="repeat"), "blocks of 4, tiles of 4 (a tile is a block)",
     ["query head h reads KV head h // (num_heads // num_kv_heads)",
      "yours read KV head h % num_kv_heads, as .repeat(...) lays"]),
    (tiles_written(rescale=("l",)), "blocks of 4, tiles of 4", [
        "the accumulator is rescaled by exp(m_old - m_new) as the denominator is"]),
    (tiles_written(rescale=("acc",)), "blocks of 4, tiles of 4", [
        "the denominator l is rescaled by exp(m_old - m_new) as the accumulator is"]),
    (tiles_written(rescale=()), "blocks of 4, tiles of 4", ["yours rescales neither"]),
    (tiles_written(factor="new - old"), "blocks of 4, tiles of 4",
     ["exp(m_old - m_new), at most 1, not exp(m_new - m_old)"]),
    (tiles_written(running_max=False), "scores in the hundreds",
     ["exp of a raw score overflows (scores here reach", "subtract the running max m"]),
    (tiles_written(result="working dtype"), "float16", [
        "returned torch.float32 (4, 8), expected torch.float16 (4, 8)",
        "then cast the result with .to(q.dtype)"]),
])
def test_09_3_learner_style_slips_get_their_own_hint(capsys, wrong, state, hint):
    out = verdict(capsys, ch09.check_attend_tiles, wrong)
    assert out.startswith("❌ [09.3]") and state in out and all(h in out for h in hint), out
    assert "folded into the running max, denominator and accumulator" not in out, out


def test_the_helpers_that_do_09_1_and_09_2_are_refused(capsys):
    from paged_lib.fragmentation.request import request_slots

    def waste_by_helper(lengths, b):
        _bad_input(lengths, b)
        held = sum(sum(request_slots("paged", n, n, b)) for n in lengths)
        return (held - sum(lengths)) / held

    out = verdict(capsys, ch09.check_internal_waste, waste_by_helper)
    assert out.startswith("❌ [09.1]") and "request_slots" in out, out
    out = verdict(capsys, ch09.check_choose_block_size, choice_with(waste=internal_waste))
    assert out.startswith("❌ [09.2]") and "internal_waste" in out, out


# ------------------------------------------------ 09.3: state that grows where it must not


def _tile_scores(q, k_cache, v_cache, table, start, seq_len, tile):
    """One tile's scores [h, t] and values [t, h, d] (query heads grouped), in float32/64."""
    h, d = q.shape
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    heads = torch.arange(h) // (h // nkv)
    pos = torch.arange(start, min(start + tile, seq_len))
    blocks = torch.as_tensor(table).long()[pos // bs]
    k = k_cache[blocks, pos % bs].to(dt)[:, heads]
    v = v_cache[blocks, pos % bs].to(dt)[:, heads]
    return torch.einsum("hd,thd->ht", q.to(dt) * d ** -0.5, k), v


def tiles_scores_concatenated(q, k_cache, v_cache, block_table, seq_len, tile):
    """Gathers tile by tile, keeps every tile's scores and values, one softmax at the end."""
    if seq_len == 0:
        return torch.zeros_like(q)
    scores, values = [], []
    for start in range(0, seq_len, tile):
        s, v = _tile_scores(q, k_cache, v_cache, block_table, start, seq_len, tile)
        scores.append(s)
        values.append(v)
    p = torch.softmax(torch.cat(scores, -1), -1)
    return torch.einsum("ht,thd->hd", p, torch.cat(values)).to(q.dtype)


def tiles_states_merged_at_end(q, k_cache, v_cache, block_table, seq_len, tile):
    """Every tile's (m, l, acc) kept in a list and merged after the loop."""
    if seq_len == 0:
        return torch.zeros_like(q)
    states = []
    for start in range(0, seq_len, tile):
        s, v = _tile_scores(q, k_cache, v_cache, block_table, start, seq_len, tile)
        m = s.amax(-1)
        p = torch.exp(s - m[:, None])
        states.append((m, p.sum(-1), torch.einsum("ht,thd->hd", p, v)))
    m = torch.stack([st[0] for st in states]).amax(0)
    den = sum(torch.exp(mi - m) * li for mi, li, _ in states)
    acc = sum(torch.exp(mi - m)[:, None] * ai for mi, _, ai in states)
    return (acc / den[:, None]).to(q.dtype)


def tiles_two_passes(q, k_cache, v_cache, block_table, seq_len, tile):
    """Pass 1 over the tiles finds the max; pass 2 reads them again for the sum."""
    if seq_len == 0:
        return torch.zeros_like(q)
    m = None
    for start in range(0, seq_len, tile):
        s, _ = _tile_scores(q, k_cache, v_cache, block_table, start, seq_len, tile)
        m = s.amax(-1) if m is None else torch.maximum(m, s.amax(-1))
    den = acc = 0
    for start in range(0, seq_len, tile):
        s, v = _tile_scores(q, k_cache, v_cache, block_table, start, seq_len, tile)
        p = torch.exp(s - m[:, None])
        den = den + p.sum(-1)
        acc = acc + torch.einsum("ht,thd->hd", p, v)
    return (acc / den[:, None]).to(q.dtype)


def tiles_in_place(q, k_cache, v_cache, block_table, seq_len, tile):
    """Right: the running state updated in place, whole blocks read and sliced per tile."""
    h, d = q.shape
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    if seq_len == 0:
        return torch.zeros_like(q)
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    heads = torch.arange(h) // (h // nkv)
    qf = q.to(dt) * d ** -0.5
    m = torch.full((h,), -math.inf, dtype=dt)
    den, acc = torch.zeros(h, dtype=dt), torch.zeros(h, d, dtype=dt)
    for start in range(0, seq_len, tile):
        stop = min(start + tile, seq_len)
        ks, vs = [], []
        for j in range(start // bs, (stop - 1) // bs + 1):
            block = int(block_table[j])
            lo, hi = max(start, j * bs) - j * bs, min(stop, (j + 1) * bs) - j * bs
            ks.append(k_cache[block][lo:hi])
            vs.append(v_cache[block][lo:hi])
        k, v = torch.cat(ks).to(dt)[:, heads], torch.cat(vs).to(dt)[:, heads]
        s = torch.einsum("hd,thd->ht", qf, k)
        m_old = m.clone()
        torch.maximum(m, s.amax(-1), out=m)
        alpha = torch.exp(m_old - m)
        p = torch.exp(s - m[:, None])
        den.mul_(alpha).add_(p.sum(-1))
        acc.mul_(alpha[:, None]).add_(torch.einsum("ht,thd->hd", p, v))
    return (acc / den[:, None]).to(q.dtype)


def tiles_blocks_then_slice(q, k_cache, v_cache, block_table, seq_len, tile):
    """Right: each tile's whole blocks concatenated, then the tile sliced out of them."""
    h, d = q.shape
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    if seq_len == 0:
        return torch.zeros_like(q)
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    heads = torch.arange(h) // (h // nkv)
    m = torch.full((h,), -math.inf, dtype=dt)
    den, acc = torch.zeros(h, dtype=dt), torch.zeros(h, d, dtype=dt)
    for start in range(0, seq_len, tile):
        stop = min(start + tile, seq_len)
        blocks = [int(b) for b in block_table[start // bs:(stop - 1) // bs + 1]]
        first = start // bs * bs
        k = torch.cat([k_cache[b] for b in blocks])[start - first:stop - first]
        v = torch.cat([v_cache[b] for b in blocks])[start - first:stop - first]
        s = torch.einsum("hd,thd->ht", q.to(dt) * d ** -0.5, k.to(dt)[:, heads])
        m_new = torch.maximum(m, s.amax(-1))
        p = torch.exp(s - m_new[:, None])
        alpha = torch.exp(m - m_new)
        den = den * alpha + p.sum(-1)
        acc = acc * alpha[:, None] + torch.einsum("ht,thd->hd", p, v.to(dt)[:, heads])
        m = m_new
    return (acc / den[:, None]).to(q.dtype)


def tiles_concatenated_as_it_goes(q, k_cache, v_cache, block_table, seq_len, tile):
    """Each tile's scores and values appended to two growing tensors, one softmax at the end."""
    if seq_len == 0:
        return torch.zeros_like(q)
    scores = values = None
    for start in range(0, seq_len, tile):
        s, v = _tile_scores(q, k_cache, v_cache, block_table, start, seq_len, tile)
        scores = s if scores is None else torch.cat([scores, s], -1)
        values = v if values is None else torch.cat([values, v])
    p = torch.softmax(scores, -1)
    return torch.einsum("ht,thd->hd", p, values).to(q.dtype)


@pytest.mark.parametrize("right", [tiles_in_place, tiles_blocks_then_slice])
def test_09_3_an_in_place_state_and_block_slices_pass(capsys, right):
    assert verdict(capsys, ch09.check_attend_tiles, right).startswith("✅ [09.3]")


@pytest.mark.parametrize("wrong, problem, hint", [
    (tiles_scores_concatenated, "you keep earlier tiles' scores or values",
     "let its scores and values go"),
    (tiles_states_merged_at_end, "every tile's scores or state and combine them at the end",
     "hold one running (m, l, acc) and nothing else"),
    (tiles_two_passes, "a second pass over the sequence (the max first, then the sum)",
     "one pass over the tiles is enough"),
    (tiles_concatenated_as_it_goes, "read K (KV head 0) of 13 positions, 0-12",
     "fold each tile into the running (m, l, acc) when you reach it"),
])
def test_09_3_state_that_grows_where_it_must_not(capsys, wrong, problem, hint):
    out = verdict(capsys, ch09.check_attend_tiles, wrong)
    assert out.startswith("❌ [09.3]") and problem in out and hint in out, out


# ------------------------------- 09.1 and 09.2 by behaviour: rules a learner may derive


def waste_empty_is_b_minus_rest(lengths, b):
    _bad_input(lengths, b)
    held = sum(cdiv(n, b) * b for n in lengths)
    return sum(b - n % b for n in lengths) / held  # a full last block: b empty slots


def waste_of_last_blocks(lengths, b):
    _bad_input(lengths, b)
    return sum(cdiv(n, b) * b - n for n in lengths) / (len(lengths) * b)


def waste_of_the_mean(lengths, b):
    _bad_input(lengths, b)
    mean = sum(lengths) / len(lengths)
    return (math.ceil(mean / b) * b - mean) / (math.ceil(mean / b) * b)


@pytest.mark.parametrize("wrong, state, hint", [
    (waste_empty_is_b_minus_rest, "generated case", "a multiple of the block size has no "
     "empty slot"),
    (waste_of_last_blocks, "generated case", "the last blocks' slots only"),
    (waste_of_the_mean, "generated case", "computed on the mean length"),
])
def test_09_1_derived_rules_get_named(capsys, wrong, state, hint):
    out = verdict(capsys, ch09.check_internal_waste, wrong)
    assert out.startswith("❌ [09.1]") and state in out and hint in out, out


def choice_least_waste_always(lengths, allowed, budget):
    if not allowed or not 0 <= budget < 1:
        raise ValueError("bad input")
    return _least(lengths, allowed)


def choice_every_sequence_within(lengths, allowed, budget):
    if not allowed or not 0 <= budget < 1:
        raise ValueError("bad input")
    fits = [b for b in allowed if all(_own_waste([n], b) <= budget for n in lengths)]
    return max(fits) if fits else _least(lengths, allowed)


def choice_refuses_when_none_fits(lengths, allowed, budget):
    if not allowed or not 0 <= budget < 1:
        raise ValueError("bad input")
    fits = [b for b in allowed if _own_waste(lengths, b) <= budget]
    if not fits:
        raise ValueError("no block size keeps the budget")
    return max(fits)


def choice_none_when_none_fits(lengths, allowed, budget):
    if not allowed or not 0 <= budget < 1:
        raise ValueError("bad input")
    fits = [b for b in allowed if _own_waste(lengths, b) <= budget]
    return max(fits) if fits else None


@pytest.mark.parametrize("wrong, state, hint", [
    (choice_least_waste_always, "an unsorted list of sizes", "the largest one is asked"),
    (choice_every_sequence_within, "vLLM's CUDA kernel sizes",
     "on the memory all the sequences hold together"),
    (choice_refuses_when_none_fits, "FlashAttention's sizes, none fits",
     "no allowed size keeps the budget here"),
    (choice_none_when_none_fits, "FlashAttention's sizes, none fits",
     "no allowed size keeps the budget here"),
])
def test_09_2_derived_rules_get_named(capsys, wrong, state, hint):
    out = verdict(capsys, ch09.check_choose_block_size, wrong)
    assert out.startswith("❌ [09.2]") and state in out and hint in out, out


# ------------------------------------------- 09.3: overflow, underflow and a read past the end


def tiles_m_from(m0=-math.inf, freeze=False):
    """An attend_tiles whose running max starts at ``m0`` (0: a slip), or (``freeze``)
    stays the first tile's max: exp(s - m) overflows once later tiles score far higher."""
    def fn(q, k_cache, v_cache, block_table, seq_len, tile):
        h, d = q.shape
        bs, nkv = k_cache.shape[1], k_cache.shape[2]
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        heads = torch.arange(h) // (h // nkv)
        qf = q.to(dt) * d ** -0.5
        m = torch.full((h,), m0, dtype=dt)
        den, acc = torch.zeros(h, dtype=dt), torch.zeros(h, d, dtype=dt)
        for start in range(0, seq_len, tile):
            pos = torch.arange(start, min(start + tile, seq_len))
            blocks = block_table[pos // bs].long()
            k = k_cache[blocks, pos % bs].to(dt)[:, heads]
            v = v_cache[blocks, pos % bs].to(dt)[:, heads]
            s = torch.einsum("hd,thd->ht", qf, k)
            m_new = torch.maximum(m, s.amax(-1)) if not (freeze and start) else m
            alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
            den = den * alpha + p.sum(-1)
            acc = acc * alpha[:, None] + torch.einsum("ht,thd->hd", p, v)
            m = m_new
        if seq_len == 0:
            return torch.zeros_like(q)
        return (acc / den[:, None]).to(q.dtype)
    return fn


def test_09_3_an_underflow_is_told_as_an_underflow(capsys):
    """A running max that starts at 0: right while scores are positive, 0 / 0 once every
    score is hundreds below zero. Not 'a slot past the end', not 'overflows'."""
    out = verdict(capsys, ch09.check_attend_tiles, tiles_m_from(m0=0.0))
    assert out.startswith("❌ [09.3]") and "scores in the hundreds below zero" in out, out
    assert "exp underflowed to 0" in out and "starting from -inf (not 0)" in out, out
    assert "past the sequence's end" not in out and "overflows" not in out, out


def test_09_3_an_overflow_of_a_stale_max_is_told_as_an_overflow(capsys):
    """The first tile's max kept for every later tile: right while later scores are not
    far higher, inf / inf where they reach the hundreds: an overflow, whatever the NaN
    pattern, not a read past the end."""
    out = verdict(capsys, ch09.check_attend_tiles, tiles_m_from(freeze=True))
    assert out.startswith("❌ [09.3]") and "overflows" in out, out
    assert "past the sequence's end" not in out, out


def test_09_3_holding_the_last_tile_is_fine_when_the_tile_is_wider_than_the_head():
    """A tile of 20 on heads of 8: the previous tile's exp(s - m_new) is still alive when
    the next tile is read, and it depends on the running max of every tile so far; that
    is one tile's data, not scores concatenated (it was refused before)."""
    from paged_lib.course.grading.generated import numeric

    for c in (numeric.Tiles(21, 4, 20, 70, 4, 2, 8, "fp32", "random", 1.0),
              numeric.Tiles(22, 5, 12, 50, 4, 2, 4, "fp32", "random", 1.0)):
        ch09.check_case(tiles_with(), c)
        ch09.check_case(tiles_written(), c)


def tiles_query_head_loop(q, k_cache, v_cache, block_table, seq_len, tile):
    """One pass per query head: each KV head of a group is read once per query head."""
    h, d = q.shape
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(h, d)
    for head in range(h):
        kh = head // (h // nkv)
        m, den, acc = -math.inf, torch.zeros(()), torch.zeros(d)
        for start in range(0, seq_len, tile):
            pos = torch.arange(start, min(start + tile, seq_len))
            blocks = block_table[pos // bs].long()
            k = k_cache[blocks, pos % bs, kh].float()
            v = v_cache[blocks, pos % bs, kh].float()
            s = k @ q[head].float() * d ** -0.5
            m_new = max(m, float(s.max()))
            p = torch.exp(s - m_new)
            den = den * math.exp(m - m_new) + p.sum()
            acc = acc * math.exp(m - m_new) + p @ v
            m = m_new
        if seq_len:
            out[head] = acc / den
    return out.to(q.dtype)


def test_09_3_a_query_head_loop_is_told_to_loop_over_kv_heads(capsys):
    out = verdict(capsys, ch09.check_attend_tiles, tiles_query_head_loop)
    assert out.startswith("❌ [09.3]") and "a second pass" in out, out
    assert "a loop over KV heads, not over query heads" in out, out


# ------------------------------------------------- 09.3: a trip is one tile, no more, no less


def tiles_stepping(step, backwards=False):
    """The right online softmax whose trips hold ``step(tile, block_size)`` keys each
    (``backwards``: the tiles walked last to first)."""
    def fn(q, k_cache, v_cache, block_table, seq_len, tile):
        h, d = q.shape
        bs, nkv = k_cache.shape[1], k_cache.shape[2]
        if seq_len == 0:
            return torch.zeros_like(q)
        heads = torch.arange(h) // (h // nkv)
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        m = torch.full((h,), -math.inf, dtype=dt)
        den, acc = torch.zeros(h, dtype=dt), torch.zeros(h, d, dtype=dt)
        n = step(tile, bs)
        starts = list(range(0, seq_len, n))
        for start in reversed(starts) if backwards else starts:
            pos = torch.arange(start, min(start + n, seq_len))
            blocks = block_table.long()[pos // bs]
            k = k_cache[blocks, pos % bs].to(dt)[:, heads]
            v = v_cache[blocks, pos % bs].to(dt)[:, heads]
            s = torch.einsum("hd,thd->ht", q.to(dt) * d ** -0.5, k)
            m_new = torch.maximum(m, s.amax(-1))
            p, alpha = torch.exp(s - m_new[:, None]), torch.exp(m - m_new)
            den = den * alpha + p.sum(-1)
            acc = acc * alpha[:, None] + torch.einsum("ht,thd->hd", p, v)
            m = m_new
        return (acc / den[:, None]).to(q.dtype)
    return fn


@pytest.mark.parametrize("step, state, keys", [
    (lambda t, b: 2 * t, "tiles of 4", "read K (KV head 0) of 8 positions, 0-7"),
    (lambda t, b: t + 1, "tiles of 4", "5 positions, 0-4"),
    (lambda t, b: t - 1, "tiles of 4", "3 positions, 0-2"),
    (lambda t, b: max(t // 2, 1), "tiles of 4", "2 positions, 0-1"),
    (lambda t, b: 1, "tiles of 4", "1 positions, 0-0"),
    (lambda t, b: b, "tiles of 2 (two tiles per block)", "4 positions, 4-7, for one exp; tile 1 is "
     "positions 2-3"),  # a trip per block: the tile's own size ignored
])
def test_09_3_a_trip_of_more_or_fewer_keys_than_a_tile_is_named(capsys, step, state, keys):
    """Online softmax is exact for any split of the keys, so the values cannot tell a trip
    of the wrong size: the keys each exp folds in can."""
    out = verdict(capsys, ch09.check_attend_tiles, tiles_stepping(step))
    assert out.startswith("❌ [09.3]") and state in out and keys in out, out
    assert "one loop trip covers one tile of `tile`" in out, out


def test_09_3_tiles_walked_last_to_first_pass(capsys):
    out = verdict(capsys, ch09.check_attend_tiles, tiles_stepping(lambda t, b: t, True))
    assert out.startswith("✅ [09.3]"), out


# ------------------------- 09.1 and 09.2: rules that hold only for sizes that divide or are 2**k


def waste_bit_mask(lengths, b):
    """Rounds each length up to whole blocks with a mask: right only for powers of two."""
    _bad_input(lengths, b)
    held = sum((n + b - 1) & ~(b - 1) for n in lengths)
    return (held - sum(lengths)) / held


def test_09_1_a_power_of_two_mask_is_caught_by_generated_sizes(capsys):
    out = verdict(capsys, ch09.check_internal_waste, waste_bit_mask)
    assert out.startswith("❌ [09.1]") and "generated case" in out, out
    assert "it passes when the block size is a power of two" in out, out


def choice_stops_at_the_first_misfit(lengths, allowed, budget):
    if not allowed or not 0 <= budget < 1:
        raise ValueError("bad input")
    best = None
    for b in sorted(allowed):
        if _own_waste(lengths, b) > budget:
            break  # as if a larger size always wasted more
        best = b
    return best if best is not None else _least(lengths, allowed)


def _bit_mask_for_any(lengths, b):
    held = sum((n + b - 1) & ~(b - 1) for n in lengths)
    return (held - sum(lengths)) / held


@pytest.mark.parametrize("wrong, state, hint", [
    (choice_by(_bit_mask_for_any), "an unsorted list of sizes", "right only when B is a power"),
    (choice_stops_at_the_first_misfit, "size 20 wastes more than 24 and 48",
     "as if the waste grew with the size"),
    (choice_by(lambda n, b: (sum(cdiv(x, b) * b for x in n) - sum(n)) / sum(n)),
     "(a waste exactly at the budget)", "the waste divided by the tokens"),
])
def test_09_2_rules_for_sizes_that_divide_the_lengths_get_named(capsys, wrong, state, hint):
    out = verdict(capsys, ch09.check_choose_block_size, wrong)
    assert out.startswith("❌ [09.2]") and state in out and hint in out, out


def tiles_kv_heads_apart(tiles_inside=False, whole_v=False):
    """Right (unless ``whole_v``: V of the whole sequence read before the loop): a running
    state per KV head, its query heads as one group, the KV heads walked outside the tiles
    (``tiles_inside``: inside them), V read after the tile's exp."""
    def fn(q, k_cache, v_cache, block_table, seq_len, tile):
        h, d = q.shape
        bs, nkv = k_cache.shape[1], k_cache.shape[2]
        g, dt = h // nkv, torch.float64 if q.dtype == torch.float64 else torch.float32
        if seq_len == 0:
            return torch.zeros_like(q)
        every = torch.arange(seq_len)
        v_all = v_cache[block_table.long()[every // bs], every % bs] if whole_v else None
        st = {kh: (torch.full((g,), -math.inf, dtype=dt), torch.zeros(g, dtype=dt),
                   torch.zeros(g, d, dtype=dt)) for kh in range(nkv)}

        def trip(kh, start):
            m, den, acc = st[kh]
            pos = torch.arange(start, min(start + tile, seq_len))
            blocks = block_table.long()[pos // bs]
            s = (q[kh * g:(kh + 1) * g].to(dt) * d ** -0.5) @ k_cache[blocks, pos % bs, kh].to(dt).T
            m_new = torch.maximum(m, s.amax(-1))
            p, alpha = torch.exp(s - m_new[:, None]), torch.exp(m - m_new)
            v = v_all[start:start + tile, kh] if whole_v else v_cache[blocks, pos % bs, kh]
            st[kh] = m_new, den * alpha + p.sum(-1), acc * alpha[:, None] + p @ v.to(dt)

        pairs = [(kh, s) for kh in range(nkv) for s in range(0, seq_len, tile)]
        for kh, start in sorted(pairs, key=lambda x: x[::-1]) if tiles_inside else pairs:
            trip(kh, start)
        return torch.cat([st[kh][2] / st[kh][1][:, None] for kh in range(nkv)]).to(q.dtype)
    return fn


@pytest.mark.parametrize("tiles_inside", [False, True])
def test_09_3_kv_heads_walked_apart_pass(capsys, tiles_inside):
    out = verdict(capsys, ch09.check_attend_tiles, tiles_kv_heads_apart(tiles_inside))
    assert out.startswith("✅ [09.3]"), out


def test_09_3_values_read_whole_before_the_loop_are_named(capsys):
    out = verdict(capsys, ch09.check_attend_tiles, tiles_kv_heads_apart(whole_v=True))
    assert out.startswith("❌ [09.3]") and "read V (KV head 0) of 13 positions, 0-12" in out, out
    assert "not the whole sequence at once" in out, out



def tiles_by_shift(q, k_cache, v_cache, block_table, seq_len, tile):
    """pos >> log2(block_size) and pos & (block_size - 1): // and % for powers of two only."""
    h, d = q.shape
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    if seq_len == 0:
        return torch.zeros_like(q)
    heads, shift = torch.arange(h) // (h // nkv), int(math.log2(bs))
    m = torch.full((h,), -math.inf)
    den, acc = torch.zeros(h), torch.zeros(h, d)
    for start in range(0, seq_len, tile):
        pos = torch.arange(start, min(start + tile, seq_len))
        blocks, slots = block_table.long()[pos >> shift], pos & (bs - 1)
        k, v = k_cache[blocks, slots].float()[:, heads], v_cache[blocks, slots].float()[:, heads]
        s = torch.einsum("hd,thd->ht", q.float() * d ** -0.5, k)
        m_new = torch.maximum(m, s.amax(-1))
        p, alpha = torch.exp(s - m_new[:, None]), torch.exp(m - m_new)
        den, acc = den * alpha + p.sum(-1), acc * alpha[:, None] + torch.einsum("ht,thd->hd", p, v)
        m = m_new
    return (acc / den[:, None]).to(q.dtype)


def test_09_3_a_shift_for_the_block_is_caught_by_generated_block_sizes(capsys):
    """Chapter 09's fixed cases use blocks of 4 and 8; the generated ones 3, 5, 6, 7, 12."""
    out = verdict(capsys, ch09.check_attend_tiles, tiles_by_shift)
    assert out.startswith("❌ [09.3]") and "generated case" in out and "blocks of 3" in out, out
    assert "it passes when the block size is a power of two" in out, out
