"""Chapter 11's graders against typical wrong answers: each gets ❌ with a hint naming it."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from paged_lib import accounting as acc  # noqa: E402
from paged_lib.accounting import kv_bytes_per_token, mha_equivalent  # noqa: E402
from paged_lib.course.grading import ch11  # noqa: E402
from paged_lib.util import cdiv  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def verdict(capsys, check, answer) -> str:
    check(answer)
    out = capsys.readouterr().out
    assert out.count("\n") <= 2, out  # one verdict line, at most one hint line
    return out


def levels_with(base="mha", base_fp16=True, own=True, sinks_kept=True, cap=True,
                rounding="ceil", paged="kept", cast=int):
    """A kv_levels with one planted mistake (defaults: correct)."""
    def fn(spec, lengths, *, max_len, kv_dtype_bytes, block_size, window=None, sinks=0):
        b = (mha_equivalent(spec) if base == "mha" else spec).with_dtype(
            2 if base_fp16 else kv_dtype_bytes)
        per = (spec if own else mha_equivalent(spec)).with_dtype(kv_dtype_bytes)
        keep = max_len if window is None else window + (sinks if sinks_kept else 0)
        keep = min(keep, max_len) if cap else keep
        kept = {"kept": [min(n, keep) for n in lengths], "all": lengths,
                "sinks_on_top": [min(n, window or max_len) + (sinks if window else 0)
                                 for n in lengths],
                "max_len": [max_len] * len(lengths), "reserved": [keep] * len(lengths)}[paged]
        held = sum({"ceil": cdiv(n, block_size) * block_size,
                    "floor": n // block_size * block_size, "exact": n}[rounding] for n in kept)
        n = len(lengths)
        bb, bp = kv_bytes_per_token(b), kv_bytes_per_token(per)
        return (cast(n * max_len * bb), cast(n * max_len * bp), cast(n * keep * bp),
                cast(held * bp))
    return fn


def test_11_1_a_correct_answer_passes(capsys):
    assert verdict(capsys, ch11.check_kv_levels, levels_with()).startswith("✅ [11.1]")


def test_11_1_not_attempted(capsys):
    def todo(*args, **kwargs):
        raise NotImplementedError()
    assert verdict(capsys, ch11.check_kv_levels, todo).startswith("⏳ [11.1]")


@pytest.mark.parametrize("wrong, hint", [
    (levels_with(base="own"), "the baseline is plain MHA"),
    (levels_with(base_fp16=False), "the baseline is fp16"),
    (levels_with(own=False), "uses the model's own attention"),
    (levels_with(sinks_kept=False), "the sinks are kept too"),
    (levels_with(cap=False), "never needs more than max_len"),
    (levels_with(rounding="floor"), "partly filled last block"),
    (levels_with(rounding="exact"), "paging holds whole blocks"),
    (levels_with(paged="all"), "the levels stack"),
    (levels_with(paged="max_len"), "not a max_len reservation"),
    (levels_with(paged="reserved"), "not a reservation of window + sinks"),
    (levels_with(cast=float), "expected an int"),
    (levels_with(paged="sinks_on_top"), "not its last window plus sinks on top"),
    (lambda spec, lengths, **kw: levels_with()(spec, lengths, **kw)[:3], "a tuple of 4"),
    (lambda spec, lengths, **kw: sum(levels_with()(spec, lengths, **kw)), "a tuple of 4"),
])
def test_11_1_wrong_answers_get_a_named_hint(capsys, wrong, hint):
    out = verdict(capsys, ch11.check_kv_levels, wrong)
    assert out.startswith("❌ [11.1]") and hint in out, out


def test_11_1_a_learner_that_sorts_the_lengths_in_place_is_told(capsys):
    def sorts(spec, lengths, **kw):
        lengths.sort()
        return levels_with()(spec, lengths, **kw)
    out = verdict(capsys, ch11.check_kv_levels, sorts)
    assert out.startswith("❌ [11.1]") and "changed lengths" in out


def bytes_with(factor2_mla=False, rope_per_head=False, rope=True, mla=True, layers=True,
               q_heads=False, kv_pair=True, dtype=True, cast=int):
    """A kv_bytes_per_token with one planted mistake (defaults: correct)."""
    def fn(s):
        b = s.dtype_bytes if dtype else 1
        if s.kv_lora_rank and mla:
            r = s.qk_rope_head_dim * (s.num_heads if rope_per_head else 1) if rope else 0
            return cast((2 if factor2_mla else 1) * (s.num_layers if layers else 1)
                        * (s.kv_lora_rank + r) * b)
        heads = s.num_heads if q_heads else s.num_kv_heads
        return cast((2 if kv_pair else 1) * s.num_layers * heads * s.head_dim * b)
    return fn


def test_11_2_a_correct_answer_passes_and_the_library_is_refused(capsys):
    assert verdict(capsys, ch11.check_kv_bytes_per_token, bytes_with()).startswith("✅ [11.2]")
    out = verdict(capsys, ch11.check_kv_bytes_per_token, lambda s: acc.kv_bytes_per_token(s))
    assert out.startswith("❌ [11.2]") and "kv_bytes_per_token" in out


@pytest.mark.parametrize("wrong, hint", [
    (bytes_with(factor2_mla=True), "no factor 2"),
    (bytes_with(rope_per_head=True), "shared by every head"),
    (bytes_with(rope=False), "is cached beside the latent"),
    (bytes_with(mla=False), "not every head's K and V"),
    (bytes_with(layers=False), "multiply by num_layers"),
    (bytes_with(q_heads=True), "not query heads"),
    (bytes_with(kv_pair=False), "K and V: multiply by 2"),
    (bytes_with(dtype=False), "multiply by dtype_bytes"),
    (bytes_with(cast=float), "expected an int"),
])
def test_11_2_wrong_answers_get_a_named_hint(capsys, wrong, hint):
    out = verdict(capsys, ch11.check_kv_bytes_per_token, wrong)
    assert out.startswith("❌ [11.2]") and hint in out, out


def test_twins_and_demo(capsys):
    assert ch11.TWINS == {"11.2": "paged_lib.accounting.kv_bytes_per_token"}
    ch11.run_demo(levels_with(), bytes_with())
    out = capsys.readouterr().out
    assert "baseline" in out and "paged layout" in out and "deepseek-v2" in out
    assert len(plt.get_fignums()) == 2


def test_demo_on_unfinished_code_says_so(capsys):
    def todo(*args, **kwargs):
        raise NotImplementedError()
    ch11.run_demo(todo, todo)
    out = capsys.readouterr().out
    assert out.count("⏳") == 2 and "Traceback" not in out
