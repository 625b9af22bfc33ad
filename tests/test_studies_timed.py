"""The studies chapters 06, 07, 09 and 12 measure or compute: systems timed
(batching_time), swap against recompute (preemption_time), the victim log (victims), the
vocabulary split and the MLA latent per rank (tp_layout), the CPU kernel per block size
(block_size.cpu_decode_times), and their pictures."""

import matplotlib
import pytest
import torch

import paged_lib  # noqa: F401  # isort: split
from paged_lib.accounting import DEEPSEEK_SPECS, SPECS, kv_bytes
from paged_lib.course.demos import engine_compare
from paged_lib.course.viz import timed as viz
from paged_lib.engine import LLMEngine, SamplingParams
from paged_lib.model import TinyLlama, TinyLlamaConfig
from paged_lib.studies import batching_time, preemption_time, swap_cost, tp_layout, victims
from paged_lib.studies import block_size as bs
from paged_lib.workloads import Request

matplotlib.use("Agg")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return TinyLlama(TinyLlamaConfig(num_layers=2, hidden_size=32, num_heads=2,
                                     num_kv_heads=1, head_dim=16, vocab_size=64,
                                     intermediate_size=64)).eval()


# ------------------------------------------------------------------ chapter 06


def test_serve_timed_gives_the_simulators_steps_and_the_same_tokens(tiny):
    trace = [Request(p, o, 0.0) for p, o in ((5, 30), (12, 8), (3, 20), (20, 15), (7, 25),
                                             (9, 4))]
    prompts, params = engine_compare.chapter_requests(trace)
    prompts = [[t % 64 for t in p] for p in prompts]
    runs = batching_time.serve_timed(tiny, prompts, params, num_blocks=24, block_size=4,
                                     max_len=40, backend="torch")
    assert list(runs) == list(batching_time.SYSTEMS)
    steps = engine_compare.policy_steps(trace, num_blocks=24, block_size=4, max_len=40)
    assert runs["static"].steps == steps["static-max"]
    assert runs["orca-max"].steps == steps["orca-max"]  # one slot of 40 per request either way
    total = sum(r.output_len for r in trace)
    for run in runs.values():
        assert run.generated_tokens == total
        assert run.tokens_per_s > 0 and run.tokens_per_step == total / run.steps
        assert run.stats.preemptions == 0 or run.system == "paged"
    assert runs["paged"].steps < runs["orca-max"].steps < runs["static"].steps


def test_make_engine_refuses_an_unknown_system(tiny):
    with pytest.raises(ValueError, match="system must be one of"):
        batching_time.make_engine("orca-max2", tiny, 8, 4, 32)


# ------------------------------------------------------------------ chapter 07


def test_preemption_times_counts_blocks_copies_and_bytes(tiny):
    rows = preemption_time.preemption_times(tiny, num_tokens=10, block_sizes=(1, 4, 16),
                                            repeats=1, recompute_repeats=1)
    per_token = 2 * tiny.config.num_layers * tiny.config.num_kv_heads * tiny.config.head_dim * 4
    for r, blocks in zip(rows, (10, 3, 1), strict=True):
        assert r.num_blocks == blocks
        assert r.num_copies == 2 * blocks * 2 * tiny.config.num_layers
        assert r.nbytes == 2 * blocks * r.block_size * per_token  # whole blocks, out and in
        assert r.swap_s > 0 and r.swap_per_block_s > 0 and r.recompute_s > 0


def test_preemption_times_refuses_a_swap_that_loses_blocks(tiny, monkeypatch):
    monkeypatch.setattr(preemption_time, "swap_blocks", lambda src, dst, pairs: None)
    with pytest.raises(RuntimeError, match="did not come back equal"):
        preemption_time.preemption_times(tiny, num_tokens=8, block_sizes=(4,), repeats=1,
                                         recompute_repeats=1)


