"""The scheduler without a model: a fake runner writes token ids instead of K/V.

The fake cache holds, in every slot, the token that was written there. After each step
every running sequence reads its tokens back through its block table: a wrong slot, a
missed copy-on-write or swap, or a block given to two sequences shows up as a wrong
token. Sampling is replaced by a deterministic function of (sequence, position).
"""

import random

import numpy as np
import pytest

from paged_lib.engine.block_manager import BlockManager, num_required_blocks
from paged_lib.engine.hooks import EngineHooks
from paged_lib.engine.model_runner import build_metadata
from paged_lib.engine.sampler import num_samples
from paged_lib.engine.scheduler import Budget, Scheduler, can_admit, choose_victim
from paged_lib.engine.sequence import SamplingParams, Sequence, SequenceGroup


class FakeRunner:
    """Token ids in place of K/V, copied and swapped like the real caches."""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int):
        self.bs = block_size
        self.gpu = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.cpu = np.full((max(num_cpu_blocks, 1), block_size), -1, dtype=np.int64)

    def execute(self, out) -> None:
        for g, c in out.swap_out:
            self.cpu[c] = self.gpu[g]
        for c, g in out.swap_in:
            self.gpu[g] = self.cpu[c]
        for src, dst in out.blocks_to_copy:
            self.gpu[dst] = self.gpu[src]
        # a sequence holds num_cached + num_new_tokens tokens after the step (all its text,
        # but only the prompt in the first step of a shared recompute)
        ends = [s.seq.num_cached + s.num_new_tokens for s in out.scheduled]
        meta = build_metadata([s.seq.block_table.blocks for s in out.scheduled], ends,
                              [s.num_new_tokens for s in out.scheduled], self.bs)
        new = [t for s, end in zip(out.scheduled, ends, strict=True)
               for t in s.seq.token_ids[end - s.num_new_tokens:end]]
        self.gpu.reshape(-1)[meta.slot_mapping.numpy()] = new
        for s, end in zip(out.scheduled, ends, strict=True):  # read back, through the table
            pos = np.arange(end)
            blocks = np.array(s.seq.block_table.blocks)[pos // self.bs]
            assert self.gpu[blocks, pos % self.bs].tolist() == s.seq.token_ids[:end], s.seq.seq_id


def fake_token(seq: Sequence, k: int = 0) -> int:
    return 1000 * (seq.seq_id + 1) + 10 * seq.num_tokens + k


def fake_samples(sched, rng: random.Random) -> list[tuple[int, float]]:
    """One token (n for an n > 1 prefill); a beam's width candidates with random scores."""
    width = sched.group.params.beam_width
    if width is not None:
        return sorted(((fake_token(sched.seq, k), -rng.random()) for k in range(width)),
                      key=lambda c: -c[1])
    return [(fake_token(sched.seq, k), -0.5) for k in range(num_samples(sched))]


def run(scheduler: Scheduler, runner: FakeRunner, groups, max_steps=10_000):
    for g in groups:
        scheduler.add(g)
    history = []
    rng = random.Random(0)
    while scheduler.has_unfinished():
        assert len(history) < max_steps, "no progress"
        out = scheduler.schedule()
        assert not out.is_empty(), "nothing scheduled while work remains"
        runner.execute(out)
        samples = [fake_samples(s, rng) for s in out.scheduled]
        history.append(out)
        scheduler.update(out, samples, eos_token_id=None)
    return history


def make_groups(specs, seed=0):
    """``specs``: (prompt_len, max_tokens[, n[, "beam"]]) per request."""
    groups = []
    for i, spec in enumerate(specs):
        p, m, *rest = spec
        n = rest[0] if rest else 1
        if rest[1:] == ["beam"]:
            params = SamplingParams(max_tokens=m, beam_width=n)
        else:
            params = SamplingParams(max_tokens=m, temperature=1.0 if n > 1 else 0.0, n=n,
                                    ignore_eos=True)
        groups.append(SequenceGroup(i, [Sequence(100 + i, list(range(p)))], params))
    return groups


def engine_parts(num_blocks, block_size=4, num_cpu_blocks=0, **kw):
    bm = BlockManager(num_blocks, block_size, num_cpu_blocks)
    return bm, Scheduler(bm, **kw), FakeRunner(num_blocks, block_size, num_cpu_blocks)


def test_can_admit_counts_blocks_watermark_seqs_and_tokens():
    b = Budget(free_blocks=10, watermark_blocks=1, num_seqs=3, max_num_seqs=4,
               num_batched_tokens=90, max_num_batched_tokens=100)
    assert can_admit(9, 1, 10, b)
    assert not can_admit(10, 1, 10, b)        # would eat the watermark
    assert not can_admit(2, 2, 10, b)         # fifth sequence
    assert not can_admit(2, 1, 11, b)         # 101 tokens


def test_fcfs_admission_and_every_request_finishes():
    bm, sched, runner = engine_parts(64)
    groups = make_groups([(5, 3), (9, 6), (2, 1)])
    history = run(sched, runner, groups)
    assert [len(g.seqs[0].output_token_ids) for g in groups] == [3, 6, 1]
    assert history[0].kind == "prefill" and len(history) == 6
    assert [g.timeline.finished_step for g in groups] == [2, 5, 0]
    assert bm.num_free_blocks == 64


def test_max_num_seqs_and_batched_tokens_hold_back_admission():
    bm, sched, runner = engine_parts(64, max_num_seqs=2, max_num_batched_tokens=12)
    groups = make_groups([(5, 4), (5, 4), (2, 4)])
    history = run(sched, runner, groups)
    assert all(len(o.scheduled) <= 2 for o in history)
    assert all(o.num_batched_tokens <= 12 for o in history)
    assert groups[1].timeline.admitted_steps == [0]
    assert groups[2].timeline.admitted_steps == [4]  # a batch slot frees after step 3


def test_a_prompt_longer_than_the_token_budget_runs_in_chunks_within_it():
    """vLLM v1 (its test_scheduler's chunked-prefill cases): every scheduled token,
    decode or prefill, counts against max_num_batched_tokens; a long prompt is computed
    in budget-sized chunks and samples only at its last."""
    bm, sched, runner = engine_parts(64, max_num_seqs=8, max_num_batched_tokens=8,
                                     enable_chunked_prefill=True)
    groups = make_groups([(20, 2), (3, 2)])
    history = run(sched, runner, groups)
    assert [o.num_batched_tokens for o in history[:3]] == [8, 8, 7]  # 4 + the next 3
    assert all(o.num_batched_tokens <= 8 for o in history)
    assert all(len(g.seqs[0].output_token_ids) == 2 for g in groups)


def test_a_budget_below_max_num_seqs_is_refused():
    """vLLM's SchedulerConfig: max_num_batched_tokens >= max_num_seqs, since every
    running sequence decodes one token a step."""
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= "
                                         r"max_num_seqs \(256\)"):
        engine_parts(64, max_num_batched_tokens=8)


