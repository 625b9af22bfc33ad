"""Grading by replay (paged_lib.course.grading.replay): the engine's own calls to a hook,
asked again of the learner's function.

The recorded calls must reach the states a fixed list of cases misses (a prefill that
starts mid-sequence, groups admitted in one step, a forked group swapped, a budget half
spent by decodes), the library's pieces must pass their own replay, and a wrong rule that
every fixed case lets through must get ❌ with the story of the call that exposed it.
"""

import pytest
import torch

import paged_lib  # noqa: F401  # isort: split
from paged_lib.course import grading
from paged_lib.course.exercises import REPLAYED
from paged_lib.course.grading import ch06, ch07, replay
from paged_lib.course.grading import ch06_admission as admission
from paged_lib.engine import EngineHooks
from paged_lib.model import AttentionMetadata

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def verdict(check, fn):
    with grading.record_verdicts() as seen:
        check(fn)
    return seen[-1]


def test_the_recorded_calls_reach_the_states_fixed_cases_miss():
    calls = replay.recorded()
    assert {c.workload for c in calls["can_admit"]} == {w.name for w in replay.workloads()}
    meta = [c.args for c in calls["build_metadata"]]
    assert any(s > q > 1 for _, lens, qs, _ in meta for s, q in zip(lens, qs, strict=True)), \
        "a prefill that starts mid-sequence (a prefix hit, a chunk, a recompute's tail)"
    assert any(len({g.timeline.admitted_steps[-1] for g in c.args[0]}) < len(c.args[0])
               for c in calls["choose_victim"]), "groups admitted in the same step"
    assert any(len(g.live_seqs()) > 1 for c in calls["choose_victim"] for g in c.args[0])
    assert any(len(c.args[0]) > 1 for c in calls["swap_mapping"]), "a forked group swapped"
    budgets = [c.args[3] for c in calls["can_admit"]]
    assert any(b.num_batched_tokens > 0 and b.num_seqs > 0 for b in budgets)
    assert any(c.result is False for c in calls["can_admit"])
    assert any(len(c.args[0].live_seqs()) > 1 for c in calls["num_required_blocks"])
    assert any(c.result for c in calls["longest_cache_hit"]), "a hit"


@pytest.mark.parametrize("name", REPLAYED)
def test_the_librarys_own_pieces_pass_their_replay(name):
    replay.check_replay(name, getattr(EngineHooks(), name), "unused")


def _metadata_prefill_from_zero(tables, seq_lens, query_lens, block_size):
    """Right for decodes and for prompts computed whole, wrong for any prefill that starts
    later (the fixed batches never have one)."""
    slots, positions = [], []
    for table, seq_len, q in zip(tables, seq_lens, query_lens, strict=True):
        start = seq_len - 1 if q == 1 else 0
        for p in range(start, start + q):
            slots.append(table[p // block_size] * block_size + p % block_size)
            positions.append(p)
    width = max((len(t) for t in tables), default=0)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables],
                                  dtype=torch.int32).reshape(len(tables), width),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_lens=torch.tensor(query_lens, dtype=torch.int32),
        positions=torch.tensor(positions, dtype=torch.int64))


def test_a_metadata_rule_wrong_only_mid_sequence_is_caught_by_the_replay():
    mark, _, message = verdict(ch06.check_build_metadata, _metadata_prefill_from_zero)
    assert mark == "❌" and "the engine's call in 'prefix caching and chunks" in message


def _swap_sharing_with_the_previous_table(tables, allocate):
    """Copies a block once if the previous table holds it too: right for every group
    whose tables share only a common prefix."""
    out, seen, previous = [], set(), []
    for table in tables:
        for block in table:
            if block in seen and block in previous:
                continue
            seen.add(block)
            out.append((block, allocate()))
        previous = table
    return out


def test_a_swap_mapping_that_shares_with_the_previous_table_only_is_caught():
    mark, _, message = verdict(ch07.check_swap_mapping, _swap_sharing_with_the_previous_table)
    assert mark == "❌" and "the last shares block 4 with the second only" in message


def test_a_difference_is_told_as_a_story_with_the_state():
    def at_most_six_running(need, seqs, tokens, b):  # right on every fixed case
        return (b.free_blocks - need >= b.watermark_blocks and b.num_seqs + seqs <= 6
                and b.num_seqs + seqs <= b.max_num_seqs
                and b.num_batched_tokens + tokens <= b.max_num_batched_tokens)

    mark, _, message = verdict(admission.check_can_admit, at_most_six_running)
    assert mark == "❌"
    assert message.startswith("replaying the engine: in '") and "at engine step" in message
    assert "can_admit(" in message and "the library answers True, yours False" in message
