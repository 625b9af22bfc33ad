"""The generated stages of 08.1 (apply_slot), 09.1 (internal_waste), 12.2 (rank_heads) and
12.3 (rank_attention): for each, a plausible wrong answer passes every fixed case (✅ with
the generated stage patched out) and gets ❌ from the generated stage, shrunk, with a hint
that names the mistake; a right answer of another shape than the solution's passes.

12.3's wrong answer is checked on its named steps rather than the whole check: the gloo
stage runs two ranks of the course's model (2 KV heads on 2 ranks), where no KV head is
replicated and the mistake cannot show.
"""

import pytest
import torch
from stage_verdicts import caught_only_by_the_stage, verdict

from paged_lib.course.grading import ch08, ch09, ch12
from paged_lib.course.grading.generated import numeric
from paged_lib.kernels import paged_prefill, reshape_and_cache
from paged_lib.model import apply_rope
from paged_lib.util import CheckFailed

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------- 08.1 apply_slot


def apply_into_empty_slots(k_cache, v_cache, slot, key, value):
    """Never overwrites a slot that holds something ("another sample's token"): right on
    a cache of NaN, wrong on blocks that an earlier request left its K/V in."""
    if slot.copy is not None:
        src, dst = slot.copy
        k_cache[dst], v_cache[dst] = k_cache[src], v_cache[src]
    if torch.isnan(k_cache[slot.block, slot.offset]).all():
        k_cache[slot.block, slot.offset] = key
        v_cache[slot.block, slot.offset] = value


def copy_into_empty_slots(k_cache, v_cache, slot, key, value):
    """Copies src only into the slots of dst that are still empty (NaN)."""
    if slot.copy is not None:
        src, dst = slot.copy
        for cache in (k_cache, v_cache):
            empty = torch.isnan(cache[dst])
            cache[dst] = torch.where(empty, cache[src], cache[dst])
    k_cache[slot.block, slot.offset] = key
    v_cache[slot.block, slot.offset] = value


def apply_prefix_with_copy_(k_cache, v_cache, slot, key, value):
    """Right, another shape: copies only the slots the sample reads, with copy_."""
    if slot.copy is not None:
        src, dst = slot.copy
        for cache in (k_cache, v_cache):
            cache[dst, :slot.offset].copy_(cache[src, :slot.offset])
    k_cache[slot.block, slot.offset].copy_(key)
    v_cache[slot.block, slot.offset].copy_(value)


@pytest.mark.parametrize("wrong", [apply_into_empty_slots, copy_into_empty_slots])
def test_08_1_a_slot_tested_for_emptiness_is_caught_by_a_stale_cache(monkeypatch, wrong):
    hint = caught_only_by_the_stage(ch08.check_apply_slot, wrong, monkeypatch,
                                    "earlier requests' K/V", "reads its token")
    assert "never test a slot for NaN" in hint, hint


def test_08_1_cases_are_seeded_and_reach_states_the_fixed_cases_do_not():
    cases = ch08.cow_cases()
    assert cases == ch08.cow_cases() and len(cases) == 24
    seen = numeric.states(cases)
    assert seen["a cache of earlier requests' K/V"] and seen["a sequence freed mid-run"]
    assert seen["block size 3"] and seen["block size 7"] and seen["1 KV head(s)"]
    assert seen["K and V as views of one [2, num_blocks, ...] tensor (vLLM's)"]


def test_08_1_a_right_answer_of_another_shape_passes():
    assert verdict(ch08.check_apply_slot, apply_prefix_with_copy_)[0] == "✅"


# ---------------------------------------------------------------- 09.1 internal_waste


