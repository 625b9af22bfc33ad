"""paged_lib.studies.block_size: waste, the memory sweep, the kernel's cost model against a traced
run, the engine against the simulator, and the block-size choice."""

import pytest
import torch

import paged_lib  # noqa: F401  # isort: split
from paged_lib.fragmentation import simulate
from paged_lib.model import TinyLlama, TinyLlamaConfig
from paged_lib.studies import block_size as bs
from paged_lib.workloads import Request, alpaca_like, sharegpt_like, shrink

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_internal_waste_counts_the_empty_slots_of_whole_blocks_over_all_slots():
    assert bs.internal_waste([5, 16], 8) == 3 / 24
    assert bs.internal_waste([16, 32], 16) == 0.0
    assert bs.internal_waste([1], 4096) == 4095 / 4096
    assert bs.internal_waste((3, 100), 1) == 0.0
    # over slots, not averaged per sequence: (15 + 0) / (16 + 1024), not (15/16 + 0) / 2
    assert bs.internal_waste([1, 1024], 16) == 15 / 1040


@pytest.mark.parametrize("args", [([], 16), ([4, 0], 16), ([4], 0), ([4], 2.0), ([True], 4)])
def test_internal_waste_refuses_bad_input(args):
    with pytest.raises(ValueError):
        bs.internal_waste(*args)


def test_choose_block_size_takes_the_largest_within_budget_or_the_least_wasteful():
    assert bs.choose_block_size([96, 192], [32, 48, 16, 64], 0.05) == 48
    assert bs.choose_block_size([3], [1, 2, 4], 0.25) == 4  # exactly at the budget fits
    assert bs.choose_block_size([3], [4, 2], 0.1) == 2  # none fits; a tie: the smaller
    assert bs.choose_block_size([20, 70], [1024, 256, 512], 0.05) == 256
    for bad in (([5], [], 0.1), ([5], [8], 1.0), ([5], [8], -0.1)):
        with pytest.raises(ValueError):
            bs.choose_block_size(*bad)


def test_prefix_reuse_keeps_only_full_blocks():
    assert [bs.prefix_reuse(1000, b) for b in (1, 16, 64, 256, 4096)] == [1000, 992, 960,
                                                                         768, 0]
    with pytest.raises(ValueError):
        bs.prefix_reuse(0, 16)


@pytest.fixture(scope="module")
def sweep():
    trace = sharegpt_like(60, seed=3)
    return trace, bs.memory_sweep(trace, 8192, (1, 16, 256, 2048))


def test_memory_sweep_matches_chapter_02s_simulator_and_counts_who_runs(sweep):
    trace, rows = sweep
    for row in rows:
        shares = simulate(trace, "paged", 8192, row.block_size)
        assert (row.token_states, row.reserved, row.internal, row.external) == tuple(shares)
        assert 1 <= row.mean_running <= row.peak_running <= len(trace)
    # a page of 2048 tokens in a pool of 8192: at most 4 requests at once
    assert rows[-1].peak_running <= 4 < rows[0].peak_running
    assert [r.steps for r in rows] == sorted(r.steps for r in rows)
    assert bs.best_range(rows) == (16, 16)
    with pytest.raises(ValueError):
        bs.best_range(rows, smallest_tile=4096)


def test_running_per_step_counts_every_run_once():
    from paged_lib.fragmentation import simulate_timeline

    trace = [Request(3, 4, 0.0), Request(2, 2, 0.0), Request(5, 1, 2.0)]
    tl = simulate_timeline(trace, "paged", 64, 4, record=True)
    assert bs.running_per_step(tl).tolist() == [2, 2, 2, 1]


@pytest.mark.parametrize("block_size", [1, 4, 12, 16, 64])
def test_the_cost_model_counts_what_the_interpreted_kernel_does(block_size):
    lens = [5, 33, 70]
    traced = bs.traced_decode_cost(lens, block_size)
    model = bs.decode_cost(lens, block_size, num_kv_heads=1, head_dim=16, itemsize=4,
                           tile_n=16)
    assert traced == model


def test_decode_cost_scales_with_kv_heads_and_block_size():
    one = bs.decode_cost([100, 7], 16, tile_n=32)
    assert one.iterations == 4 + 1 and one.table_entries == 7 + 1
    assert one.table_reads == 8 and one.kv_bytes == 2 * 107 * 128 * 2
    # blocks of 12 and tiles of 32 do not divide: a block straddling two tiles is read twice
    assert bs.decode_cost([48], 12).table_reads == 5 > bs.decode_cost([48], 12).table_entries
    # a tile of 32 tokens gathers from 8 blocks of 4, from 1 block of 32
    assert bs.decode_cost([32], 4).block_visits == 8 and bs.decode_cost([32], 32).block_visits == 1
    assert bs.decode_cost([100, 7], 16, num_kv_heads=8) == tuple(8 * v for v in one)


def test_gpu_decode_times_refuses_to_run_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError):
        bs.gpu_decode_times([16], [64])


def test_the_engine_agrees_with_the_simulator_at_every_step():
    torch.manual_seed(0)
    cfg = TinyLlamaConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                          head_dim=16, vocab_size=64, intermediate_size=64)
    model = TinyLlama(cfg).eval()
    trace = [r._replace(prompt_len=max(2, r.prompt_len), arrival=0.0)
             for r in shrink(alpaca_like(24, seed=1), 2)]
    got = bs.engine_vs_simulator(model, trace, 8, 24)
    assert got["preemptions"][0] > 0
    for key, (engine, sim) in got.items():
        assert engine == sim, key
    assert got["same_blocks_every_step"] == (True, True)


def test_the_pictures_draw_what_they_are_given(sweep):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from paged_lib.course.viz import block_size as viz

    fig = viz.sequence_blocks(37, (4, 16, 64))
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert labels == ["B=4: 10 blocks, 3 empty slots", "B=16: 3 blocks, 11 empty slots",
                      "B=64: 1 block, 27 empty slots"]
    with pytest.raises(ValueError):
        viz.sequence_blocks(0)
    trace, rows = sweep
    lens = [r.final_len for r in trace]
    costs = [bs.decode_cost(lens, r.block_size) for r in rows]
    fig = viz.three_curves({"sharegpt": rows}, {"sharegpt": costs},
                           {"sharegpt": sum(lens)}, {"sharegpt": bs.best_range(rows)})
    waste_line = fig.axes[0].lines[0]
    assert list(waste_line.get_ydata()) == [100 * (1 - r.token_states) for r in rows]
    reads = fig.axes[2].lines[0]
    assert list(reads.get_ydata()) == [c.table_reads / sum(lens) for c in costs]
    fig2 = viz.prefix_loss(600, (16, 256), (592, 512))
    assert [p.get_height() for p in fig2.axes[0].patches] == [100 * 8 / 600, 100 * 88 / 600]
    plt.close("all")
