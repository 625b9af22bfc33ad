"""The generated stage of 01.1, 01.4, 02.2 and 02.4: paged_lib.course.grading.generated.
small_ints (real model configurations, block sizes that are not powers of two) and
small_sim (last steps, batches with tied prompt lengths).

For each exercise: a plausible wrong answer passes every fixed case (✅ with the generated
stage patched out) and gets ❌ from the generated stage, with a shrunk story and a hint
that names the mistake; a correct answer of another shape than the solution's passes.
(02.1 and 02.3 take no input: their fixed checks compare the whole answer.)
"""

import math

import numpy as np
from stage_verdicts import caught_only_by_the_stage, verdict

from paged_lib.course.grading import ch01, ch02
from paged_lib.course.grading.generated import numeric, small_ints, small_sim


def test_cases_are_seeded_and_reach_states_no_fixed_case_does():
    for cases in (small_ints.kv_cases, small_ints.budget_cases, small_sim.slot_cases,
                  small_sim.batch_cases):
        assert cases() == cases()
    assert numeric.states(small_ints.kv_cases())["head_dim not hidden / heads"] >= 3
    budget = numeric.states(small_ints.budget_cases())
    assert budget["a context of whole blocks of a size not a power of two"]
    assert budget["block size 12"] and budget["a budget past 2**32 bytes"]
    assert numeric.states(small_sim.slot_cases())["its last step, final_len < max_len"]
    batch = numeric.states(small_sim.batch_cases())
    assert batch["two requests of the same prompt length"] and batch["an empty batch"]
    assert batch["a request that just left"] and batch["block size not a power of two"]


def kv_right(s):
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * s.dtype_bytes


# ------------------------------------------------------------------ 01.1

def kv_head_from_hidden(s):
    """Wrong: the head size derived from the hidden size, as it is for every fixed model."""
    return 2 * s.num_layers * s.num_kv_heads * (s.hidden_size // s.num_heads) * s.dtype_bytes


def kv_prod(s):
    """Right, another shape: KV heads as query heads over the group size."""
    return math.prod((2, s.num_layers, s.num_heads // s.group_size, s.head_dim,
                      s.dtype_bytes))


def test_01_1_head_size_from_hidden_is_caught_only_by_real_configurations(monkeypatch):
    hint = caught_only_by_the_stage(ch01.check_kv_bytes_per_token, kv_head_from_hidden,
                                    monkeypatch, "Gemma 7B", "1 layer",
                                    "KV heads of 256 (not 3072 / 16 = 192)")
    assert "use spec.head_dim, never derive it from hidden_size" in hint
    assert verdict(ch01.check_kv_bytes_per_token, kv_prod)[0] == "✅"


# ------------------------------------------------------------------ 01.4

def max_align_mask(spec, budget, ctx, bs):
    """Wrong: the context rounded up to whole blocks with a bit mask, right for the fixed
    blocks of 16 (a power of two) only."""
    return budget // (((ctx + bs - 1) & -bs) * kv_right(spec))


def max_per_request(spec, budget, ctx, bs):
    """Right, another shape: the budget over one request's whole blocks in bytes."""
    return budget // (-(-ctx // bs) * bs * kv_right(spec))


def test_01_4_a_power_of_two_mask_is_caught_only_at_other_block_sizes(monkeypatch):
    hint = caught_only_by_the_stage(ch01.check_max_requests, max_align_mask, monkeypatch,
                                    "block_size 24", "context_len 1", "1 layer")
    assert hint.startswith("it passes once block_size is a power of two")
    assert verdict(ch01.check_max_requests, max_per_request)[0] == "✅"


# ------------------------------------------------------------------ 02.2

def slots_freed_in_last_step(n, length, max_len):
    """Wrong: a request that stores its final length taken for finished, holding nothing."""
    return (n, 0, 0) if n == length else (n, length - n, max_len - length)


def slots_array(n, length, max_len):
    """Right, another shape: a numpy array, internal as what is left of max_len."""
    return np.array([n, length - n, max_len - n - (length - n)])


def test_02_2_the_last_step_is_caught_only_by_the_generated_cases(monkeypatch):
    hint = caught_only_by_the_stage(ch02.check_orca_max_slots, slots_freed_in_last_step,
                                    monkeypatch, "orca_max_slots(1, 1, 2) (its last step)")
    assert "from admission to the end, its last step" in hint
    assert verdict(ch02.check_orca_max_slots, slots_array)[0] == "✅"


# ------------------------------------------------------------------ 02.4

def snapshot_by_prompt(prompt_lens, output_lens, step, slots):
    """Wrong: requests paired up in a dict keyed by prompt length (one per length)."""
    total = [0, 0, 0]
    for p, o in dict(zip(prompt_lens, output_lens, strict=True)).items():
        if step < o:
            for k, v in enumerate(slots(p + step + 1, p + o)):
                total[k] += v
    return tuple(total)


def snapshot_rows(prompt_lens, output_lens, step, slots):
    """Right, another shape: the running requests' triples, summed column by column."""
    rows = [slots(p + step + 1, p + o) for p, o in zip(prompt_lens, output_lens, strict=True)
            if step < o]
    return tuple(sum(r[k] for r in rows) for k in range(3))


def test_02_4_requests_of_the_same_prompt_length_are_caught_only_by_generated_batches(
        monkeypatch):
    hint = caught_only_by_the_stage(ch02.check_batch_snapshot, snapshot_by_prompt,
                                    monkeypatch, "batch_snapshot([1, 1], [1, 1], 0")
    assert "two requests of the same length" in hint and "a dict" in hint
    assert verdict(ch02.check_batch_snapshot, snapshot_rows)[0] == "✅"

