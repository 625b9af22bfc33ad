"""Chapter 12's graders against typical wrong answers (each gets ❌ with a hint naming it),
and its pictures."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from paged_lib.accounting import kv_bytes
from paged_lib.course.grading import ch12
from paged_lib.course.viz import parallel as viz
from paged_lib.parallel import tp_size_problem


def verdict(capsys, check, answer) -> str:
    check(answer)
    out = capsys.readouterr().out
    assert out.count("\n") <= 2, out  # one verdict line, at most one hint line
    return out


# ---------------------------------------------------------------- 12.1 kv_bytes_per_rank


def _checked(spec, tp):
    if problem := tp_size_problem(spec.num_heads, spec.num_kv_heads, tp):
        raise ValueError(problem)


def bytes_with(heads, per_k_or_v=2, layers=None, times=lambda tp: 1, as_float=False):
    def fn(spec, tp, n):
        _checked(spec, tp)
        value = per_k_or_v * (spec.num_layers if layers is None else layers) \
            * heads(spec, tp) * spec.head_dim * spec.dtype_bytes * n * times(tp)
        return float(value) if as_float else value
    return fn


def bytes_ok(spec, tp, n):
    return bytes_with(lambda s, t: max(1, s.num_kv_heads // t))(spec, tp, n)


def total_over_tp(spec, tp, n):
    _checked(spec, tp)
    return kv_bytes(spec, n) // tp


def float_heads(spec, tp, n):
    _checked(spec, tp)
    return 2 * spec.num_layers * (spec.num_kv_heads / tp) * spec.head_dim \
        * spec.dtype_bytes * n


def no_check(spec, tp, n):
    return 2 * spec.num_layers * max(1, spec.num_kv_heads // max(tp, 1)) * spec.head_dim \
        * spec.dtype_bytes * n


@pytest.mark.parametrize("answer,hint", [
    (total_over_tp, "each rank keeps one whole KV head (it is replicated)"),
    (bytes_with(lambda s, t: max(1, s.num_kv_heads // t), per_k_or_v=1), "only K or only V"),
    (bytes_with(lambda s, t: s.num_heads // t), "split by query heads"),
    (bytes_with(lambda s, t: s.num_kv_heads), "not split at all"),
    (bytes_with(lambda s, t: max(1, s.num_kv_heads // t), times=lambda t: t),
     "the sum over all ranks"),
    (bytes_with(lambda s, t: max(1, s.num_kv_heads // t), layers=1), "one layer only"),
    (float_heads, "expected an int"),
    (bytes_with(lambda s, t: max(1, s.num_kv_heads // t), as_float=True), "expected an int"),
    (no_check, "raises ValueError"),
])
def test_12_1_wrong_answers_get_a_named_hint(capsys, answer, hint):
    out = verdict(capsys, ch12.check_kv_bytes_per_rank, answer)
    assert out.startswith("❌ [12.1]") and hint in out, out


def test_12_1_right_answer_passes_and_delegating_fails(capsys):
    assert verdict(capsys, ch12.check_kv_bytes_per_rank, bytes_ok).startswith("✅ [12.1]")
    from paged_lib.parallel import kv_bytes_per_rank

    out = verdict(capsys, ch12.check_kv_bytes_per_rank, kv_bytes_per_rank)
    assert out.startswith("❌ [12.1]")


def test_12_1_not_attempted(capsys):
    def todo(spec, tp, n):
        raise NotImplementedError()

    assert verdict(capsys, ch12.check_kv_bytes_per_rank, todo).startswith("⏳ [12.1]")


# ---------------------------------------------------------------- 12.2 rank_heads


def heads_with(q_of=None, kv_of=None, check=True, kind=list):
    def fn(h, kv, tp, r):
        if check:
            if problem := tp_size_problem(h, kv, tp):
                raise ValueError(problem)
            if not 0 <= r < tp:
                raise ValueError("rank")
        per, group = h // tp, h // kv
        q = q_of(h, tp, r) if q_of else list(range(r * per, (r + 1) * per))
        k = kv_of(h, kv, tp, r, q) if kv_of else sorted({x // group for x in q})
        return kind(q), kind(k)
    return fn


@pytest.mark.parametrize("answer,hint", [
    (heads_with(q_of=lambda h, tp, r: list(range(r, h, tp))), "contiguous run"),
    (heads_with(kv_of=lambda h, kv, tp, r, q: [r % kv] if tp > kv else
                sorted({x // (h // kv) for x in q})), "neighbouring ranks"),
    (heads_with(kv_of=lambda h, kv, tp, r, q: list(range(r * kv // tp, (r + 1) * kv // tp))),
     "never none"),
    (heads_with(kv_of=lambda h, kv, tp, r, q: sorted({x // kv for x in q})),
     "the size of a group"),
    (heads_with(kv_of=lambda h, kv, tp, r, q: [q[0] // (h // kv)]), "not just the first"),
    (heads_with(kv_of=lambda h, kv, tp, r, q: q), "KV head ids are not query head ids"),
    (heads_with(kind=lambda x: range(x[0], x[-1] + 1)), "a pair of lists"),
    (heads_with(check=False), "raises ValueError"),
])
def test_12_2_wrong_answers_get_a_named_hint(capsys, answer, hint):
    out = verdict(capsys, ch12.check_rank_heads, answer)
    assert out.startswith("❌ [12.2]") and hint in out, out


def test_12_2_right_answer_passes_and_delegating_fails(capsys):
    assert verdict(capsys, ch12.check_rank_heads, heads_with()).startswith("✅ [12.2]")
    from paged_lib.parallel import rank_heads

    assert verdict(capsys, ch12.check_rank_heads, rank_heads).startswith("❌ [12.2]")


def test_twins_are_the_library_functions():
    assert ch12.TWINS == {"12.1": "paged_lib.parallel.kv_bytes_per_rank",
                          "12.2": "paged_lib.parallel.rank_heads"}


def test_demo_runs_the_learners_functions(capsys):
    fig = ch12.run_demo(bytes_ok, heads_with())
    out = capsys.readouterr().out
    assert "8 rank(s)" in out and "KV heads [1]" in out
    plt.close(fig)


# ---------------------------------------------------------------- pictures


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_heads_picture_fills_each_owned_head_once_per_owner():
    fig = viz.heads_by_rank(8, 2, 4)
    texts = _texts(fig)
    # 8 query heads once each, 2 KV heads on 2 ranks each, 4 rank labels per panel
    assert sorted(t for t in texts if t.isdigit()) == sorted(
        [str(h) for h in range(8)] + ["0", "0", "1", "1"])
    assert "2 KV heads, each on 2 ranks" in [ax.get_title(loc="left") for ax in fig.axes]
    plt.close(fig)


def test_blocks_picture_and_bars():
    fig = viz.blocks_by_rank([7, 2, 9], 8, 2, 2)
    texts = _texts(fig)
    assert texts.count("block 7") == 2 and "rank 1\nKV heads [1]" in texts
    plt.close(fig)
    fig = viz.kv_bytes_bars({"1 rank": [4 << 20], "2 ranks": [2 << 20, 2 << 20]})
    heights = [p.get_height() for p in fig.axes[0].patches if p.get_height() > 0]
    assert heights[:3] == [4.0, 2.0, 2.0]
    plt.close(fig)
    with pytest.raises(ValueError):
        viz.blocks_by_rank([], 8, 2, 2)
    with pytest.raises(ValueError):
        viz.kv_bytes_bars({})
