"""Chapters 06-07's graders against typical wrong answers: each gets ❌ with a hint naming it."""

from __future__ import annotations

import pytest
import torch

from paged_lib.course.demos import your_serving
from paged_lib.course.exercises import EXERCISES
from paged_lib.course.grading import ch06, ch07
from paged_lib.engine.block_manager import num_required_blocks, swap_mapping
from paged_lib.engine.model_runner import build_metadata
from paged_lib.engine.policy import can_admit, choose_victim
from paged_lib.model import AttentionMetadata


def verdict(capsys, check, answer) -> str:
    check(answer)
    out = capsys.readouterr().out
    assert out.count("\n") <= 2, out  # one verdict line, at most one hint line
    return out


# ---------------------------------------------------------------- 06.1 build_metadata


def _meta(slots, padded, seq_lens, query_lens, positions, slot_dtype=torch.int64,
          table_dtype=torch.int32):
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=slot_dtype),
        block_tables=torch.tensor(padded, dtype=table_dtype).reshape(len(padded), -1),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_lens=torch.tensor(query_lens, dtype=torch.int32),
        positions=torch.tensor(positions, dtype=torch.int64))


def meta_with(slot_fn=None, pad=-1, all_positions=False, slot_dtype=torch.int64,
              table_dtype=torch.int32, in_place=False, from_zero=False, pad_slots=False):
    """A build_metadata with one planted mistake (defaults: correct)."""
    def fn(block_tables, seq_lens, query_lens, block_size):
        slots, positions = [], []
        for table, n, q in zip(block_tables, seq_lens, query_lens, strict=True):
            first = 0 if all_positions or from_zero else n - q
            for pos in range(first, q if from_zero else n):
                slots.append(slot_fn(table, pos, block_size) if slot_fn else
                             table[pos // block_size] * block_size + pos % block_size)
                positions.append(pos)
            if pad_slots:  # vLLM pads a padded batch's slots with -1 (PAD_SLOT_ID)
                slots += [-1] * (max(query_lens) - q)
        width = max(len(t) for t in block_tables)
        if in_place:
            for t in block_tables:
                t += [pad] * (width - len(t))
            padded = block_tables
        elif pad == "last":  # "a valid block" as filler
            padded = [t + [t[-1]] * (width - len(t)) for t in block_tables]
        else:
            padded = [t + [pad] * (width - len(t)) for t in block_tables]
        return _meta(slots, padded, seq_lens, query_lens, positions, slot_dtype, table_dtype)
    return fn


def test_06_1_a_correct_answer_passes_and_the_library_is_refused(capsys):
    assert verdict(capsys, ch06.check_build_metadata, meta_with()).startswith("✅ [06.1]")
    out = verdict(capsys, ch06.check_build_metadata, build_metadata)
    assert out.startswith("❌ [06.1]") and "you passed the library's build_metadata" in out


@pytest.mark.parametrize("wrong, hint", [
    (meta_with(slot_fn=lambda t, p, b: (p // b) * b + p % b), "look it up in the sequence's table"),
    (meta_with(slot_fn=lambda t, p, b: t[p // b] * b + p), "not the position"),
    # the table's last block for every new token: right for a decode, not a prefill
    (meta_with(slot_fn=lambda t, p, b: t[-1] * b + p % b), "block_tables[s][p // block_size]"),
    (meta_with(pad=0), "pad with -1, never with a block id such as 0"),
    (meta_with(slot_dtype=torch.int32), "slot_mapping is int64"),
    (meta_with(table_dtype=torch.int64), "block_tables is torch.int32"),
    (meta_with(all_positions=True), "only the new tokens get a slot"),
    (meta_with(in_place=True), "changed the block tables it was given"),
    # new tokens counted from position 0 of each sequence: the spec's decode is wrong
    (meta_with(from_zero=True), "slot_mapping[0] is 28, expected 9 (token at position 5)"),
    (meta_with(from_zero=True), "a decode's one token is its last"),
    (meta_with(pad_slots=True), "one slot per new token, sequences packed back to back"),
    (meta_with(pad="last"), "pads short rows with [5], expected -1"),
    (lambda *a: meta_with()(*a).__dict__, "expected an AttentionMetadata"),
])
def test_06_1_wrong_answers_get_a_named_hint(capsys, wrong, hint):
    out = verdict(capsys, ch06.check_build_metadata, wrong)
    assert out.startswith("❌ [06.1]") and hint in out, out


def meta_chunk_from_zero(tables, seq_lens, query_lens, block_size):
    """Right for decodes and for prompts computed whole, wrong for any prefill that starts
    later (a prefix hit, a chunk, a recompute's tail): no fixed batch has one."""
    meta = meta_with()(tables, seq_lens, query_lens, block_size)
    positions = [p for n, q in zip(seq_lens, query_lens, strict=True)
                 for p in (range(n - 1, n) if q == 1 else range(q))]
    meta.slot_mapping = torch.tensor([t[p // block_size] * block_size + p % block_size
                                      for t, n, q in zip(tables, seq_lens, query_lens,
                                                         strict=True)
                                      for p in (range(n - 1, n) if q == 1 else range(q))],
                                     dtype=torch.int64)
    meta.positions = torch.tensor(positions, dtype=torch.int64)
    return meta


def test_06_1_a_prefill_mid_sequence_is_caught_by_the_generated_batches(capsys):
    out = verdict(capsys, ch06.check_build_metadata, meta_chunk_from_zero)
    assert out.startswith("❌ [06.1]") and "generated case" in out, out
    assert "the tokens a step computes are each sequence's newest" in out, out


def test_06_1_wrong_positions_are_named(capsys):
    def zero_based(block_tables, seq_lens, query_lens, block_size):
        meta = meta_with()(block_tables, seq_lens, query_lens, block_size)
        meta.positions = torch.arange(meta.positions.numel(), dtype=torch.int64)
        return meta
    out = verdict(capsys, ch06.check_build_metadata, zero_based)
    assert out.startswith("❌ [06.1]") and "positions" in out, out


# ---------------------------------------------------------------- 06.2 num_required_blocks


def required_correct(group, block_size):
    seqs = group.live_seqs()
    if len(seqs) == 1:
        return -(-seqs[0].num_tokens // block_size)
    prompt = len(group.prompt_token_ids)
    base = -(-prompt // block_size)
    tails = sum(-(-s.num_tokens // block_size) - base for s in seqs)
    return base + tails + (len(seqs) - 1 if prompt % block_size else 0)


def required_per_sample(group, block_size):  # the prompt's blocks once per sample
    if len(group.seqs) == 1:
        return group.params.n * -(-group.seqs[0].num_tokens // block_size)
    return required_correct(group, block_size)


def required_prompt_only(group, block_size):  # a recomputed sequence's output forgotten
    if len(group.live_seqs()) == 1:
        return -(-len(group.prompt_token_ids) // block_size)
    return required_correct(group, block_size)


def required_no_sharing(group, block_size):  # each sequence's whole text
    return sum(-(-s.num_tokens // block_size) for s in group.live_seqs())


def required_no_cow(group, block_size):  # the part-filled prompt block's copies forgotten
    seqs = group.live_seqs()
    if len(seqs) == 1:
        return required_correct(group, block_size)
    base = -(-len(group.prompt_token_ids) // block_size)
    return base + sum(-(-s.num_tokens // block_size) - base for s in seqs)


def required_copy_for_all(group, block_size):  # the last holder copies too
    extra = len(group.live_seqs()) > 1 and len(group.prompt_token_ids) % block_size
    return required_correct(group, block_size) + bool(extra)


def required_finished_too(group, block_size):  # finished sequences counted
    class All:
        seqs = group.seqs
        prompt_token_ids = group.prompt_token_ids
        params = group.params

        def live_seqs(self):
            return group.seqs
    return required_correct(All(), block_size)


def required_rounds_down(group, block_size):
    seqs = group.live_seqs()
    if len(seqs) == 1:
        return seqs[0].num_tokens // block_size
    return required_correct(group, block_size)


def required_first_tail(group, block_size):  # every live tail as long as the first one
    seqs = group.live_seqs()
    base = -(-len(group.prompt_token_ids) // block_size)
    tail = -(-seqs[0].num_tokens // block_size) - base
    return base + len(seqs) * tail + (
        len(seqs) - 1 if len(seqs) > 1 and len(group.prompt_token_ids) % block_size else 0)


def required_float(group, block_size):
    return float(required_correct(group, block_size))


def test_06_2_a_correct_answer_passes(capsys):
    assert verdict(capsys, ch06.check_num_required_blocks,
                   required_correct).startswith("✅ [06.2]")


@pytest.mark.parametrize("wrong, hint", [
    (required_per_sample, "not once per sample"),
    (required_prompt_only, "the prompt *and* the tokens it generated"),
    (required_no_sharing, "count the prompt's blocks once, then each sequence's own tail"),
    (required_no_cow, "forgot the copy-on-write of the part-filled last prompt block"),
    (required_copy_for_all, "one copy too many"),
    (required_finished_too, "finished sequences take no blocks"),
    (required_rounds_down, "the partly filled last block counts too"),
    (required_first_tail, "by its own num_tokens, not by one sequence's"),
    (required_float, "expected an int"),
    (num_required_blocks, "you passed the library's num_required_blocks"),
    (lambda g, b: num_required_blocks(g, b), "your function called the library's"),
])
def test_06_2_wrong_answers_get_a_named_hint(capsys, wrong, hint):
    out = verdict(capsys, ch06.check_num_required_blocks, wrong)
    assert out.startswith("❌ [06.2]") and hint in out, out


# ---------------------------------------------------------------- 06.3 can_admit


def admit_correct(need, seqs, tokens, b):
    return (b.free_blocks - need >= b.watermark_blocks and b.num_seqs + seqs <= b.max_num_seqs
            and b.num_batched_tokens + tokens <= b.max_num_batched_tokens)


def admit_with(blocks=None, seqs_ok=None, tokens_ok=None):
    """can_admit with one of its three parts replaced (defaults: correct)."""
    def fn(need, seqs, tokens, b):
        return ((blocks or (lambda: b.free_blocks - need >= b.watermark_blocks))()
                and (seqs_ok or (lambda: b.num_seqs + seqs <= b.max_num_seqs))()
                and (tokens_ok or (lambda: b.num_batched_tokens + tokens
                                   <= b.max_num_batched_tokens))())
    return fn


def admit_no_watermark(need, seqs, tokens, b):
    return admit_with(blocks=lambda: b.free_blocks - need >= 0)(need, seqs, tokens, b)


def admit_strict(need, seqs, tokens, b):
    return admit_with(blocks=lambda: b.free_blocks - need > b.watermark_blocks)(
        need, seqs, tokens, b)


def admit_watermark_before(need, seqs, tokens, b):  # watermark checked before taking
    return admit_with(blocks=lambda: need <= b.free_blocks and b.free_blocks
                      > b.watermark_blocks)(need, seqs, tokens, b)


def admit_watermark_per_seq(need, seqs, tokens, b):
    return admit_with(blocks=lambda: b.free_blocks - need >= b.watermark_blocks * seqs)(
        need, seqs, tokens, b)


def admit_blocks_per_seq(need, seqs, tokens, b):  # each sample its own blocks again
    return admit_with(blocks=lambda: b.free_blocks - need * seqs >= b.watermark_blocks)(
        need, seqs, tokens, b)


def admit_empty_step_into_watermark(need, seqs, tokens, b):  # 06.4's progress rule, here
    if b.num_seqs == 0 and b.num_batched_tokens == 0:
        return admit_with(blocks=lambda: need <= b.free_blocks)(need, seqs, tokens, b)
    return admit_correct(need, seqs, tokens, b)


def admit_past_max_seqs(need, seqs, tokens, b):
    return admit_with(seqs_ok=lambda: True)(need, seqs, tokens, b)


def admit_one_seq_per_group(need, seqs, tokens, b):
    return admit_correct(need, 1, tokens, b)


def admit_group_alone(need, seqs, tokens, b):  # the step's own sequences and tokens forgotten
    return admit_with(seqs_ok=lambda: seqs <= b.max_num_seqs,
                      tokens_ok=lambda: tokens <= b.max_num_batched_tokens)(
        need, seqs, tokens, b)


def admit_strict_limits(need, seqs, tokens, b):
    return admit_with(seqs_ok=lambda: b.num_seqs + seqs < b.max_num_seqs,
                      tokens_ok=lambda: b.num_batched_tokens + tokens
                      < b.max_num_batched_tokens)(need, seqs, tokens, b)


def admit_ignores_tokens(need, seqs, tokens, b):
    return admit_with(tokens_ok=lambda: True)(need, seqs, tokens, b)


def admit_step_tokens_forgotten(need, seqs, tokens, b):
    return admit_with(tokens_ok=lambda: tokens <= b.max_num_batched_tokens)(
        need, seqs, tokens, b)


def admit_tokens_per_seq(need, seqs, tokens, b):  # each sample computing the prompt
    return admit_with(tokens_ok=lambda: b.num_batched_tokens + tokens * seqs
                      <= b.max_num_batched_tokens)(need, seqs, tokens, b)


def admit_as_int(need, seqs, tokens, b):
    return int(admit_correct(need, seqs, tokens, b))


def test_06_3_a_correct_answer_passes(capsys):
    assert verdict(capsys, ch06.check_can_admit, admit_correct).startswith("✅ [06.3]")


@pytest.mark.parametrize("wrong, hint", [
    (admit_no_watermark, "a request needing 19 blocks"),
    (admit_no_watermark, "less than the watermark of 2"),
    (admit_strict, "off by one at the watermark"),
    (admit_watermark_before, "only 1 stays free, less than the watermark of 2"),
    (admit_watermark_per_seq, "kept once for the pool"),
    (admit_blocks_per_seq, "blocks_needed already counts the whole group"),
    (admit_empty_step_into_watermark, "the watermark holds in an empty step too"),
    (admit_past_max_seqs, "the same request with n=4 samples"),
    (admit_past_max_seqs, "9, past max_num_seqs of 8"),
    (admit_one_seq_per_group, "the group brings 4 (its samples run together)"),
    (admit_group_alone, "the step already holds 5 sequences"),
    (admit_strict_limits, "reaching max_num_seqs exactly is allowed"),
    (admit_ignores_tokens, "41 more make 101, past max_num_batched_tokens"),
    (admit_step_tokens_forgotten, "the step already holds 60 tokens"),
    (admit_tokens_per_seq, "they do not each compute it"),
    (admit_as_int, "return True or False"),
    (lambda *a: can_admit(*a), "your function called the library's can_admit"),
])
def test_06_3_wrong_answers_get_a_named_hint(capsys, wrong, hint):
    out = verdict(capsys, ch06.check_can_admit, wrong)
    assert out.startswith("❌ [06.3]") and hint in out, out


def test_06_not_attempted_is_not_a_failure(capsys):
    def stub(*args):
        raise NotImplementedError()
    for check, ex in ((ch06.check_build_metadata, "06.1"),
                      (ch06.check_num_required_blocks, "06.2"), (ch06.check_can_admit, "06.3")):
        assert verdict(capsys, check, stub).startswith(f"⏳ [{ex}]")


def test_graders_declare_their_twins():
    assert EXERCISES["06.1"].twins[0] == "paged_lib.engine.model_runner.build_metadata"
    assert EXERCISES["06.2"].twins[0] == "paged_lib.engine.block_manager.num_required_blocks"
    assert EXERCISES["06.3"].twins == ("paged_lib.engine.policy.can_admit",)
    assert EXERCISES["06.4"].twins[0] == "paged_lib.engine.policy.schedule_waiting"
    assert "paged_lib.engine.policy.can_admit" in EXERCISES["06.4"].twins


# ---------------------------------------------------------------- 07.1 swap_mapping


def swap_correct(tables, allocate):
    copies = {}
    for b in (b for t in tables for b in t):
        if b not in copies:
            copies[b] = allocate()
    return list(copies.items())


def swap_copy_twice(tables, allocate):
    return [(b, allocate()) for t in tables for b in t]


def swap_leaks(tables, allocate):
    mapping = {}
    for t in tables:
        for b in t:
            dst = allocate()
            mapping.setdefault(b, dst)
    return list(mapping.items())


def swap_reversed(tables, allocate):
    return [(dst, src) for src, dst in swap_correct(tables, allocate)]


def swap_as_dict(tables, allocate):
    return dict(swap_correct(tables, allocate))


def swap_sorted(tables, allocate):
    blocks = sorted({b for t in tables for b in t})
    return [(b, allocate()) for b in blocks]


def swap_first_table_only(tables, allocate):
    return [(b, allocate()) for b in tables[0]]


def swap_column_by_column(tables, allocate):  # position by position, as beams advance
    copies = {}
    for k in range(max(len(t) for t in tables)):
        for t in tables:
            if k < len(t) and t[k] not in copies:
                copies[t[k]] = allocate()
    return list(copies.items())


def swap_common_prefix_once(tables, allocate):  # only the prefix all tables share
    out, k = [], 0
    while all(k < len(t) for t in tables) and len({t[k] for t in tables}) == 1:
        out.append((tables[0][k], allocate()))
        k += 1
    return out + [(b, allocate()) for t in tables for b in t[k:]]


def swap_sharing_with_the_previous_table(tables, allocate):
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


def swap_in_place(tables, allocate):
    return [(b, b) for b in dict.fromkeys(b for t in tables for b in t)]


def test_07_1_a_correct_answer_passes_and_the_library_is_refused(capsys):
    assert verdict(capsys, ch07.check_swap_mapping, swap_correct).startswith("✅ [07.1]")
    out = verdict(capsys, ch07.check_swap_mapping, lambda t, a: swap_mapping(t, a))
    assert out.startswith("❌ [07.1]") and "called the library's swap_mapping" in out, out


@pytest.mark.parametrize("wrong, hint", [
    (swap_copy_twice, "copied a shared block twice"),
    (swap_leaks, "leaked blocks"),
    (swap_reversed, "the pairs are (src, dst)"),
    (swap_as_dict, "expected a list of (src, dst) int tuples"),
    (swap_sorted, "in the order the blocks are first met"),
    (swap_first_table_only, "every block of every table must be copied"),
    (swap_in_place, "each dst is a fresh block from allocate()"),
    (swap_column_by_column, "scenario 'three beams share 2 prompt blocks"),
    (swap_column_by_column, "in the order the blocks are first met"),
    (swap_common_prefix_once, "scenario 'three beams share 2 prompt blocks"),
    (swap_common_prefix_once, "block(s) [6] are copied more than once"),
    (swap_sharing_with_the_previous_table, "the last shares block 4 with the second only"),
    (swap_sharing_with_the_previous_table, "copied a shared block twice"),
])
def test_07_1_wrong_answers_get_a_named_hint(capsys, wrong, hint):
    out = verdict(capsys, ch07.check_swap_mapping, wrong)
    assert out.startswith("❌ [07.1]") and hint in out, out


def test_07_1_not_attempted_and_twin(capsys):
    def stub(*args):
        raise NotImplementedError()
    assert verdict(capsys, ch07.check_swap_mapping, stub).startswith("⏳ [07.1]")
    assert verdict(capsys, ch07.check_choose_victim, stub).startswith("⏳ [07.2]")
    assert EXERCISES["07.1"].twins == ("paged_lib.engine.block_manager.swap_mapping",)
    assert EXERCISES["07.2"].twins == ("paged_lib.engine.policy.choose_victim",)
    assert EXERCISES["07.3"].twins[0] == "paged_lib.engine.policy.preempt_until_fits"
    # 07.3 asks the engine's rule (step.hooks.choose_victim), so that twin is allowed there
    assert "paged_lib.engine.policy.choose_victim" not in EXERCISES["07.3"].twins


# ---------------------------------------------------------------- 07.2 choose_victim


def victim_newest(running):
    return running[-1]


def victim_oldest(running):  # the group asking for the block
    return running[0]


def victim_most_generated(running):
    return max(running, key=lambda g: len(g.seqs[0].output_token_ids))


def victim_most_blocks(running):
    return max(running, key=lambda g: len(g.seqs[0].block_table.blocks))


def victim_fewest_generated(running):
    return min(running, key=lambda g: len(g.seqs[0].output_token_ids))


def victim_latest_arrival(running):
    return max(running, key=lambda g: g.timeline.arrival_step)


def victim_latest_admission_step(running):  # ties: the first of them
    return max(running, key=lambda g: g.timeline.admitted_steps[-1])


def victim_fewest_blocks(running):  # "the least work lost" read as the least memory
    return min(running, key=lambda g: len({b for s in g.seqs for b in s.block_table.blocks}))


def victim_fewest_tokens(running):  # "the least work lost" read as the fewest tokens
    return min(running, key=lambda g: sum(s.num_tokens for s in g.seqs))


def victim_fewest_generated_last(running):  # ties: the last of them; not by arrival
    return min(reversed(running), key=lambda g: len(g.seqs[0].output_token_ids))


def victim_index(running):
    return len(running) - 1


def test_07_2_a_correct_answer_passes(capsys):
    assert verdict(capsys, ch07.check_choose_victim, victim_newest).startswith("✅ [07.2]")


@pytest.mark.parametrize("wrong, hint", [
    (victim_oldest, "you preempted the oldest group"),
    (victim_most_generated, "the most generated tokens"),
    (victim_most_blocks, "you preempted the largest group"),
    (victim_fewest_generated, "you chose by generated tokens (fewest)"),
    (victim_latest_arrival, "not the latest arrival, request id or first admission"),
    (victim_latest_admission_step, "whatever max() returns for a tie (the first)"),
    (victim_index, "not an index"),
    (victim_fewest_blocks, "list 'a long request first, two short ones admitted after it'"),
    (victim_fewest_blocks, "you preempted the smallest group (the fewest blocks"),
    (victim_fewest_tokens, "you preempted the smallest group"),
    # wrong on one list only, where the oldest is picked too: named by the rule that
    # picks as it does on the most lists
    (victim_fewest_generated_last, "you chose by generated tokens (fewest)"),
    # the order read from ids, arrivals, first admissions, a tie-break, or the list's second
    (lambda r: max(r, key=lambda g: g.request_id), "not the latest arrival, request id"),
    (lambda r: min(r, key=lambda g: g.timeline.arrival_step), "you preempted the oldest group"),
    (lambda r: max(r, key=lambda g: g.timeline.admitted_steps[0]), "or first admission"),
    (lambda r: max(r, key=lambda g: (g.timeline.admitted_steps[-1], g.request_id)),
     "list 'request 5, then request 3, admitted in the same step"),
    (lambda r: max(r, key=lambda g: (g.timeline.admitted_steps[-1], g.timeline.arrival_step)),
     "among groups admitted in the same step, the later in the list came later"),
    (lambda r: min([g for g in r if g.timeline.admitted_steps[-1] == max(
        h.timeline.admitted_steps[-1] for h in r)], key=lambda g: g.seqs[0].num_tokens),
     "whatever max() returns for a tie (the first), or their ids, arrivals or sizes"),
    (lambda r: max(r, key=lambda g: (g.timeline.admitted_steps[-1],
                                     -len(g.seqs[0].output_token_ids))),
     "whatever max() returns for a tie (the first), or their ids, arrivals or sizes"),
    (lambda r: r[1] if len(r) > 1 else r[0], "the group right after the one asking (running[1])"),
    (lambda r: max(r, key=lambda g: sum(s.num_tokens for s in g.seqs)), "the largest group"),
    (lambda running: running.pop(), "your function changed the list it was given"),
    (choose_victim, "you passed the library's choose_victim"),
    (lambda r: choose_victim(r), "your function called the library's choose_victim"),
])
def test_07_2_wrong_answers_get_a_named_hint(capsys, wrong, hint):
    out = verdict(capsys, ch07.check_choose_victim, wrong)
    assert out.startswith("❌ [07.2]") and hint in out, out


def test_07_2_a_wrong_pick_is_told_with_the_list_and_both_picks(capsys):
    """A wrong pick is told with the list it was made on (each group's admission step,
    tokens and blocks) and both picks."""
    out = verdict(capsys, ch07.check_choose_victim, victim_oldest)
    assert out.startswith("❌ [07.2]") and "list 'the example: A, B, C admitted" in out, out
    assert "request 2 (admitted at step 3, 10 generated" in out, out
    assert "you preempted request 0, expected request 2" in out and "the oldest group" in out


# ---------------------------------------------------------------- the demos


@pytest.fixture(scope="module")
def tiny_model():
    """A stand-in for the shipped model (with ignore_eos the schedule ignores weights)."""
    from paged_lib.model import TinyLlama, TinyLlamaConfig

    torch.manual_seed(0)
    cfg = TinyLlamaConfig(name="stand-in", num_layers=1, hidden_size=32, num_heads=2,
                          num_kv_heads=1, head_dim=16, vocab_size=264, intermediate_size=32,
                          max_position=256)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield TinyLlama(cfg).eval()
    torch.set_num_threads(threads)


def test_06_demo_runs_the_trace_with_the_learners_functions(capsys, tiny_model):
    figs = your_serving.chapter_06(meta_with(), required_correct, admit_correct, model=tiny_model)
    out = capsys.readouterr().out
    assert "served 48 requests" in out and "tokens equal" in out and "equal it" in out, out
    assert "pressure trace" in out and "DIFFER" not in out, out
    assert len(figs) == 2


def test_06_demo_waits_for_unfinished_exercises(capsys, tiny_model):
    def stub(*args):
        raise NotImplementedError()
    assert your_serving.chapter_06(build_metadata, stub, can_admit, model=tiny_model) == []
    assert capsys.readouterr().out.startswith("⏳")


def test_07_demo_preempts_with_the_learners_functions(capsys, tiny_model):
    your_serving.chapter_07(swap_correct, victim_newest, model=tiny_model)
    out = capsys.readouterr().out
    assert out.count("every token equals") == 2 and "recompute, your choose_victim" in out, out
    your_serving.chapter_07(swap_copy_twice, victim_newest, model=tiny_model)
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("❌"), "a double copy must not pass silently"
    your_serving.chapter_07(swap_correct, victim_oldest, model=tiny_model)
    assert "(library: 7" not in capsys.readouterr().out