def _row(b, swap, per_block, recompute):
    return preemption_time.PreemptionTiming(b, 64, 64 // b, 0, 0, swap, per_block, recompute)


def test_verdicts_read_the_papers_three_statements_off_the_rows():
    rows = [_row(1, 1.0, 40.0, 10.0), _row(16, 1.0, 4.0, 12.0), _row(256, 2.0, 2.0, 11.0)]
    v = preemption_time.verdicts(rows)
    assert v["per_block_small_over_large"] == 20.0
    assert v["engine_small_over_large"] == 0.5
    assert v["recompute_spread"] == 12.0 / 10.0
    assert v["recompute_over_swap_min"] == 5.5 and v["recompute_over_swap_max"] == 12.0
    with pytest.raises(ValueError):
        preemption_time.verdicts([])


def test_serve_times_checks_tokens_and_records_what_each_mode_did(tiny):
    prompts = [[1 + i, 2, 3, 4, 5, 6] for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = [[c.token_ids for c in LLMEngine(tiny, 32, 4).generate([p], params)[0].outputs]
             for p in prompts]
    rows = preemption_time.serve_times(tiny, prompts, params, alone, (4, 8), pool_tokens=32,
                                       repeats=1)
    assert [r.block_size for r in rows] == [4, 8] and [r.num_blocks for r in rows] == [8, 4]
    for r in rows:
        assert r.preemptions["swap"] > 0 and r.preemptions["recompute"] > 0
        assert r.swapped_blocks > 0 and r.recomputed_tokens > 0
        assert set(r.seconds) == {"swap", "recompute"}
    wrong = [[[0] * 12] for _ in prompts]
    with pytest.raises(RuntimeError, match="tokens differ"):
        preemption_time.serve_times(tiny, prompts, params, wrong, (4,), 32, repeats=1)


def test_record_victims_logs_every_choice_and_the_rule_holds(tiny):
    prompts = [[1 + i] * 6 for i in range(5)]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    outs, stats, choices = victims.record_victims(tiny, prompts, params, 8, 4)
    assert len(outs) == 5 and stats.preemptions == len(choices) > 0
    assert all(victims.follows_rule(c) for c in choices)
    assert any(len(c.offered) > 1 for c in choices)


def test_follows_rule_takes_the_latest_admission_and_the_later_on_a_tie():
    o = victims.Offered
    tie = (o(0, 0), o(1, 3), o(2, 3))
    assert victims.follows_rule(victims.VictimChoice(9, tie, 2))
    assert not victims.follows_rule(victims.VictimChoice(9, tie, 1))  # the earlier of a tie
    assert not victims.follows_rule(victims.VictimChoice(9, tie, 0))  # the oldest
    readmitted = (o(4, 2), o(1, 7))  # request 1 came back later: it is the latest admitted
    assert victims.follows_rule(victims.VictimChoice(9, readmitted, 1))
    assert not victims.follows_rule(victims.VictimChoice(9, readmitted, 4))


# ------------------------------------------------------------------ chapter 09


def test_cpu_decode_times_checks_and_times_every_block_size():
    rows = bs.cpu_decode_times((1, 4, 16), (20, 33), num_heads=4, num_kv_heads=2,
                               head_dim=16, backends=("torch",), repeats=1)
    assert [r["block_size"] for r in rows] == [1, 4, 16]
    assert all(r["torch"] > 0 for r in rows)


def test_smallest_efficient_is_the_smallest_block_within_tolerance_of_the_fastest():
    rows = [{"block_size": 1, "cpu": 30.0}, {"block_size": 2, "cpu": 11.5},
            {"block_size": 4, "cpu": 10.5}, {"block_size": 8, "cpu": 10.0},
            {"block_size": 16, "cpu": 14.0}]
    assert bs.smallest_efficient(rows, "cpu") == 4
    assert bs.smallest_efficient(rows, "cpu", tolerance=0.2) == 2
    assert bs.smallest_efficient(rows, "cpu", tolerance=0.0) == 8
    with pytest.raises(ValueError):
        bs.smallest_efficient(rows, "torch")


# ------------------------------------------------------------------ chapter 12


@pytest.mark.parametrize("vocab, tp, padded", [(264, 2, 320), (264, 3, 384), (32_000, 8, 32_000),
                                               (49_152, 8, 49_152), (100, 1, 128)])
def test_padded_vocab_pads_to_64_and_splits_evenly(vocab, tp, padded):
    assert tp_layout.padded_vocab(vocab, tp) == padded
    ranges = [tp_layout.vocab_range(vocab, tp, r) for r in range(tp)]
    assert ranges[0].start == 0 and ranges[-1].stop == padded
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:], strict=False))
    assert len({len(r) for r in ranges}) == 1


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_embedding_and_logits_equal_the_whole_matrices(tp):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(264, 8, generator=g)
    ids = torch.tensor([0, 1, 63, 64, 159, 160, 200, 263])
    shards = [tp_layout.shard_vocab(weight, tp, r) for r in range(tp)]
    summed, partials = tp_layout.vocab_parallel_embedding(ids, shards, 264)
    assert torch.equal(summed, weight[ids])
    for rank, part in enumerate(partials):  # each id's row comes from one rank only
        mine = torch.tensor([i in tp_layout.vocab_range(264, tp, rank) for i in ids.tolist()])
        assert torch.equal(part[mine], weight[ids][mine]) and not part[~mine].any()
    hidden = torch.randn(3, 8, generator=g)
    logits = tp_layout.vocab_parallel_logits(hidden, shards, 264)
    assert logits.shape == (3, 264)
    torch.testing.assert_close(logits, hidden @ weight.T)


