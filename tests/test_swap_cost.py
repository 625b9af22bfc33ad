"""The swap/recompute cost model (paged_lib.studies.swap_cost), the block-copy benchmark
(paged_lib.bench.swap) and chapter 07's picture of them."""

import math

import pytest
from matplotlib.figure import Figure

import paged_lib  # noqa: F401  (sets up the device before anything else)
from paged_lib.accounting import SPECS, ModelSpec, kv_bytes_per_token
from paged_lib.bench.swap import CopyTiming, block_copy_times, prefill_tokens_per_s
from paged_lib.studies import swap_cost
from paged_lib.util import CheckFailed

OPT = SPECS["opt-13b"]


def test_fit_recovers_overhead_and_bandwidth():
    link = swap_cost.Link(overhead_s=5e-6, bandwidth=2e9)
    copies = [8, 64, 256, 8, 64, 256]
    nbytes = [2048, 16384, 65536, 524288, 4194304, 16777216]
    seconds = [link.seconds(c, b) for c, b in zip(copies, nbytes, strict=True)]
    fit = swap_cost.fit_link(copies, nbytes, seconds)
    assert fit.overhead_s == pytest.approx(5e-6, rel=1e-6)
    assert fit.bandwidth == pytest.approx(2e9, rel=1e-6)


def test_fit_needs_two_measurements_and_a_positive_overhead():
    with pytest.raises(ValueError, match="at least two"):
        swap_cost.fit_link([8], [100], [1e-5])
    with pytest.raises(ValueError, match="not positive"):
        swap_cost.fit_link([8, 16], [1000, 2000], [-1e-6, -2e-6])


def test_swap_counts_whole_blocks_both_ways():
    link = swap_cost.Link(1e-5, 25e9)
    # 33 tokens at block 16: 3 whole blocks, each 2 x 40 copies, out and in
    one_way = 3 * 80 * 1e-5 + 3 * 16 * kv_bytes_per_token(OPT) / 25e9
    assert swap_cost.swap_seconds(33, 16, OPT, link) == pytest.approx(2 * one_way)
    assert swap_cost.swap_seconds(33, 16, OPT, link, both_ways=False) == pytest.approx(one_way)
    assert swap_cost.swap_seconds(33, 16, OPT, link, copies_per_blk=0) == pytest.approx(
        2 * 3 * 16 * kv_bytes_per_token(OPT) / 25e9)


def test_swap_falls_with_block_size_and_recompute_does_not():
    link = swap_cost.Link(1e-5, 25e9)
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]  # all divide 1024: no part-filled block
    swap = [swap_cost.swap_seconds(1024, b, OPT, link) for b in sizes]
    assert all(a > b for a, b in zip(swap, swap[1:], strict=False))
    rate = swap_cost.tokens_per_s_from_flops(OPT, 150e12)
    assert rate == pytest.approx(150e12 / (2 * OPT.num_params))
    assert swap_cost.recompute_seconds(1024, rate) == pytest.approx(1024 / rate)


def test_crossing_is_where_the_two_costs_meet():
    link = swap_cost.Link(1e-5, 25e9)
    rate = swap_cost.tokens_per_s_from_flops(OPT, 150e12)
    b = swap_cost.crossing_block_size(OPT, link, rate)
    assert 1 < b < 256
    # exactly equal per token at b (no part-filled block in the closed form)
    per_token_swap = 2 * (80 * link.overhead_s / b + kv_bytes_per_token(OPT) / link.bandwidth)
    assert per_token_swap == pytest.approx(1 / rate)
    below, above = math.floor(b), math.ceil(b)
    n = below * above * 64
    rec = swap_cost.recompute_seconds(n, rate)
    assert swap_cost.swap_seconds(n, below, OPT, link) > rec > swap_cost.swap_seconds(
        n, above, OPT, link)
    # recompute faster than the bytes alone: recompute wins everywhere
    assert swap_cost.crossing_block_size(OPT, link, 1e9) is None
    with pytest.raises(ValueError, match="num_params"):
        swap_cost.tokens_per_s_from_flops(ModelSpec("x", 1, 8, 1, 1, 8), 1e12)


@pytest.fixture(scope="module")
def copy_rows():
    return block_copy_times(num_layers=2, num_kv_heads=2, head_dim=8, block_sizes=(1, 4),
                            block_counts=(1, 3), repeats=1)


def test_block_copy_times_counts_copies_and_bytes(copy_rows):
    assert [(r.block_size, r.num_blocks) for r in copy_rows] == [(1, 1), (1, 3), (4, 1),
                                                                 (4, 3)]
    for r in copy_rows:
        assert r.num_copies == r.num_blocks * 2 * 2
        assert r.nbytes == 2 * 2 * r.num_blocks * r.block_size * 2 * 8 * 4
        assert r.separate_s > 0 and r.batched_s > 0


def test_block_copy_times_checks_before_timing(monkeypatch):
    import paged_lib.bench.swap as swap_bench

    timed = []

    def poisoned_pools(*args, **kw):  # a NaN copied is a wrong result: never timed
        src, dst = original(*args, **kw)
        src[-1][0, 0] = float("nan")
        return src, dst

    original = swap_bench._pools
    monkeypatch.setattr(swap_bench, "_pools", poisoned_pools)
    monkeypatch.setattr(swap_bench, "median_ms", lambda *a, **k: timed.append(1) or 1.0)
    with pytest.raises(CheckFailed, match="separate copies"):
        block_copy_times(1, 1, 4, block_sizes=(2,), block_counts=(2,), repeats=1)
    assert timed == []


def test_prefill_rate_is_positive():
    from paged_lib.studies.sharing import tiny_random_llama

    _, model = tiny_random_llama(seed=0)
    assert prefill_tokens_per_s(model, num_tokens=32, block_size=8, repeats=1) > 0


def test_plot_swap_cost_draws_both_panels(copy_rows):
    from paged_lib.course.viz import preemption as viz

    link = swap_cost.Link(1e-5, swap_cost.PCIE4_X16_BYTES_PER_S)
    settings = [viz.Setting("OPT-13B", OPT, link,
                            swap_cost.tokens_per_s_from_flops(OPT, 150e12), "assumed"),
                viz.Setting("fast", OPT, link, 1e9, "never crosses")]
    fig = viz.plot_swap_cost(copy_rows, settings, num_tokens=512, fitted=link)
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    right = fig.axes[1]
    assert len(right.get_lines()) == 5  # 2 x (swap, recompute) + one crossing dot
    swap, rec = viz.swap_recompute_curves(settings[0], 512, [1, 256])
    assert swap[0] > rec[0] > swap[1]
    assert isinstance(CopyTiming(1, 1, 2, 3, 0.1, 0.2).nbytes, int)
