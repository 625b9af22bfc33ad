"""vLLM v1's scheduling and prefix-caching behaviours, replayed on this engine.

Each test ports the *behaviour* one of vLLM's own core tests checks (named in its
docstring; ``tests/v1/core/`` in the vLLM repository), on this engine's API and sizes, with
the fake runner of ``tests/test_scheduler.py`` (token ids written in place of K/V and read
back through the block tables after every step, so a wrong slot, a missed copy or a block
given to two sequences shows) where no model is needed.
"""

import random

import pytest
from test_scheduler import FakeRunner, fake_samples, make_groups

from paged_lib.engine.block_manager import BlockManager
from paged_lib.engine.scheduler import Scheduler
from paged_lib.engine.sequence import SamplingParams, Sequence, SequenceGroup

BS = 4


def parts(num_blocks, *, num_cpu_blocks=0, caching=True, **kw):
    bm = BlockManager(num_blocks, BS, num_cpu_blocks, enable_prefix_caching=caching)
    return bm, Scheduler(bm, **kw), FakeRunner(num_blocks, BS, num_cpu_blocks)


def step(sched, runner, rng=None):
    out = sched.schedule()
    runner.execute(out)
    sched.update(out, [fake_samples(s, rng or random.Random(0)) for s in out.scheduled], None)
    return out


def serve(sched, runner, groups, arrivals=None, max_steps=5000):
    """Add each group at its arrival step and run to the end; returns every step's output."""
    arrivals = arrivals or [0] * len(groups)
    pending = sorted((t, i) for i, t in enumerate(arrivals))
    rng, history = random.Random(1), []
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= len(history):
            sched.add(groups[pending.pop(0)[1]])
        assert len(history) < max_steps, "no progress"
        if not sched.has_unfinished():
            history.append(None)
            continue
        out = sched.schedule()
        assert not out.is_empty(), "nothing scheduled while work remains"
        runner.execute(out)
        sched.update(out, [fake_samples(s, rng) for s in out.scheduled], None)
        history.append(out)
    return [h for h in history if h is not None]


def group(i, tokens, max_tokens=3, **params):
    return SequenceGroup(i, [Sequence(100 + i, list(tokens))],
                         SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))


def test_prefill_hits_blocks_scheduled_earlier_in_the_same_step():
    """test_prefix_caching.py::test_prefill: request 1, sharing request 0's first three
    full blocks, finds them as computed blocks although request 0 was only allocated
    (its K/V is written in the same step, before any attention reads it)."""
    bm, sched, runner = parts(32)
    common = list(range(3 * BS))
    r0, r1 = group(0, common + [90, 91]), group(1, common + [95])
    sched.add(r0)
    sched.add(r1)
    out = step(sched, runner)
    t0, t1 = r0.seqs[0].block_table.blocks, r1.seqs[0].block_table.blocks
    assert t1[:3] == t0[:3] and t1[3] != t0[3]
    assert out.prefix_cache_hit_tokens == 3 * BS
    assert [s.num_new_tokens for s in out.scheduled] == [14, 1]  # only its own token


def test_decode_fills_a_block_that_later_requests_hit():
    """test_prefix_caching.py::test_decode: a block filled by decoded tokens is cached
    once full (its hash covers prompt and output), and a later prompt with that text
    hits it."""
    bm, sched, runner = parts(32)
    r0 = group(0, range(BS + 2), max_tokens=4)
    serve(sched, runner, [r0])
    text = r0.seqs[0].token_ids
    r1 = group(1, text[:2 * BS] + [7])
    sched.add(r1)
    out = step(sched, runner)
    assert out.prefix_cache_hit_tokens == 2 * BS