def test_vocab_bytes_per_rank_split_and_replicated():
    assert tp_layout.vocab_bytes_per_rank(32_000, 8192, 2, 8) == 2 * 4000 * 8192 * 2
    assert tp_layout.vocab_bytes_per_rank(32_000, 8192, 2, 8, split=False) == 2 * 32_000 * 8192 * 2
    assert tp_layout.vocab_bytes_per_rank(264, 256, 4, 2, tied=True) == 160 * 256 * 4


def test_mla_latent_is_whole_on_every_rank_while_heads_shrink():
    v2, llama = DEEPSEEK_SPECS["deepseek-v2"], SPECS["llama-2-70b"]
    latent = kv_bytes(v2, 1)
    assert latent == 60 * (512 + 64) * 2
    assert [tp_layout.kv_bytes_per_rank(v2, t, 1) for t in (1, 8, 16)] == [latent] * 3
    assert [tp_layout.kv_bytes_per_rank(llama, t, 1) for t in (1, 8, 16)] == \
        [327_680, 40_960, 40_960]
    with pytest.raises(ValueError):
        tp_layout.kv_bytes_per_rank(v2, 3, 1)


def test_a_525_percent_increase_is_6_25_times():
    assert tp_layout.times_from_increase(525) == 6.25
    assert tp_layout.times_from_increase(0) == 1.0


# ------------------------------------------------------------------ pictures


def test_the_pictures_draw(tiny):
    trace = [Request(4, 6, 0.0), Request(6, 3, 0.0)]
    prompts, params = engine_compare.chapter_requests(trace)
    prompts = [[t % 64 for t in p] for p in prompts]
    runs = batching_time.serve_timed(tiny, prompts, params, 8, 4, 16, backend="torch")
    assert viz.plot_systems_timed(runs, "t").axes
    rows = [_row(1, 1e-3, 4e-2, 1e-2), _row(4, 1e-3, 1e-2, 1e-2)]
    link = swap_cost.Link(2e-6, swap_cost.PCIE4_X16_BYTES_PER_S)
    fig = viz.plot_preemption_times(rows, SPECS["opt-13b"], link, 5000.0, 1024, "assumed")
    assert len(fig.axes) == 2
    decode = [{"block_size": 1, "cpu": 3.0, "torch": 5.0}, {"block_size": 2, "cpu": 1.0,
                                                            "torch": 5.0}]
    assert viz.plot_decode_times(decode, {"cpu": 2}).axes


def test_fastest_ms_keeps_the_fastest_run():
    from paged_lib.studies.wall_clock import fastest_ms

    delays = iter([0.0, 0.03, 0.001, 0.02])  # the first call is the untimed warm-up

    def fn():
        import time
        time.sleep(next(delays))

    ms = fastest_ms(fn, 3)
    assert 1.0 <= ms < 15.0
    with pytest.raises(ValueError):
        fastest_ms(fn, 0)