def test_watermark_keeps_blocks_free_at_admission():
    bm, sched, runner = engine_parts(10, watermark_blocks=2)
    groups = make_groups([(16, 1), (20, 1)])  # 4 blocks, then 5: 4 + 5 > 10 - 2
    run(sched, runner, groups)
    assert groups[1].timeline.admitted_steps == [1]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_takes_the_newest_group_whole(mode):
    bm, sched, runner = engine_parts(8, num_cpu_blocks=16 if mode == "swap" else 0,
                                     preemption=mode)
    # three requests of 4 prompt tokens: 3 blocks after step 0; each needs a 2nd block
    # at its 2nd decode (positions 4), a 3rd at position 8
    groups = make_groups([(4, 8), (4, 8), (4, 8, 2)])
    history = run(sched, runner, groups)
    first = next(o for o in history if o.preempted)
    assert first.preempted == [groups[2]]  # the newest goes first, both samples with it
    assert all(len(s.output_token_ids) == 8 for g in groups for s in g.seqs)
    assert groups[2].timeline.preempted_steps
    if mode == "swap":
        assert first.swap_out and any(o.swap_in for o in history)
        assert bm.cpu.num_free == 16
    else:
        # recompute: the victim prefills its prompt once (nothing sampled), then each
        # sample forks it and prefills the tokens it had made
        readmit = next(o for o in history if groups[2] in o.admitted and o.step > 0)
        prompt = [s for s in readmit.scheduled if s.group is groups[2]]
        assert [(s.num_new_tokens, s.sample) for s in prompt] == [(4, False)]
        assert readmit.recomputed_tokens == 4
        tails = [s for s in history[readmit.step + 1].scheduled if s.group is groups[2]]
        assert len(tails) == 2 and all(s.is_prefill and s.sample for s in tails)
        made = groups[2].timeline.preempted_steps[0] - groups[2].timeline.admitted_steps[0]
        assert [s.num_new_tokens for s in tails] == [made, made]  # its outputs so far
        assert history[readmit.step + 1].recomputed_tokens == sum(s.num_new_tokens for s in tails)
    assert bm.num_free_blocks == 8


