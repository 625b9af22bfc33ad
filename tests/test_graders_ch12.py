"""Chapter 12's graders against typical wrong answers (each gets ❌ with a hint naming it),
and its pictures."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest
import torch

from paged_lib.accounting import kv_bytes
from paged_lib.course.demos import your_counts
from paged_lib.course.exercises import EXERCISES
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


def two_bytes(spec, tp, n):  # every spec 2 bytes wide: right on fp16 models only
    _checked(spec, tp)
    return 2 * spec.num_layers * max(1, spec.num_kv_heads // tp) * spec.head_dim * 2 * n


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
    (two_bytes, "dtype_bytes"),
    (float_heads, "expected an int"),
    (bytes_with(lambda s, t: max(1, s.num_kv_heads // t), as_float=True), "expected an int"),
    (no_check, "raises ValueError"),
])
def test_12_1_wrong_answers_get_a_named_hint(capsys, answer, hint):
    out = verdict(capsys, ch12.check_kv_bytes_per_rank, answer)
    assert out.startswith("❌ [12.1]") and hint in out, out


def kv_only_check(spec, tp, n):  # checks only the KV heads: 16 ranks for 8 query heads pass
    kv = spec.num_kv_heads
    if tp < 1 or ((kv % tp) if tp <= kv else (tp % kv)):
        raise ValueError("tp_size")
    return 2 * spec.num_layers * max(1, kv // tp) * spec.head_dim * spec.dtype_bytes * n


def query_only_check(spec, tp, n):  # the old contract: the KV heads' evenness not checked
    if tp < 1 or spec.num_heads % tp:
        raise ValueError("tp_size")
    return no_check(spec, tp, n)


@pytest.mark.parametrize("answer,hint,state", [
    (bytes_with(lambda s, t: s.num_kv_heads // t), "0 bytes with more ranks than KV heads",
     "tp_size 16"),
    (bytes_with(lambda s, t: s.num_kv_heads if t > s.num_kv_heads else s.num_kv_heads // t),
     "not every KV head", "tp_size 16"),
    (kv_only_check, "raises ValueError", "16 query heads, 16 KV heads of 256"),
    (query_only_check, "neither divides the KV heads nor is a multiple", "6 KV heads"),
])
def test_12_1_rules_read_from_the_behaviour_get_a_named_hint(capsys, answer, hint, state):
    out = verdict(capsys, ch12.check_kv_bytes_per_rank, answer)
    assert out.startswith("❌ [12.1]") and hint in out and state in out, out


def no_replication(spec, tp, n):  # refuses more ranks than KV heads, which vLLM replicates
    if tp > spec.num_kv_heads:
        raise ValueError("fewer KV heads than ranks")
    return bytes_ok(spec, tp, n)


@pytest.mark.parametrize("answer,hint,state", [
    (no_replication, "only a tp_size below 1", "raised ValueError (fewer KV heads than ranks) "
     "on a tp_size vLLM accepts"),
    (lambda s, t, n: bytes_ok(s, t, n) // max(n, 1), "one token's bytes", "7 tokens"),
    # tp_size / KV heads is how many ranks share a head, not how many heads a rank keeps
    (bytes_with(lambda s, t: s.num_kv_heads // t if t <= s.num_kv_heads else t // s.num_kv_heads),
     "a rank keeps one KV head, not tp_size // num_kv_heads", "tp_size 16"),
])
def test_12_1_more_wrong_answers_get_a_named_hint(capsys, answer, hint, state):
    out = verdict(capsys, ch12.check_kv_bytes_per_rank, answer)
    assert out.startswith("❌ [12.1]") and hint in out and state in out, out


def test_12_2_an_accepted_tp_size_refused_is_named(capsys):
    def no_replication(h, kv, tp, r):
        if tp > kv:
            raise ValueError("fewer KV heads than ranks")
        return heads_with()(h, kv, tp, r)

    out = verdict(capsys, ch12.check_rank_heads, no_replication)
    assert out.startswith("❌ [12.2]") and "on a tp_size or rank vLLM accepts" in out, out
    assert "replicate each KV head" in out, out


def test_12_1_the_specs_example_is_the_librarys():
    from paged_lib.accounting import SPECS, kv_bytes_per_token
    from paged_lib.parallel import kv_bytes_per_rank

    assert kv_bytes_per_rank(SPECS["llama-2-70b"], 8, 1) == 40_960
    assert kv_bytes_per_token(SPECS["llama-2-70b"]) == 8 * 40_960 == 327_680


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


def unsorted_kv(h, kv, tp, r):  # the KV heads as a set: sorted only while they are small
    return heads_with(kv_of=lambda h, kv, tp, r, q: list({x // (h // kv) for x in q}))(
        h, kv, tp, r)


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
    (unsorted_kv, "a set is not sorted"),
    (heads_with(check=False), "raises ValueError"),
])
def test_12_2_wrong_answers_get_a_named_hint(capsys, answer, hint):
    out = verdict(capsys, ch12.check_rank_heads, answer)
    assert out.startswith("❌ [12.2]") and hint in out, out


def _query_heads_only_checked(h, kv, tp, r):
    if tp < 1 or h % tp or not 0 <= r < tp:
        raise ValueError("tp_size or rank")
    return heads_with(check=False)(h, kv, tp, r)


@pytest.mark.parametrize("answer,hint,state", [
    (heads_with(kv_of=lambda h, kv, tp, r, q: sorted({x % kv for x in q})),
     "a group is consecutive query heads", "rank_heads(4, 2, tp_size=2, rank=0)"),
    (heads_with(kv_of=lambda h, kv, tp, r, q: list(range(r * max(1, kv // tp),
                                                         (r + 1) * max(1, kv // tp)))),
     "not KV head number r", "rank_heads(2, 1, tp_size=2, rank=1)"),
    (heads_with(kv_of=lambda h, kv, tp, r, q: list(range(q[0] // (h // kv),
                                                         q[-1] // (h // kv)))),
     "of the rank's last query head is kept too", "rank_heads(1, 1, tp_size=1, rank=0)"),
    (_query_heads_only_checked, "neither divides the KV heads nor is a multiple",
     "rank_heads(6, 3, tp_size=2, rank=0)"),
])
def test_12_2_rules_read_from_the_behaviour_get_a_named_hint(capsys, answer, hint, state):
    out = verdict(capsys, ch12.check_rank_heads, answer)
    assert out.startswith("❌ [12.2]") and hint in out and state in out, out


def test_12_2_the_specs_examples_are_the_librarys():
    from paged_lib.parallel import rank_heads

    assert rank_heads(64, 8, 4, 1) == (list(range(16, 32)), [2, 3])
    assert rank_heads(32, 4, 8, 3) == ([12, 13, 14, 15], [1])
    assert rank_heads(32, 4, 8, 2)[1] == [1]


def test_12_2_right_answer_passes_and_delegating_fails(capsys):
    assert verdict(capsys, ch12.check_rank_heads, heads_with()).startswith("✅ [12.2]")
    from paged_lib.parallel import rank_heads

    assert verdict(capsys, ch12.check_rank_heads, rank_heads).startswith("❌ [12.2]")


def test_twins_are_the_library_functions_and_the_helpers_that_do_the_exercise():
    assert EXERCISES["12.1"].twins[0] == "paged_lib.parallel.kv_bytes_per_rank"
    assert EXERCISES["12.2"].twins[0] == "paged_lib.parallel.rank_heads"
    assert EXERCISES["12.3"].twins[0] == "paged_lib.parallel.rank_attention"
    assert all("paged_lib.parallel.kv_heads_per_rank" in EXERCISES[k].twins
               for k in ("12.1", "12.2", "12.3"))


def test_demo_runs_the_learners_functions(capsys):
    fig = your_counts.chapter_12(bytes_ok, heads_with())
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


# ---------------------------------------------------------------- 12.3 rank_attention
# Module-level functions: the check sends a passing answer to two spawned gloo ranks,
# which import this module to find it.


def _heads(w, rank, tp, kv_of=None, q_of=None):
    per, group = w.num_heads // tp, w.num_heads // w.num_kv_heads
    q = q_of(w, rank, tp) if q_of else list(range(rank * per, (rank + 1) * per))
    kv = kv_of(w, rank, tp, q) if kv_of else sorted({j // group for j in q})
    return q, kv


def attention_with(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce, *, kv_of=None,
                   q_of=None, reduce=True, bias="after", average=False, slice_bias=True,
                   write=True, dtype=None, rope_k=True, history=True):
    """A rank_attention with one planted mistake (defaults: correct)."""
    from paged_lib.kernels import paged_prefill, reshape_and_cache
    from paged_lib.model import apply_rope

    d, n = w.head_dim, x.shape[0]
    q_heads, kv_heads = _heads(w, rank, tp, kv_of, q_of)
    qs, ks = [slice(h[0] * d, (h[-1] + 1) * d) for h in (q_heads, kv_heads)]
    xin = x if dtype is None else x.to(dtype)

    def project(weight, b, rows):
        y = xin @ weight[rows].T.to(xin.dtype)
        if b is not None:
            y = y + (b[rows] if slice_bias else b).to(xin.dtype)
        return y.float().view(n, -1, d)

    q = apply_rope(project(w.q, w.q_bias, qs), cos, sin)
    k = project(w.k, w.k_bias, ks)
    k = apply_rope(k, cos, sin) if rope_k else k
    v = project(w.v, w.v_bias, ks)
    k_cache, v_cache = kv_cache
    if write:
        reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, backend="torch")
    if history:
        out = paged_prefill(q.contiguous(), k_cache, v_cache, meta.block_tables,
                            meta.seq_lens, meta.query_lens, backend="torch")
    else:  # attends only to the step's new tokens, causally, sequence by sequence
        parts, start = [], 0
        for ql in meta.query_lens.tolist():
            qq, kk, vv = (t[start:start + ql].transpose(0, 1) for t in (q, k, v))
            kk = kk.repeat_interleave(qq.shape[0] // kk.shape[0], 0)
            vv = vv.repeat_interleave(qq.shape[0] // vv.shape[0], 0)
            parts.append(torch.nn.functional.scaled_dot_product_attention(
                qq, kk, vv, is_causal=True).transpose(0, 1))
            start += ql
        out = torch.cat(parts)
    partial = out.reshape(n, -1) @ w.o[:, qs].T
    if bias == "before" and w.o_bias is not None:
        partial = partial + w.o_bias
    if reduce is True or (reduce == "rank 0" and rank == 0):
        all_reduce(partial)
    if average:
        partial = partial / tp
    return partial + w.o_bias if bias == "after" and w.o_bias is not None else partial


def rank_attention_ok(*args):
    return attention_with(*args)


def ra_no_reduce(*args):
    return attention_with(*args, reduce=False)


def ra_reduce_on_rank0(*args):
    return attention_with(*args, reduce="rank 0")


def ra_bias_every_rank(*args):
    return attention_with(*args, bias="before")


def ra_averaged(*args):
    return attention_with(*args, average=True)


def ra_kv_rank_mod(*args):  # KV head rank % num_kv_heads: right whenever tp <= num_kv_heads
    return attention_with(*args, kv_of=lambda w, r, tp, q: [r % w.num_kv_heads]
                          if tp > w.num_kv_heads else sorted({j // (w.num_heads // w.num_kv_heads)
                                                              for j in q}))


def ra_kv_floor(*args):  # num_kv_heads // tp KV heads: none when there are fewer than ranks
    return attention_with(*args, kv_of=lambda w, r, tp, q: list(range(
        r * (w.num_kv_heads // tp), (r + 1) * (w.num_kv_heads // tp))))


def ra_strided(*args):  # every tp-th query head
    return attention_with(*args, q_of=lambda w, r, tp: list(range(r, w.num_heads, tp)))


def ra_whole_bias(*args):  # q, k, v's whole biases added to the rank's slice
    return attention_with(*args, slice_bias=False)


def ra_no_write(*args):
    return attention_with(*args, write=False)


def ra_half(*args):  # computed in fp16, cast back to fp32 afterwards
    return attention_with(*args, dtype=torch.float16)


def ra_no_rope_k(*args):
    return attention_with(*args, rope_k=False)


def ra_new_tokens_only(*args):
    return attention_with(*args, history=False)


def ra_library(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce):
    from paged_lib.parallel import rank_attention

    return rank_attention(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce)


def ra_library_heads(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce):
    from paged_lib.parallel import rank_heads

    return attention_with(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce,
                          q_of=lambda w, r, t: rank_heads(w.num_heads, w.num_kv_heads, t, r)[0])


@pytest.mark.parametrize("answer,state,hint", [
    (ra_no_reduce, "2 ranks", "called all_reduce [0, 0] times"),
    (ra_reduce_on_rank0, "2 ranks", "waits forever"),
    (ra_bias_every_rank, "biases on q, k, v and o", "add it once, after all_reduce"),
    (ra_averaged, "rank 0 of 2", "averaged"),
    (ra_kv_rank_mod, "4 ranks, 8 query heads on 2 KV head(s), each on 2 ranks",
     "KV head r // (tp / num_kv_heads)"),
    (ra_kv_floor, "each on 2 ranks", "replicated"),
    (ra_strided, "4 query heads on 2 KV heads", "contiguous query heads"),
    (ra_whole_bias, "biases on q, k, v and o", "sliced with their rows"),
    (ra_no_write, "rank 0 of 2", "NaN"),
    (ra_half, "generated case", "rank 0 of 2"),
    (ra_no_rope_k, "[(0, 2)]", "keys go into the cache rotated"),
    (ra_new_tokens_only, "[(1, 1)]", "a query of one token over every cached one"),
])
def test_12_3_wrong_answers_get_a_named_hint(capsys, answer, state, hint):
    out = verdict(capsys, ch12.check_rank_attention, answer)
    assert out.startswith("❌ [12.3]") and state in out and hint in out, out


def test_12_3_right_answer_passes_on_gloo_ranks_and_delegating_fails(capsys):
    assert verdict(capsys, ch12.check_rank_attention,
                   rank_attention_ok).startswith("✅ [12.3]")
    for answer in (ra_library, ra_library_heads):
        out = verdict(capsys, ch12.check_rank_attention, answer)
        assert out.startswith("❌ [12.3]") and "library's" in out, out


def test_the_helpers_that_do_12_1_and_12_2_are_refused(capsys):
    from paged_lib.parallel import kv_head_replicas, kv_heads_per_rank

    def bytes_by_helper(spec, tp, n):
        _checked(spec, tp)
        return 2 * spec.num_layers * kv_heads_per_rank(spec.num_kv_heads, tp) \
            * spec.head_dim * spec.dtype_bytes * n

    out = verdict(capsys, ch12.check_kv_bytes_per_rank, bytes_by_helper)
    assert out.startswith("❌ [12.1]") and "kv_heads_per_rank" in out, out

    def heads_by_helper(h, kv, tp, r):
        q, _ = heads_with()(h, kv, tp, r)
        first = r // kv_head_replicas(kv, tp) * max(1, kv // tp)
        return q, list(range(first, first + max(1, kv // tp)))

    out = verdict(capsys, ch12.check_rank_heads, heads_by_helper)
    assert out.startswith("❌ [12.2]") and "kv_head_replicas" in out, out


# ------------------------------------------------ 12.3: three mistakes, three causes


def ra_cached_unrotated(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce):
    """Writes k into the cache before RoPE, then attends over the cache."""
    from paged_lib.kernels import paged_prefill, reshape_and_cache
    from paged_lib.model import apply_rope

    d, n = w.head_dim, x.shape[0]
    q_heads, kv_heads = _heads(w, rank, tp)
    qs, ks = [slice(h[0] * d, (h[-1] + 1) * d) for h in (q_heads, kv_heads)]
    lin = lambda wt, b, rows: (x @ wt[rows].T + (0 if b is None else b[rows])).view(n, -1, d)  # noqa: E731
    k = lin(w.k, w.k_bias, ks)
    reshape_and_cache(k, lin(w.v, w.v_bias, ks), *kv_cache, meta.slot_mapping, backend="torch")
    q = apply_rope(lin(w.q, w.q_bias, qs), cos, sin)
    out = paged_prefill(q.contiguous(), *kv_cache, meta.block_tables, meta.seq_lens,
                        meta.query_lens, backend="torch")
    partial = out.reshape(n, -1) @ w.o[:, qs].T
    all_reduce(partial)
    return partial if w.o_bias is None else partial + w.o_bias


def _heads_then(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce, *, how):
    """The heads' output right; then ``how`` "reduce first" (all_reduce before o_proj) or
    "rows" (o's rows of the rank's heads for its columns)."""
    from paged_lib.kernels import paged_prefill, reshape_and_cache
    from paged_lib.model import apply_rope

    d, n = w.head_dim, x.shape[0]
    q_heads, kv_heads = _heads(w, rank, tp)
    qs, ks = [slice(h[0] * d, (h[-1] + 1) * d) for h in (q_heads, kv_heads)]
    lin = lambda wt, b, rows: (x @ wt[rows].T + (0 if b is None else b[rows])).view(n, -1, d)  # noqa: E731
    k = apply_rope(lin(w.k, w.k_bias, ks), cos, sin)
    reshape_and_cache(k, lin(w.v, w.v_bias, ks), *kv_cache, meta.slot_mapping, backend="torch")
    q = apply_rope(lin(w.q, w.q_bias, qs), cos, sin)
    out = paged_prefill(q.contiguous(), *kv_cache, meta.block_tables, meta.seq_lens,
                        meta.query_lens, backend="torch").reshape(n, -1)
    if how == "reduce first":
        all_reduce(out)
        partial = out @ w.o[:, qs].T
    else:
        partial = out @ w.o[qs, :]
        all_reduce(partial)
    return partial if w.o_bias is None else partial + w.o_bias


@pytest.mark.parametrize("answer,hint", [
    (ra_cached_unrotated, "keys go into the cache rotated"),
    (lambda *a: _heads_then(*a, how="reduce first"), "all_reduce comes after o_proj"),
    (lambda *a: _heads_then(*a, how="rows"), "o_proj is row-parallel"),
])
def test_12_3_each_mistake_hears_its_own_cause(capsys, answer, hint):
    out = verdict(capsys, ch12.check_rank_attention, answer)
    assert out.startswith("❌ [12.3]") and hint in out, out
    assert "contiguous query heads" not in out, out


def test_12_3_a_rank_process_importing_a_script_runs_no_check(capsys, monkeypatch):
    """A script without a __main__ guard is imported again by each spawned rank: there the
    check prints nothing (it used to print '❌ your code raised RuntimeError: ...
    bootstrapping phase', blaming the learner for multiprocessing's rule)."""
    from paged_lib.course.grading import ch12

    assert not ch12._in_a_rank_bootstrapping()
    monkeypatch.setattr(ch12, "_in_a_rank_bootstrapping", lambda: True)
    ch12.check_rank_attention(rank_attention_ok)
    assert capsys.readouterr().out == ""


def test_12_3_ranks_that_cannot_start_are_not_blamed_on_the_learner(capsys, monkeypatch):
    import multiprocessing.context as ctx

    def refuse(self):
        raise RuntimeError("An attempt has been made to start a new process before the "
                           "current process has finished its bootstrapping phase.")

    monkeypatch.setattr(ctx.SpawnProcess, "start", refuse)
    out = verdict(capsys, ch12.check_rank_attention, rank_attention_ok)
    assert "this is not your function" in out and "your code raised" not in out, out