def test_evicted_blocks_go_least_recently_freed_first_tail_of_a_table_first():
    """test_prefix_caching.py::test_evict: freed blocks keep their hash and go to the tail
    of the free queue, a table's last block first, so the longest prefixes stay longest;
    allocation takes the head and drops its hash."""
    bm, sched, runner = parts(8)
    r0 = group(0, range(3 * BS + 1), max_tokens=1)
    serve(sched, runner, [r0])
    queue = list(bm.gpu.free_block_queue)
    cached = [b for b in queue if b in bm.gpu.block_hash]
    assert cached == queue[-3:]
    assert queue[-3:] == [2, 1, 0]  # blocks 0, 1, 2 held the prefix: freed tail first
    for _ in range(len(queue) - 3):
        bm.gpu.allocate()
    assert bm.gpu.allocate() == 2 and 2 not in bm.gpu.block_hash  # evicted: hash gone


def test_a_hit_on_a_free_block_takes_it_out_of_the_free_queue():
    """test_prefix_caching.py::test_computed_blocks_not_evicted: a cached block that a new
    request hits is removed from the free queue, so allocating for that request (or
    anyone) cannot evict it."""
    bm, sched, runner = parts(6)
    serve(sched, runner, [group(0, range(2 * BS + 1), max_tokens=1)])
    r1 = group(1, list(range(2 * BS)) + [50, 51, 52, 53, 54, 55, 56, 57])
    sched.add(r1)
    step(sched, runner)
    hit = r1.seqs[0].block_table.blocks[:2]
    assert all(b not in bm.gpu.free_block_queue and bm.gpu.refcount(b) == 1 for b in hit)


def test_prefix_caching_off_shares_nothing():
    """test_prefix_caching.py::test_basic_prefix_caching_disabled."""
    bm, sched, runner = parts(32, caching=False)
    r0, r1 = group(0, range(3 * BS + 1)), group(1, range(3 * BS + 1))
    sched.add(r0)
    sched.add(r1)
    out = step(sched, runner)
    assert out.prefix_cache_hit_tokens == 0
    assert not set(r0.seqs[0].block_table.blocks) & set(r1.seqs[0].block_table.blocks)


def test_duplicated_blocks_both_stay_cached():
    """The prefix-caching design doc's "duplicated blocks" (and
    test_prefix_caching.py::test_cache_blocks): the same full block computed by two
    requests before either was cached (the last full block, which a prompt never takes
    from the cache) is cached twice, and the prefix survives evicting one copy."""
    bm, sched, runner = parts(16)
    text = list(range(2 * BS))
    r0, r1 = group(0, text), group(1, text)
    sched.add(r0)
    sched.add(r1)
    step(sched, runner)
    b0, b1 = r0.seqs[0].block_table.blocks[1], r1.seqs[0].block_table.blocks[1]
    assert b0 != b1 and bm.gpu.block_hash[b0] == bm.gpu.block_hash[b1]
    assert sorted(bm.gpu.cached_blocks[bm.gpu.block_hash[b0].value]) == sorted([b0, b1])


def test_schedule_partial_requests():
    """test_scheduler.py::test_schedule_partial_requests: three long prompts under one
    budget: the first whole, the second as much as is left (a chunk), the third waits;
    next step the chunk goes on, and the first decodes."""
    bm, sched, runner = parts(64, caching=False, max_num_seqs=4, max_num_batched_tokens=16,
                              enable_chunked_prefill=True)
    groups = [group(i, [i * 50 + t for t in range(12)], max_tokens=4) for i in range(3)]
    for g in groups:
        sched.add(g)
    out = step(sched, runner)
    assert [(s.group.request_id, s.num_new_tokens, s.sample) for s in out.scheduled] == [
        (0, 12, True), (1, 4, False)]
    assert len(groups[1].seqs[0].block_table.blocks) == 1  # only the chunk's block
    assert groups[2].seqs[0].block_table is None
    out = step(sched, runner)
    assert [(s.group.request_id, s.num_new_tokens) for s in out.scheduled] == [
        (0, 1), (1, 8), (2, 7)]