def test_swapped_groups_return_before_new_admissions():
    bm, sched, runner = engine_parts(6, num_cpu_blocks=16, preemption="swap", max_num_seqs=2)
    groups = make_groups([(4, 12), (4, 12), (1, 2)])
    history = run(sched, runner, groups)
    swap_out = next(o.step for o in history if o.swap_out)
    swap_in = next(o.step for o in history if o.swap_in)
    # request 2 waited for a batch seat, got one when request 1 was swapped out, but
    # is admitted only once request 1 is back
    assert swap_out < groups[0].timeline.finished_step <= swap_in
    assert groups[2].timeline.admitted_steps == [swap_in]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_workloads_never_cross_write_or_leak(mode):
    """Property test: random mixes of lengths, n > 1 forks, beams (forks and frees every
    step) and tiny pools, both modes."""
    rng = random.Random(1 if mode == "swap" else 2)
    beams = 0
    for trial in range(12):
        num_blocks = rng.randint(8, 20)
        specs = []
        for _ in range(rng.randint(1, 7)):
            n = rng.choice([1, 1, 2, 3])
            p, m = rng.randint(1, 10), rng.randint(1, 8)
            if n * (-(-(p + m) // 4)) <= num_blocks:
                specs.append((p, m, n, "beam") if rng.random() < 0.3 else (p, m, n))
        if not specs:
            continue
        bm, sched, runner = engine_parts(num_blocks, num_cpu_blocks=64 if mode == "swap"
                                         else 0, preemption=mode,
                                         max_num_seqs=rng.randint(2, 8))
        groups = make_groups(specs)
        run(sched, runner, groups)
        beams += sum(len(s) == 4 for s in specs)
        for g, (_p, m, n, *beam) in zip(groups, specs, strict=True):
            done = g.beam_done if beam else [(s.output_token_ids, 0) for s in g.seqs]
            assert len(done) == n and all(len(t) == m for t, _ in done)
        assert bm.num_free_blocks == num_blocks, f"trial {trial}: leaked blocks"
        if bm.cpu is not None:
            assert bm.cpu.num_free == 64
    assert beams > 0


def test_request_timelines_give_running_and_waiting_intervals():
    bm, sched, runner = engine_parts(8)
    groups = make_groups([(4, 8), (4, 8), (4, 8, 2)])
    run(sched, runner, groups)
    for g in groups:
        t = g.timeline
        runs, waits = t.running_intervals(), t.waiting_intervals()
        ran = sum(b - a for a, b in runs)
        # a preempted run's steps are redone, so it ran at least max_tokens steps
        assert ran >= 8 and runs[-1][1] == t.finished_step + 1
        assert all(a < b for a, b in runs + waits)
        steps = sorted(s for a, b in runs + waits for s in range(a, b))
        assert steps == list(range(t.arrival_step, t.finished_step + 1))  # no gap, no overlap
    assert groups[2].timeline.preempted_steps  # the case with a wait in the middle


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prefill_first_never_mixes_prefills_and_decodes(mode):
    """Random workloads (forks, beams, shared recomputes, swaps): every step is all
    prefills or all decodes, everyone finishes, nothing leaks."""
    rng = random.Random(5)
    kinds = set()
    for _ in range(10):
        num_blocks = rng.randint(8, 20)
        specs = [s for s in ((rng.randint(1, 10), rng.randint(1, 8), rng.choice([1, 1, 2, 3]))
                             for _ in range(rng.randint(2, 7)))
                 if s[2] * (-(-(s[0] + s[1]) // 4)) <= num_blocks]
        specs = [(p, m, n, "beam") if rng.random() < 0.3 else (p, m, n) for p, m, n in specs]
        bm, sched, runner = engine_parts(num_blocks, num_cpu_blocks=64 if mode == "swap" else 0,
                                         preemption=mode, scheduling="prefill_first")
        groups = make_groups(specs)
        history = run(sched, runner, groups)
        for out in history:
            assert out.kind in ("prefill", "decode"), f"step {out.step} mixes"
            assert not (out.swap_in and out.kind == "prefill")  # swap-ins come with decodes
            kinds.add(out.kind)
        assert all(g.is_finished() for g in groups)
        assert bm.num_free_blocks == num_blocks
    assert kinds == {"prefill", "decode"}


def test_prefill_first_admits_before_decoding_and_mixed_batches_both():
    specs = [(5, 4), (6, 4)]
    for scheduling, want in (("mixed", ["prefill", "mixed", "decode", "decode", "decode"]),
                             ("prefill_first", ["prefill", "prefill"] + ["decode"] * 3)):
        bm, sched, runner = engine_parts(64, scheduling=scheduling)
        groups = make_groups(specs)
        sched.add(groups[0])
        out = sched.schedule()
        runner.execute(out)
        sched.update(out, [fake_samples(s, random.Random(0)) for s in out.scheduled], None)
        history = [out] + run(sched, runner, groups[1:])  # request 1 arrives at step 1
        assert [o.kind for o in history] == want, scheduling


def test_an_unknown_scheduling_mode_is_refused():
    with pytest.raises(ValueError, match="scheduling must be one of"):
        Scheduler(BlockManager(8, 4), scheduling="orca")


def test_choose_victim_is_asked_and_its_choice_is_preempted():
    offered = []

    def oldest(running):
        offered.append([g.request_id for g in running])
        return running[0]  # the group that needs the blocks gives way itself

    bm = BlockManager(8, 4)
    sched = Scheduler(bm, hooks=EngineHooks(choose_victim=oldest))
    groups = make_groups([(4, 8), (4, 8), (4, 8, 2)])
    history = run(sched, FakeRunner(8, 4, 0), groups)
    first = next(o for o in history if o.preempted)
    assert offered and offered[0] == sorted(offered[0])  # oldest first
    assert first.preempted[0].request_id == offered[0][0]
    assert all(len(s.output_token_ids) == 8 for g in groups for s in g.seqs)
    assert bm.num_free_blocks == 8


def test_the_default_victim_is_the_most_recently_admitted():
    groups = make_groups([(1, 1), (1, 1), (1, 1)])
    assert choose_victim(groups) is groups[-1] and choose_victim(groups[:1]) is groups[0]


def test_a_victim_that_is_not_offered_is_a_clear_error():
    outsider = make_groups([(1, 1)])[0]
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, hooks=EngineHooks(choose_victim=lambda running: outsider))
    with pytest.raises(ValueError, match=r"choose_victim returned 0, which is not one of"):
        run(sched, FakeRunner(8, 4, 0), make_groups([(4, 8), (4, 8), (4, 8, 2)]))


def test_num_required_blocks_is_asked_for_every_waiting_group():
    asked = []

    def mine(group, block_size):
        asked.append((group.request_id, len(group.live_seqs()), block_size))
        return num_required_blocks(group, block_size)

    bm = BlockManager(8, 4)
    sched = Scheduler(bm, hooks=EngineHooks(num_required_blocks=mine))
    run(sched, FakeRunner(8, 4, 0), make_groups([(4, 8), (4, 8), (4, 8, 2)]))
    assert {r for r, _, _ in asked} == {0, 1, 2} and all(b == 4 for _, _, b in asked)
    assert (2, 2, 4) in asked  # the 2-sample group, asked again after its preemption


@pytest.mark.parametrize("wrong, match", [
    (lambda group, block_size: 1.5, "expected an int >= 0"),
    (lambda group, block_size: -1, "expected an int >= 0"),
    (lambda group, block_size: 0, "count every block"),  # says 0, takes 5: too few free
])
def test_a_wrong_num_required_blocks_gets_a_clear_error(wrong, match):
    sched = Scheduler(BlockManager(8, 4), hooks=EngineHooks(num_required_blocks=wrong))
    with pytest.raises(ValueError, match=match):
        run(sched, FakeRunner(8, 4, 0), make_groups([(20, 2), (20, 2)]))
