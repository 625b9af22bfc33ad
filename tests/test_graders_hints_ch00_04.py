"""Chapters 00-04's graders: wrong answers that once passed, or failed with a hint that
named another mistake, get ❌ with theirs; right answers of other shapes than the solution's
get ✅."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_graders_ch00_03 import SIMULATOR, _compile, append_ok, derivation, predictions

from paged_lib.accounting import kv_bytes_per_token
from paged_lib.blocks import Slot
from paged_lib.course.grading import ch00, ch01, ch02, ch03, ch04
from paged_lib.util import cdiv

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def verdict(capsys, check, answer) -> str:
    check(answer)
    out = capsys.readouterr().out
    assert out.count("\n") <= 2, out
    return out


POW2 = "it passes once the block size is a power of two"


@pytest.mark.parametrize("check, answer, hint", [
    # bit tricks that divide only by powers of two (vLLM's block sizes are, the course's not)
    (ch00.check_ceil_div, lambda n, b: (n + b - 1) >> (b.bit_length() - 1), POW2),
    (ch00.check_ceil_div, lambda n, b: ((n + b - 1) & -b) // b, POW2),
    (ch01.check_logical_blocks, lambda n, b: (n + b - 1) >> (b.bit_length() - 1), POW2),
    (ch01.check_last_block_fill, lambda n, b: ((n & (b - 1)) or b) / b if n else 0.0, POW2),
    # float32 is exact when dividing by a power of two: named as float32, not as a bit trick
    (ch01.check_last_block_fill, lambda n, b: np.float32(((n % b) or b) / b) if n else 0.0,
     "float32 keeps about 7 digits"),
    # the slips named before stay named (the contrast would say "power of two" for them)
    (ch01.check_last_block_fill, lambda n, b: (n % b) / b, "`n % bs` is 0 there"),
    (ch01.check_last_block_fill, lambda n, b: 0.0 if n == 0 else ((n / b) % 1 or 1.0),
     "n / b is a float"),
])
def test_00_01_bit_tricks_and_float32_are_named(capsys, check, answer, hint):
    out = verdict(capsys, check, answer)
    assert out.startswith("❌ [0") and hint in out, out


def _max(spec, budget, bs, per_request):
    return budget // (bs * kv_bytes_per_token(spec)) // per_request


@pytest.mark.parametrize("answer, hint", [
    # a slot for the token the request will produce next (02's prompt + s + 1, too early)
    (lambda s, budget, ctx, bs: _max(s, budget, bs, cdiv(ctx + 1, bs)), "no slot for a next"),
    # bytes per token from hidden_size: wrong where head_dim != hidden_size / num_heads
    (lambda s, budget, ctx, bs: budget // (bs * 2 * s.num_layers * s.hidden_size
                                           * s.dtype_bytes) // cdiv(ctx, bs), "not hidden_size"),
])
def test_01_4_slips_are_named(capsys, answer, hint):
    out = verdict(capsys, ch01.check_max_requests, answer)
    assert out.startswith("❌ [01.4]") and hint in out, out


@pytest.mark.parametrize("new, hint", [
    # ceil(a) as floor + 1 where a has a fraction: whole arrivals (1.0) join a step late
    ("int(requests[i].arrival) + (requests[i].arrival > 0)", "joins at step ceil(a)"),
    ("math.floor(requests[i].arrival) + 1", "joins at step ceil(0.0) = 0"),
])
def test_02_5_whole_number_arrivals_join_at_their_own_step(capsys, new, hint):
    bug = _compile(SIMULATOR.replace("math.ceil(requests[i].arrival)", new))
    out = verdict(capsys, ch02.check_paged_simulator, bug)
    assert out.startswith("❌ [02.5]") and hint in out, out


def test_02_5_two_victims_of_one_step_go_to_the_head_in_turn(capsys):
    """Victims gathered and put in front as a group, in the order preempted: the most recently
    admitted ends up first, ahead of one admitted before it."""
    source = SIMULATOR.replace("            queue.appendleft(victim)\n",
                               "            victims.append(victim)\n")
    source = source.replace("        while sum(", "        victims = []\n        while sum(", 1)
    source = source.replace("        for i in running:\n            num_free -=",
                            "        queue = deque(victims + list(queue))\n"
                            "        for i in running:\n            num_free -=")
    out = verdict(capsys, ch02.check_paged_simulator, _compile(source))
    assert out.startswith("❌ [02.5]") and "of two preempted in one step" in out, out


@pytest.mark.parametrize("pairs", [
    # numpy arrays for the per-request counts: every total a numpy integer
    [("done, blocks = [0] * len(requests), [0] * len(requests)",
      "done, blocks = np.zeros(len(requests), np.int64), np.zeros(len(requests), np.int64)"),
     ("out[\"num_steps\"] = t", "out = {k: np.int64(x) for k, x in out.items()}\n"
                               "    out[\"num_steps\"] = np.int64(t)")],
    # arrivals from a heap of (step, arrival, index): another way to keep ties in list order
    [("arrivals = deque((max(0, math.ceil(requests[i].arrival)), i) for i in order)",
      "heap = [(math.ceil(r.arrival), r.arrival, i) for i, r in enumerate(requests)]\n"
      "    heapq.heapify(heap)\n"
      "    arrivals = deque(heapq.heappop(heap)[::2] for _ in range(len(requests)))")],
], ids=["numpy counts", "heap of arrivals"])
def test_02_5_right_answers_of_other_shapes_pass(capsys, pairs):
    source = "import heapq\nimport numpy as np\n" + SIMULATOR
    for old, new in pairs:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    assert verdict(capsys, ch02.check_paged_simulator, _compile(source)).startswith("✅ [02.5]")


def test_02_3_empty_slots_without_the_token_being_produced_is_named(capsys):
    out = verdict(capsys, ch02.check_derivation, derivation(**{"paged: empty slots held": 8}))
    assert out.startswith("❌ [02.3]") and "prompt + s + 1" in out, out


def test_03_4_counts_and_ids_are_ints(capsys):
    floats = predictions(**{"refs after the forks": {5: 3.0, 2: 3.0, 9: 3.0}})
    out = verdict(capsys, ch03.check_predictions, floats)
    assert out.startswith("❌ [03.4]") and "expected an int, got 3.0" in out, out
    slot = predictions(**{"parent's slot": Slot(9, 8.0)})
    assert verdict(capsys, ch03.check_predictions, slot).startswith("❌ [03.4]")
    numpy = {k: {np.int64(b): np.int32(c) for b, c in v.items()} if isinstance(v, dict)
             else Slot(np.int64(v.block), np.int64(v.offset), v.copy)
             for k, v in ch03.prediction_scenario().items()}
    assert verdict(capsys, ch03.check_predictions, predictions(**numpy)).startswith("✅")


def append_rebinds(table):
    """Builds a new list instead of changing table._blocks in place."""
    slot = append_ok(table)
    table._blocks = list(table._blocks)
    return Slot(np.int64(slot.block), np.int64(slot.offset), slot.copy)


def free_by_membership(block, ref_counts, free_block_ids):
    """A double free found on the free list; the count read through try/except."""
    try:
        count = ref_counts[block] if block >= 0 else ref_counts[len(ref_counts)]
    except IndexError:
        raise ValueError(f"unknown block {block}") from None
    if block in free_block_ids:
        raise ValueError(f"block {block} is already free")
    ref_counts[block] = count - 1
    if count == 1:
        free_block_ids.extend([block])


def append_to_the_copy(table):
    """Changes table.blocks, a copy, instead of table._blocks."""
    if table._num_tokens % table.block_size == 0:
        block = table.allocator.allocate()
        table.blocks.append(block)
        table._num_tokens += 1
        return Slot(block, 0)
    return append_ok(table)


def test_03_1_a_change_to_the_copy_of_the_blocks_is_named(capsys):
    out = verdict(capsys, ch03.check_append_token, append_to_the_copy)
    assert out.startswith("❌ [03.1]") and "table.blocks is a copy" in out, out


def test_03_right_answers_of_other_shapes_pass(capsys):
    assert verdict(capsys, ch03.check_append_token, append_rebinds).startswith("✅ [03.1]")
    assert verdict(capsys, ch03.check_free_block, free_by_membership).startswith("✅ [03.3]")


def _merge(a, b, *, axis=lambda w: w[..., None], nan_to_num=False):
    (ma, la, acc_a), (mb, lb, acc_b) = a, b
    m = torch.maximum(ma, mb)
    top = m if nan_to_num else torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(ma - top), torch.exp(mb - top)
    if nan_to_num:  # exp(-inf - -inf) is NaN: 0 instead, after the fact
        wa, wb = wa.nan_to_num(0.0), wb.nan_to_num(0.0)
    return m, wa * la + wb * lb, axis(wa) * acc_a + axis(wb) * acc_b


def test_04_1_one_leading_dimension_only_is_named(capsys):
    out = verdict(capsys, ch04.check_merge_states,
                  lambda a, b: _merge(a, b, axis=lambda w: w.unsqueeze(1)))
    assert out.startswith("❌ [04.1]") and "w[..., None]" in out, out
    out = verdict(capsys, ch04.check_merge_states, lambda a, b: _merge(a, b, nan_to_num=True))
    assert out.startswith("✅ [04.1]"), out


def _decode(q, k_cache, v_cache, block_table, seq_len, scale, *, kv_head=None):
    """Per-head gather of each block, then an online merge; the table read until -1."""
    heads = q.shape[0]
    _, bs, kv_heads, _ = k_cache.shape
    pick = torch.tensor([kv_head(h, heads, kv_heads) if kv_head else h // (heads // kv_heads)
                         for h in range(heads)])
    state = (torch.full((heads,), -math.inf, dtype=q.dtype), torch.zeros(heads, dtype=q.dtype),
             torch.zeros_like(q))
    for j, b in enumerate(int(x) for x in block_table):
        if b < 0:
            break
        n = min(bs, seq_len - j * bs)
        k, v = k_cache[b][:n, pick], v_cache[b][:n, pick]
        s = torch.einsum("hd,thd->ht", q, k) * scale
        p = torch.exp(s - s.amax(-1, keepdim=True))
        state = _merge(state, (s.amax(-1), p.sum(-1), torch.einsum("ht,thd->hd", p, v)))
    return state[2] / state[1][:, None]


def test_04_2_a_query_heads_index_as_a_kv_heads_is_named(capsys):
    out = verdict(capsys, ch04.check_paged_online,
                  lambda *a: _decode(*a, kv_head=lambda h, heads, kv: h // kv))
    assert out.startswith("❌ [04.2]") and "not h // num_kv_heads" in out, out
    assert verdict(capsys, ch04.check_paged_online, _decode).startswith("✅ [04.2]")