def test_a_chunked_prompt_starts_when_its_first_chunk_fits_and_is_preempted_between_chunks():
    """vLLM v1 allocates only the blocks of the tokens scheduled this step
    (KVCacheManager.allocate_slots): a prompt far longer than the free pool starts at
    once, and when a decode needs a block it is the latest admitted, the prompt part way
    through its chunks, that is preempted; everyone still finishes."""
    bm, sched, runner = parts(8, caching=False, max_num_seqs=4, max_num_batched_tokens=5,
                              enable_chunked_prefill=True)
    short = group(0, range(3), max_tokens=14)
    long = group(1, [50 + t for t in range(24)], max_tokens=2)
    history = serve(sched, runner, [short, long], arrivals=[0, 1])
    assert long.timeline.admitted_steps[0] == 1  # 24 tokens = 6 blocks > 5 free: started
    assert long.timeline.preempted_steps, "preempted part way through its chunks"
    chunks_before = [s.num_new_tokens for o in history[:long.timeline.preempted_steps[0]]
                     for s in o.scheduled if s.group is long]
    assert 0 < sum(chunks_before) < 24
    assert all(o.num_batched_tokens <= 5 for o in history)
    assert [len(g.seqs[0].output_token_ids) for g in (short, long)] == [14, 2]
    assert bm.num_free_blocks == 8


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_no_step_ever_computes_more_than_the_budget_under_random_loads(mode):
    """test_scheduler.py::test_schedule (every scheduled token counts against
    max_num_batched_tokens) as a property: random arrivals of greedy, ``n > 1`` and beam
    requests over shared prefixes, chunked prefill, prefix caching and a pool small
    enough to preempt (by ``mode``); no step over the budget or max_num_seqs, every block
    back at the end, every request its tokens."""
    rng = random.Random(11 if mode == "swap" else 12)
    seen = {"preempted": 0, "chunks": 0, "hits": 0, "swapped" if mode == "swap" else
            "recomputed": 0}
    for _ in range(25):
        budget = rng.randint(4, 12)
        max_seqs = rng.randint(3, budget)
        num_blocks = rng.randint(7, 14)
        specs = []
        for _ in range(rng.randint(2, 7)):
            p, m = rng.randint(1, 20), rng.randint(1, 8)
            n = rng.choice([1, 1, 2, 3]) if max_seqs >= 3 else 1
            if n * (-(-(p + m) // BS)) + 1 > num_blocks:
                continue
            specs.append((p, m, n, "beam") if n > 1 and rng.random() < 0.3 else (p, m, n))
        groups = make_groups(specs)
        arrivals = sorted(rng.randint(0, 10) for _ in groups)
        bm, sched, runner = parts(num_blocks, num_cpu_blocks=64 if mode == "swap" else 0,
                                  preemption=mode, max_num_batched_tokens=budget,
                                  max_num_seqs=max_seqs, enable_chunked_prefill=True)
        history = serve(sched, runner, groups, arrivals)
        for out in history:
            assert out.num_batched_tokens <= budget, (out.step, budget)
            assert len(out.scheduled) <= max_seqs
        for g, spec in zip(groups, specs, strict=True):
            if len(spec) == 4:
                assert g.beam_done
            else:
                assert all(len(s.output_token_ids) == spec[1] for s in g.seqs)
        assert bm.num_free_blocks == num_blocks
        assert sorted(bm.gpu.free_block_queue) == list(range(num_blocks))
        seen["preempted"] += sum(len(o.preempted) for o in history)
        seen["chunks"] += sum(s.is_prefill and not s.sample for o in history
                              for s in o.scheduled)
        seen["hits"] += sum(o.prefix_cache_hit_tokens for o in history)
        if mode == "swap":
            seen["swapped"] += sum(len(o.swap_out) for o in history)
        else:
            seen["recomputed"] += sum(o.recomputed_tokens for o in history)
    assert all(seen.values()), seen  # every feature was met


def test_a_step_that_only_preempts_is_not_an_error_and_the_victims_run_next():
    """A step may schedule nothing but preemptions (admission waits for the next step
    after a preemption, as vLLM v1's does): the engine records it as an idle step, does
    its swaps, and the victims come back with the tokens they would have made."""
    from paged_lib.engine import LLMEngine
    from paged_lib.engine import SamplingParams as P
    from paged_lib.engine.scheduler_output import SchedulerOutput
    from paged_lib.model import load_tiny_code_llama

    model = load_tiny_code_llama()
    prompts = [[256, 1, 2, 3, 4, 5], [256, 7, 8, 9, 10, 11]]
    params = P(max_tokens=8, ignore_eos=True, temperature=0.0)
    for mode in ("recompute", "swap"):
        engine = LLMEngine(model, 16, 4, preemption=mode, num_cpu_blocks=16, watermark=0,
                           attention_backend="torch")
        sched, schedule = engine.scheduler, engine.scheduler.schedule

        def preempt_everyone_at_step_3(sched=sched, schedule=schedule):
            if sched.step != 3:
                return schedule()
            out = SchedulerOutput(step=sched.step)
            for group in list(sched.running)[::-1]:
                sched._preempt(group, out)
            return out

        sched.schedule = preempt_everyone_at_step_3
        outs = engine.generate(prompts, params)
        assert engine.stats.step_kinds[3] == "idle" and engine.stats.preemptions == 2
        alone = LLMEngine(model, 64, 4, attention_backend="torch").generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
        assert engine.block_manager.num_free_blocks == 16, mode


def test_priority_scheduling_order_and_preemption():
    """test_scheduler.py::test_priority_scheduling_basic_ordering and
    ::test_priority_scheduling_preemption: with ``policy="priority"`` waiting requests
    are admitted lowest value first (ties: first come), and the victim of a full pool is
    the request of lowest priority, where FCFS takes the latest admitted."""
    for policy, admitted, victim in (("fcfs", [0, 1], 1), ("priority", [1, 0], 0)):
        bm, sched, runner = parts(2, caching=False, policy=policy)
        low, high = group(0, [1, 2, 3, 4], max_tokens=4), group(1, [5, 6, 7, 8], max_tokens=4)
        low.priority, high.priority = 5, 0
        sched.add(low)
        sched.add(high)
        out = step(sched, runner)
        assert [g.request_id for g in out.admitted] == admitted, policy
        out = step(sched, runner)  # each needs a second block; the pool has none
        assert [g.request_id for g in out.preempted] == [victim], policy
    bm, sched, runner = parts(64, caching=False, policy="priority", max_num_seqs=2)
    groups = [group(i, [i + 1] * 5) for i in range(5)]
    for g, p in zip(groups, [3, 1, 3, 0, 1], strict=True):
        g.priority = p
        sched.add(g)
    out = step(sched, runner)
    assert [g.request_id for g in out.admitted] == [3, 1]  # 0 first, then 1 (first come)
    assert [g.request_id for g in sched.waiting] == [4, 0, 2]


def test_priority_needs_the_priority_policy_and_orders_the_engines_requests(tiny_model):
    """vLLM's processor: "Got priority 1 but Priority scheduling is not enabled."; with
    ``scheduling_policy="priority"`` one sequence at a time serves the requests in order
    of priority."""
    from paged_lib.engine import LLMEngine
    from paged_lib.engine import SamplingParams as P

    prompts, params = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], P(max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match="request 1: Got priority 1 but Priority scheduling "
                                         "is not enabled."):
        LLMEngine(tiny_model, 32, 4).generate(prompts, params, priority=[0, 1, 0])
    engine = LLMEngine(tiny_model, 32, 4, max_num_seqs=1, scheduling_policy="priority")
    engine.generate(prompts, params, priority=[2, 0, 1])
    finished = [r.finished_step for r in engine.stats.requests]
    assert finished[1] < finished[2] < finished[0]


# ------------------------------------------------- stop strings (tests/detokenizer/ in vLLM)

def check_stop_strings(output_text, new_char_count, stop, include_in_output):
    """vLLM's ``check_stop_strings(output_text, new_char_count, stop, include_in_output)``
    asked of this library's detokenizer: the text before the last ``new_char_count``
    characters is added first (none of these tests' stops is in it), then the new
    characters in one ``add``, as one step of several tokens. Returns vLLM's answer,
    ``(stop string, length to cut the text to, or -1)`` or None."""
    from paged_lib.engine.detokenize import IncrementalDetokenizer
    from paged_lib.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    old = output_text[:len(output_text) - new_char_count]
    det = IncrementalDetokenizer(tok.decode, stop, min_tokens=len(old))  # old: not searched
    det.add(tok.encode(old, add_bos=False))
    det.add(tok.encode(output_text[len(old):], add_bos=False))
    if det.stopped is None:
        return None
    if not include_in_output:
        return det.stopped, len(det.text)
    end = len(det.text) + len(det.stopped)
    return det.stopped, -1 if end >= len(output_text) else end


@pytest.mark.parametrize("stop", [["a", "is"], ["is", "a"]])
def test_earliest_completing_stop_wins_regardless_of_list_order(stop):
    """test_check_stop_strings.py::test_earliest_completing_stop_wins_regardless_of_list_order
    (and ::test_earliest_completing_stop_include_in_output): " is a" came in one step;
    "is" completes before "a", whatever the list's order."""
    assert check_stop_strings(" The user is a", len(" is a"), stop, False) == ("is", 10)
    assert check_stop_strings(" The user is a", len(" is a"), stop, True) == ("is", 12)


def test_completion_position_not_start_position():
    """test_check_stop_strings.py::test_completion_position_not_start_position: "b" starts
    after "abc" but completes first, so it wins."""
    assert check_stop_strings("abc", 3, ["abc", "b"], False) == ("b", 1)


@pytest.mark.parametrize("stop, expected", [(["ab", "b"], ("ab", 0)), (["b", "ab"], ("b", 1))])
def test_ties_broken_by_list_order(stop, expected):
    """test_check_stop_strings.py::test_ties_broken_by_list_order: both complete at the same
    character; the first listed wins."""
    assert check_stop_strings("ab", 2, stop, False) == expected


def test_single_stop_in_window_unchanged():
    """test_check_stop_strings.py::test_single_stop_in_window_unchanged."""
    assert check_stop_strings("hello world.", 1, ["."], False) == (".", 11)
    assert check_stop_strings("hello world.", 1, ["."], True) == (".", -1)


def test_no_match_and_empty_inputs_return_none():
    """test_check_stop_strings.py::test_no_match_and_empty_inputs_return_none (no new
    characters: an add that completes no character searches nothing)."""
    assert check_stop_strings("hello", 5, ["zzz"], False) is None
    assert check_stop_strings("hello", 5, [], False) is None
    from paged_lib.engine.detokenize import IncrementalDetokenizer
    from paged_lib.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    det = IncrementalDetokenizer(tok.decode, ["h"], min_tokens=5)
    det.add(tok.encode("hello", add_bos=False))
    assert det.add([0xC3]) == "" and det.stopped is None  # half of é: no new character


def test_the_engines_text_ends_at_the_stop_that_completes_first():
    """test_ties_broken_by_list_order through ``LLM.generate``: two stops completed by the
    same token (the tiny model's tokens are bytes); the first listed wins and the text ends
    before it, in either order (the stop that starts first does not win by starting)."""
    from paged_lib.data import TINY_CODE_LLAMA_DIR
    from paged_lib.engine import LLM
    from paged_lib.engine import SamplingParams as P

    llm = LLM(TINY_CODE_LLAMA_DIR, num_blocks=64, device="cpu")
    greedy = P(max_tokens=16, temperature=0.0)
    text = llm.generate(["def "], greedy)[0].outputs[0].text
    at = next(i for i in range(2, len(text)) if text[i] not in text[:i])
    long, short = text[at - 2:at + 1], text[at]  # both complete with character `at`
    for stop, cut in (([long, short], at - 2), ([short, long], at)):
        params = P(max_tokens=16, temperature=0.0, stop=stop)
        out = llm.generate(["def "], params)[0].outputs[0]
        assert out.stop_reason == stop[0] and out.text == text[:cut], (text, stop, out)
