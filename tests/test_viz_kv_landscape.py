"""Chapter 11's pictures draw what they are given."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from paged_lib.accounting import KiB  # noqa: E402
from paged_lib.course.viz import kv_landscape as viz  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _bars(ax):
    return [p for p in ax.patches if p.get_width() > 0]


def test_bytes_per_token_bars_pairs_mha_with_the_model_as_built():
    fig = viz.bytes_per_token_bars(["llama-2-7b", "llama-3-8b", "deepseek-v2"])
    assert isinstance(fig, Figure)
    heights = [p.get_height() * KiB for p in _bars(fig.axes[0])]
    # (same model as MHA, as built) per model
    assert heights == [524_288, 524_288, 524_288, 131_072, 3_932_160, 69_120]
    colors = [p.get_facecolor() for p in _bars(fig.axes[0])]
    assert colors[0] == colors[2] == colors[4] != colors[1]
    assert len({colors[1], colors[3], colors[5]}) == 3  # MHA, GQA, MLA
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "4x" in texts and "56.9x" in texts
    assert fig.axes[0].get_yscale() == "log"


def test_bytes_per_token_bars_use_the_given_function_and_dtype():
    fig = viz.bytes_per_token_bars(["llama-2-7b"], dtype="fp8", per_token=lambda s: 1024)
    assert [p.get_height() for p in _bars(fig.axes[0])] == [1, 1]
    fig = viz.bytes_per_token_bars(["llama-2-7b"], dtype="fp8")
    assert [p.get_height() for p in _bars(fig.axes[0])] == [256, 256]
    with pytest.raises(ValueError, match="no models"):
        viz.bytes_per_token_bars([])


def test_levels_bars_label_each_level_against_the_baseline():
    fig = viz.levels_bars({"a": 8 * 2**30, "b": 2 * 2**30, "c": 2**30})
    ax = fig.axes[0]
    assert [p.get_height() for p in _bars(ax)] == [8, 2, 1]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"]
    texts = [t.get_text() for t in ax.texts]
    assert texts == ["8 GiB", "2 GiB\n4x less", "1 GiB\n8x less"]
    with pytest.raises(ValueError, match="no levels"):
        viz.levels_bars({})


def test_block_grid_colours_states_and_counts_them():
    rows = {"seq 0": ["sink", "freed", "freed", "window", "window"], "seq 1": ["sink", "window"]}
    fig = viz.block_grid(rows, block_size=16)
    ax = fig.axes[0]
    boxes = [p for p in ax.patches if p.get_width() == 0.92]
    assert len(boxes) == 7
    sink = matplotlib.colors.to_rgba(viz.BLOCK_COLORS["sink"])
    assert sum(b.get_facecolor() == sink for b in boxes) == 2
    texts = [t.get_text() for t in ax.texts]
    assert "3 kept, 2 freed" in texts and "2 kept, 0 freed" in texts
    with pytest.raises(ValueError, match="unknown block state 'gone'"):
        viz.block_grid({"x": ["gone"]}, 16)


def test_memory_curves_and_claims_table():
    fig = viz.memory_curves({"a": ([0, 1, 2], [0, 1, 1]), "b": ([0, 1], [3, 4])})
    lines = fig.axes[0].get_lines()
    assert [list(line.get_ydata()) for line in lines] == [[0, 1, 1], [3, 4]]
    with pytest.raises(ValueError, match="2 x values but 1 y values"):
        viz.memory_curves({"a": ([0, 1], [0])})
    table = viz.claims_table([("pages of 4K | 16K", "16 tokens", "ch. 09")])
    assert table.splitlines()[2] == '| "pages of 4K \\| 16K" | 16 tokens | ch. 09 |'


def test_grouped_bars_one_colour_per_series():
    fig = viz.grouped_bars({"8 bits": {"K": 0.01, "V": 0.02}, "2 bits": {"K": 0.3, "V": 0.5}},
                           ylabel="error")
    ax = fig.axes[0]
    bars = _bars(ax)
    assert [round(p.get_height(), 2) for p in bars] == [0.01, 0.3, 0.02, 0.5]  # K, then V
    assert bars[0].get_facecolor() == bars[1].get_facecolor() != bars[2].get_facecolor()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["K", "V"]
    with pytest.raises(ValueError, match="has series"):
        viz.grouped_bars({"a": {"K": 1}, "b": {"V": 1}}, ylabel="x")


def test_window_block_states_follow_the_engine_window():
    # window 8, 2 sinks, blocks of 4: 13 tokens drop nothing yet; 14 drop tokens 2-5
    assert viz.window_block_states(13, 8, 2, 4) == ["sink", "window", "window", "window"]
    assert viz.window_block_states(14, 8, 2, 4) == ["sink", "window", "window", "window"]
    assert viz.window_block_states(18, 8, 2, 4) == ["sink", "freed", "window", "window",
                                                    "window"]
    assert viz.window_block_states(40, 8, 0, 4)[:6] == ["freed"] * 6
