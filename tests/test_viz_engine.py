"""Chapters 06-07's measurements and pictures: the trace helpers, the static schedule,
the engine beside chapter 02's simulator, and every plot drawn from real engine stats.

The engine runs a tiny random model here: with ``ignore_eos=True`` the schedule (steps,
blocks, preemptions) depends only on the lengths, not on the weights.
"""

from __future__ import annotations

import matplotlib.colors
import pytest
import torch
from matplotlib.figure import Figure

import paged_lib  # noqa: F401  # isort: split
from paged_lib import accounting
from paged_lib.course.demos import engine_compare as ec
from paged_lib.course.viz import engine as viz
from paged_lib.engine import LLMEngine
from paged_lib.engine.static_batching import StaticBatchingEngine
from paged_lib.engine.trace import simulated_blocks
from paged_lib.model import TinyLlama, TinyLlamaConfig
from paged_lib.tokenizer import BOS_ID

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = TinyLlamaConfig(name="stand-in", num_layers=1, hidden_size=32, num_heads=2,
                          num_kv_heads=1, head_dim=16, vocab_size=264, intermediate_size=32,
                          max_position=256)
    return TinyLlama(cfg).eval()


@pytest.fixture(scope="module")
def trace():
    return ec.chapter_trace()


@pytest.fixture(scope="module")
def paged(model, trace):
    """The chapter's run: 48 requests, 120 blocks of 8, default watermark."""
    engine = LLMEngine(model, ec.NUM_BLOCKS, ec.BLOCK_SIZE)
    outs = engine.generate(*ec.chapter_requests(trace))
    return engine, outs


def test_chapter_requests_are_bos_plus_code_bytes_of_the_trace_lengths(trace):
    prompts, params = ec.chapter_requests(trace)
    assert [len(p) for p in prompts] == [r.prompt_len + 1 for r in trace]
    assert all(p[0] == BOS_ID and all(0 <= t < 256 for t in p[1:]) for p in prompts)
    assert max(len(p) + r.output_len for p, r in zip(prompts, trace, strict=True)) \
        <= ec.MAX_LEN
    assert [sp.max_tokens for sp in params] == [r.output_len for r in trace]
    assert all(sp.ignore_eos and sp.temperature == 0.0 for sp in params)
    assert len({tuple(p[1:6]) for p in prompts}) > 5  # not all the same slice
    text = ec.CODE_TEXT.encode()
    assert all(bytes(p[1:]) in text * 2 for p, r in zip(prompts, trace, strict=True)
               if r.prompt_len < len(text))  # a slice of the code, from a line start


def test_every_request_gets_exactly_its_output_length(paged, trace):
    _, outs = paged
    assert [len(o.outputs[0].token_ids) for o in outs] == [r.output_len for r in trace]


def test_the_paged_engine_needs_at_most_half_the_steps_of_static_batching(paged, trace):
    engine, _ = paged
    static = ec.static_stats(trace)
    assert static.steps >= 2 * engine.stats.steps
    assert static.peak_batch_size == ec.NUM_BLOCKS // (ec.MAX_LEN // ec.BLOCK_SIZE)
    assert static.generated_tokens == engine.stats.generated_tokens == \
        sum(r.output_len for r in trace)


def test_static_stats_equal_the_static_engine_step_for_step(model):
    """The simulator's schedule against the library's StaticBatchingEngine, which runs
    the model (a small trace: 3 batches of 2)."""
    small = ec.chapter_trace(6, seed=3, max_len=48)
    static = ec.static_stats(small, num_blocks=12, max_len=48)
    real = StaticBatchingEngine(model, 12, ec.BLOCK_SIZE, max_len=48)
    real.generate(*ec.chapter_requests(small))
    assert static.steps == real.stats.steps
    assert static.batch_sizes == real.stats.batch_sizes
    assert static.blocks_used == real.stats.blocks_used
    assert [r.admitted_steps for r in static.requests] == \
        [r.admitted_steps for r in real.stats.requests]
    assert [r.finished_step for r in static.requests] == \
        [r.finished_step for r in real.stats.requests]


def test_engine_equals_the_simulator_on_the_chapter_trace_without_watermark(model, trace):
    engine = LLMEngine(model, ec.NUM_BLOCKS, ec.BLOCK_SIZE, watermark=0.0)
    engine.generate(*ec.chapter_requests(trace))
    predicted, preemptions = simulated_blocks(ec.engine_requests(trace), ec.NUM_BLOCKS,
                                              ec.BLOCK_SIZE)
    assert engine.stats.blocks_used == predicted
    assert engine.stats.preemptions == preemptions > 0


def test_running_intervals_cover_every_generated_token(paged):
    engine, _ = paged
    ran = [0] * engine.stats.steps
    for tl in engine.stats.requests:
        for a, b in tl.running_intervals():
            for t in range(a, b):
                ran[t] += 1
    assert ran == engine.stats.batch_sizes  # one sequence per request here