def waste_zero_checked(lengths, block_size):
    """Raises for a length or block size of 0 (the fixed bad inputs), not for -3."""
    if not lengths or 0 in lengths or block_size == 0:
        raise ValueError("bad input")
    held = sum((n + block_size - 1) // block_size * block_size for n in lengths)
    return (held - sum(lengths)) / held


def waste_other_shape(lengths, block_size):
    if block_size <= 0 or len(lengths) == 0 or any(n <= 0 for n in lengths):
        raise ValueError("bad input")
    held = sum(-(-n // block_size) for n in lengths) * block_size
    return 1 - sum(lengths) / held


def test_09_1_a_check_for_zero_alone_is_caught_by_negative_input(monkeypatch):
    hint = caught_only_by_the_stage(ch09.check_internal_waste, waste_zero_checked,
                                    monkeypatch, "expected a ValueError")
    assert "not for a negative one" in hint and "n < 1" in hint, hint


def test_09_1_cases_reach_states_the_fixed_cases_do_not():
    seen = numeric.states(ch09.waste_cases())
    assert seen["a negative length"] and seen["a negative block size"]
    assert seen["a pool past 2**32 slots"] and seen["a length listed twice"]


def test_09_1_a_right_answer_of_another_shape_passes():
    assert verdict(ch09.check_internal_waste, waste_other_shape)[0] == "✅"


# ---------------------------------------------------------------- 12.2 rank_heads


def _checked(h, kv, tp, r):
    if tp < 1 or h % tp or (kv % tp and tp % kv) or not 0 <= r < tp:
        raise ValueError("cannot shard")
    return list(range(r * (h // tp), (r + 1) * (h // tp)))


def heads_shifted(h, kv, tp, r):
    """The replicas' KV head by a shift: r >> log2(tp / kv), right for 2 and 4 ranks each."""
    q = _checked(h, kv, tp, r)
    if tp > kv:
        return q, [r >> ((tp // kv).bit_length() - 1)]
    return q, list(range(r * kv // tp, (r + 1) * kv // tp))


def heads_other_shape(h, kv, tp, r):
    q = _checked(h, kv, tp, r)
    return q, [r * kv // tp] if tp > kv else list(range(r * kv // tp, (r + 1) * kv // tp))


def test_12_2_a_shift_is_caught_on_kv_heads_shared_by_3_5_or_7_ranks(monkeypatch):
    hint = caught_only_by_the_stage(ch12.check_rank_heads, heads_shifted, monkeypatch,
                                    "rank_heads(", "each KV head on")
    assert "power of two" in hint and "r // (tp_size // num_kv_heads)" in hint, hint


def test_12_2_cases_reach_states_the_fixed_cases_do_not():
    cases = ch12.head_cases()
    assert cases == ch12.head_cases()
    seen = numeric.states(cases)
    assert seen["each KV head on 3 ranks"] and seen["each KV head on 7 ranks"]
    assert seen["3 ranks"] and seen["5 ranks"] and seen["groups of 7"]


def test_12_2_a_right_answer_of_another_shape_passes():
    assert verdict(ch12.check_rank_heads, heads_other_shape)[0] == "✅"


# ---------------------------------------------------------------- 12.3 rank_attention


def attention_shifted(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce):
    """The solution's shape, its replicated KV head found by a shift (see 12.2's)."""
    d, n = w.head_dim, x.shape[0]
    q_heads, kv_heads = heads_shifted(w.num_heads, w.num_kv_heads, tp, rank)
    q_rows = slice(q_heads[0] * d, (q_heads[-1] + 1) * d)
    kv_rows = slice(kv_heads[0] * d, (kv_heads[-1] + 1) * d)

    def project(weight, bias, rows):
        y = x @ weight[rows].T
        return (y if bias is None else y + bias[rows]).view(n, -1, d)

    q = apply_rope(project(w.q, w.q_bias, q_rows), cos, sin)
    k = apply_rope(project(w.k, w.k_bias, kv_rows), cos, sin)
    reshape_and_cache(k, project(w.v, w.v_bias, kv_rows), *kv_cache, meta.slot_mapping,
                      backend="torch")
    out = paged_prefill(q.contiguous(), *kv_cache, meta.block_tables, meta.seq_lens,
                        meta.query_lens, backend="torch")
    partial = out.reshape(n, -1) @ w.o[:, q_rows].T
    all_reduce(partial)
    return partial if w.o_bias is None else partial + w.o_bias


def test_12_3_a_shift_passes_the_named_steps_and_the_generated_ones_catch_it():
    for step in ch12.steps():
        ch12.compare(step, ch12.replayed(attention_shifted, step))
    with pytest.raises(CheckFailed) as caught:
        ch12.check_generated(attention_shifted)
    message, hint = caught.value.message, caught.value.hint
    assert message.startswith("generated case ") and "3 ranks" in message, message
    assert "fails on 3" in hint and "r // (tp_size // num_kv_heads)" in hint, hint
