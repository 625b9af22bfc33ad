"""12.3's generated steps (paged_lib.course.grading.ch12.rank_cases).

The steps are seeded and reach shardings the fixed steps do not (3 ranks, groups of
3 to 7, hidden sizes other than 32, blocks of 1, 3 and 5, sequences past 10 tokens, louder
inputs); the library's piece and right answers of other shapes pass them; a wrong one is
shrunk to a one-token step and its hint names the feature that breaks it. Every wrong
piece tried here (KV heads of the replicas by rank % num_kv_heads or rank // num_kv_heads,
o's columns by hidden / tp, head_dim as hidden / num_heads) is caught by the fixed steps
too: the stage widens what is asked, it found no mistake they miss.
"""

import pytest

from paged_lib.course.grading import ch12
from paged_lib.course.grading.generated import numeric
from paged_lib.kernels import paged_prefill, reshape_and_cache
from paged_lib.model import apply_rope
from paged_lib.parallel import rank_attention
from paged_lib.util import CheckFailed

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rank_attention_bias_on_rank_0(x, w, cos, sin, kv_cache, meta, rank, tp_size,
                                  all_reduce, head_dim=None):
    """A right answer of another shape: heads found through their GQA group (the KV head
    of the rank's first query head), o's bias added on rank 0 before the sum (vLLM's
    RowParallelLinear), the heads' output reshaped by its own size."""
    d = head_dim or w.head_dim
    n, per_rank = x.shape[0], w.num_heads // tp_size
    first_q = rank * per_rank
    group = w.num_heads // w.num_kv_heads
    first_kv = first_q // group
    kv_count = max(1, w.num_kv_heads // tp_size)
    q = (x @ w.q[first_q * d:(first_q + per_rank) * d].T
         + (0 if w.q_bias is None else w.q_bias[first_q * d:(first_q + per_rank) * d]))
    rows = slice(first_kv * d, (first_kv + kv_count) * d)
    k = x @ w.k[rows].T + (0 if w.k_bias is None else w.k_bias[rows])
    v = x @ w.v[rows].T + (0 if w.v_bias is None else w.v_bias[rows])
    q = apply_rope(q.view(n, per_rank, d), cos, sin)
    k = apply_rope(k.view(n, kv_count, d), cos, sin)
    reshape_and_cache(k, v.view(n, kv_count, d), *kv_cache, meta.slot_mapping, backend="torch")
    out = paged_prefill(q.contiguous(), *kv_cache, meta.block_tables, meta.seq_lens,
                        meta.query_lens, backend="torch")
    partial = out.flatten(1) @ w.o[:, first_q * d:(first_q + per_rank) * d].T
    if rank == 0 and w.o_bias is not None:
        partial = partial + w.o_bias
    all_reduce(partial)
    return partial


def rank_attention_head_dim_from_hidden(x, w, cos, sin, kv_cache, meta, rank, tp_size,
                                        all_reduce):
    """Wrong where heads are not hidden / num_heads wide (Gemma)."""
    return rank_attention_bias_on_rank_0(x, w, cos, sin, kv_cache, meta, rank, tp_size,
                                         all_reduce, head_dim=x.shape[1] // w.num_heads)


def test_steps_are_seeded_and_reach_shardings_the_fixed_steps_do_not():
    cases = ch12.rank_cases()
    assert cases == ch12.rank_cases()
    seen = numeric.states(cases)
    assert seen["3 ranks"] and seen["GQA groups of 3"] and seen["GQA groups of 7"]
    assert seen["blocks of 1"] and seen["blocks of 3"] and seen["blocks of 5"]
    assert seen["a sequence over 10 tokens"] and seen["louder inputs"]
    assert seen["hidden 24"] and seen["head_dim 10"]
    fixed = ch12.steps()
    assert {s.tp for s in fixed} == {2, 4} and {s.x.shape[1] for s in fixed} == {32}


@pytest.mark.parametrize("fn", [rank_attention, rank_attention_bias_on_rank_0])
def test_the_library_and_a_right_answer_of_another_shape_pass(fn):
    for step in ch12.steps():
        ch12.compare(step, ch12.replayed(fn, step))
    ch12.check_generated(fn)


def test_a_wrong_piece_is_shrunk_and_its_hint_names_the_width_of_a_head():
    with pytest.raises(CheckFailed) as caught:
        ch12.check_generated(rank_attention_head_dim_from_hidden)
    message, hint = caught.value.message, caught.value.hint
    assert message.startswith("generated case ") and "sequences (cached, new) [(0, 1)]" in \
        message, message
    assert "!= heads x head_dim" in message
    assert "hidden == num_heads x head_dim" in hint and "w.head_dim" in hint