def test_swap_bytes_per_block_equal_the_cpu_cache_tensors(model):
    engine = LLMEngine(model, 8, 4, num_cpu_blocks=3, preemption="swap")
    per_block = sum(k[0].nbytes + v[0].nbytes for k, v in engine.runner.cpu_kv_caches)
    assert ec.kv_bytes_per_block(model.config, 4) == per_block
    assert ec.kv_bytes_per_block(model.config, 4) == \
        4 * accounting.kv_bytes_per_token(model.config)


# ---------------------------------------------------------------- pictures


def test_flow_diagram_names_every_stage():
    fig = viz.draw_request_flow()
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert {name for name, _, _ in viz.FLOW} <= texts


def test_batching_plot_draws_each_system_s_stats(paged, trace):
    engine, _ = paged
    static = ec.static_stats(trace)
    fig = viz.plot_batching({"paged": engine.stats, "static": static})
    top, bottom = fig.axes
    assert [list(line.get_ydata()) for line in top.get_lines()] == \
        [engine.stats.batch_sizes, static.batch_sizes]
    assert list(bottom.get_lines()[1].get_ydata()) == static.blocks_used


def test_timeline_draws_one_bar_per_run_and_marks_preemptions(paged):
    engine, _ = paged
    fig = viz.plot_timeline(engine.stats)
    ax = fig.axes[0]
    run_bars = [p for p in ax.patches if p.get_facecolor()[:3] ==
                matplotlib.colors.to_rgb(viz.RUN_COLOR)]
    assert len(run_bars) == sum(len(t.running_intervals()) for t in engine.stats.requests)
    wait_bars = [p for p in ax.patches if p.get_facecolor()[:3] ==
                 matplotlib.colors.to_rgb(viz.WAIT_COLOR)]
    waits = sorted((b.get_y(), b.get_x(), b.get_x() + b.get_width()) for b in wait_bars)
    assert waits == sorted((row - 0.4, a, b) for row, t in enumerate(engine.stats.requests)
                           for a, b in t.waiting_intervals())
    assert engine.stats.preemptions > 0  # so some requests wait twice
    marks = [line for line in ax.get_lines()
             if line.get_color() == viz.PREEMPT_COLOR]
    assert len(marks) == engine.stats.preemptions


def test_engine_vs_simulator_and_tradeoff_plots():
    fig = viz.plot_engine_vs_simulator([1, 2, 3], [1, 2, 3], 4)
    assert isinstance(fig, Figure) and len(fig.axes[0].get_lines()) == 3
    rows = [{"block_size": 8, "swapped_bytes": 2048, "swapped_blocks": 2,
             "recomputed_tokens": 30},
            {"block_size": 16, "swapped_bytes": 8192, "swapped_blocks": 4,
             "recomputed_tokens": 10}]
    fig = viz.plot_preemption_tradeoff(rows)
    left, right = fig.axes
    assert [p.get_height() for p in left.patches] == [2.0, 8.0]
    assert [p.get_height() for p in right.patches] == [30, 10]


def test_policy_steps_are_chapter_02_s_simulator_on_the_engine_lengths(paged, trace):
    from paged_lib.fragmentation import simulate_timeline

    steps = ec.policy_steps(trace)
    assert tuple(steps) == ec.STEP_POLICIES
    reqs = ec.engine_requests(trace)
    assert steps["orca-oracle"] == simulate_timeline(
        reqs, "orca-oracle", ec.NUM_BLOCKS * ec.BLOCK_SIZE, ec.BLOCK_SIZE, ec.MAX_LEN).num_steps
    assert steps["static-max"] == ec.static_stats(trace).steps
    # more knowledge of the lengths, fewer steps; paging beats every reservation
    assert steps["static-max"] > steps["orca-max"] >= steps["orca-pow2"] \
        >= steps["orca-oracle"] > steps["paged"]
    assert abs(paged[0].stats.steps - steps["paged"]) <= 0.05 * steps["paged"]


def test_hidden_cost_counts_every_token_the_model_ran(paged, trace):
    engine, _ = paged
    cost = ec.hidden_cost(engine.stats, trace)
    reqs = ec.engine_requests(trace)
    assert cost["prompt_tokens"] == sum(r.prompt_len for r in reqs)
    assert cost["output_tokens"] == sum(r.output_len for r in trace)
    assert cost["recomputed_tokens"] == engine.stats.recomputed_tokens > 0
    assert cost["preemptions"] == engine.stats.preemptions
    # each sequence feeds its prompt and all outputs but the last, plus what is prefilled
    # again (the engine counts a readmitted request's newest token, never fed before, as
    # recomputed: up to one token per preemption)
    once = cost["prompt_tokens"] + cost["output_tokens"] - len(trace)
    assert once + cost["recomputed_tokens"] - cost["preemptions"] <= cost["computed_tokens"] \
        <= once + cost["recomputed_tokens"]
    assert 0 < cost["mean_blocks_used"] <= cost["peak_blocks_used"] <= ec.NUM_BLOCKS


def test_policy_steps_plot_labels_each_bar_with_its_ratio():
    steps = {"static-max": 100, "orca-max": 50, "paged": 25}
    fig = viz.plot_policy_steps(steps, 20, "t")
    assert isinstance(fig, Figure)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == [" 100 steps (5.0x)", " 50 steps (2.5x)", " 25 steps (1.2x)",
                     " 20 steps (1.0x)"]
