"""Chapter 09's graders against typical wrong answers: each gets ❌ with a hint naming it."""

from __future__ import annotations

import pytest

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


def choice_with(pick="largest", strict=False, none="least", waste=None, check=True,
                cast=int):
    """A choose_block_size with one planted mistake (defaults: correct)."""
    def fn(lengths, allowed, budget):
        if check and (not allowed or not 0 <= budget < 1):
            raise ValueError("bad input")
        w = {b: (waste or internal_waste)(lengths, b) for b in allowed}
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
    ch09.run_demo(waste_with(), choice_with())
    out = capsys.readouterr().out
    assert "sharegpt: waste" in out and "alpaca: waste" in out and "FlashMLA" in out
