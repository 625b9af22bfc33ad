"""Sharing read off the engine (:mod:`paged_lib.studies.sharing_engine`): parallel samples
and beams in one batch, each request's blocks step by step, and the batch's savings."""

from __future__ import annotations

import pytest

from paged_lib.engine import LLMEngine, SamplingParams
from paged_lib.studies import sharing
from paged_lib.studies.sharing_engine import engine_beam_usage, engine_savings, engine_usage
from paged_lib.util import cdiv

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return sharing.tiny_random_llama(seed=0)[1]


@pytest.mark.parametrize("prompt_len, copies", [(21, 2), (20, 0)])
def test_samples_hold_the_blocks_the_engine_counts(model, prompt_len, copies):
    prompt, n, bs = list(range(1, prompt_len + 1)), 3, 4
    params = SamplingParams(n=n, max_tokens=10, temperature=1.0, seed=0, ignore_eos=True)
    (usage,), (out,) = engine_usage(model, [prompt], params, bs)
    alone = LLMEngine(model, 200, bs, watermark=0.0)
    alone.generate([prompt], params)
    # after every step but the last (the samples finish and free everything in it)
    assert usage.shared == alone.stats.blocks_used[:-1]
    for t, blocks in enumerate(usage.unshared):  # n copies of prompt + t written tokens
        assert blocks == n * cdiv(prompt_len + t, bs)
    # the part-filled prompt block is copied for all samples but the last writer
    assert usage.copies == copies
    assert len(out.outputs) == n


def test_samples_that_end_early_free_their_blocks(model):
    prompt = list(range(1, 10))
    params = SamplingParams(n=4, max_tokens=24, temperature=1.0, seed=3,
                            stop_token_ids=list(range(8)))  # a stop id ends a sample early
    (usage,), (out,) = engine_usage(model, [prompt], params, 4)
    lengths = sorted(len(c.token_ids) for c in out.outputs)
    assert lengths[0] < lengths[-1], "seed 3 should end a sample early"
    # the last entry counts only the samples still running then
    live_at_end = sum(n > len(usage.unshared) for n in lengths)
    assert usage.unshared[-1] == sum(cdiv(9 + len(usage.unshared) - 1, 4)
                                     for _ in range(live_at_end))


def test_beams_and_samples_in_one_batch_are_measured_as_alone(model):
    prompt = list(range(1, 22))
    beam = SamplingParams(max_tokens=12, beam_width=3, ignore_eos=True)
    both, outs = engine_usage(model, [prompt, prompt],
                              [SamplingParams(n=2, max_tokens=8, seed=1), beam], 4)
    assert both[1] == engine_beam_usage(model, [prompt], 3, 12, 4)[0]
    assert len(outs[0].outputs) == 2 and len(outs[1].outputs) == 3
    with pytest.raises(ValueError, match="nothing to share"):
        engine_usage(model, [prompt], SamplingParams(max_tokens=4), 4)


def test_engine_savings_overlays_requests_from_step_0():
    a = sharing.Usage([2, 3, 3], [4, 6, 6], 1)
    b = sharing.Usage([1, 2], [2, 4], 0)
    s = engine_savings("parallel", 2, [a, b])
    assert (s.peak_shared, s.peak_unshared) == (5, 10)
    assert s.mean_shared == pytest.approx((3 + 5 + 3) / 3)
    assert s.mean_unshared == pytest.approx((6 + 10 + 6) / 3)
    assert s.mean_saving == pytest.approx(1 - 11 / 22)
    assert s.per_request_saving == pytest.approx((1 - 8 / 16 + 1 - 3 / 6) / 2)
    assert s.copies == 1
    with pytest.raises(ValueError):
        engine_savings("beam", 2, [])


def test_savings_picture_shades_the_paper_s_range_behind_a_model_s_panel():
    from paged_lib.course.viz import sharing as viz

    s = sharing.Savings("parallel", 4, 5, 10, 4.0, 8.0, 0, 0.5)
    table = {("alpaca", "parallel", 4): s, ("SmolLM2", "parallel", 4): s}
    fig = viz.plot_savings(table, {"SmolLM2": "alpaca"})
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["alpaca-like trace (synthetic)", "SmolLM2 (measured; shaded: alpaca)"]
    # the paper's two bands (parallel, beam) and the bar, in each panel
    assert [len(ax.patches) for ax in fig.axes] == [3, 3]
    bare = viz.plot_savings(table)  # no paper trace named: no band behind the model
    assert [len(ax.patches) for ax in bare.axes] == [3, 1]
