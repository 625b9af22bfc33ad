"""Synthetic ShareGPT-like and Alpaca-like traces: seeded, shaped like the paper's."""

from __future__ import annotations

import numpy as np
import pytest

from paged_lib.workloads import (
    MAX_PROMPT,
    PAPER_MEANS,
    TRACES,
    Request,
    alpaca_like,
    mean_lengths,
    sharegpt_like,
    shrink,
)


@pytest.mark.parametrize("name", sorted(TRACES))
def test_same_seed_same_trace_other_seed_other_trace(name):
    make = TRACES[name]
    assert make(200, seed=7) == make(200, seed=7)
    assert make(200, seed=7) != make(200, seed=8)


def test_golden_values_pin_the_generator():
    """The stored notebook outputs rest on these exact draws."""
    assert sharegpt_like(3) == [Request(115, 237, 0.673583), Request(89, 125, 1.428884),
                                Request(192, 307, 4.24567)]
    assert alpaca_like(3) == [Request(17, 46, 0.168396), Request(15, 27, 0.357221),
                              Request(23, 56, 1.061418)]


@pytest.mark.parametrize("name", sorted(TRACES))
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_means_within_20_percent_of_the_paper(name, seed):
    prompt, output = mean_lengths(TRACES[name](600, seed=seed))
    want_p, want_o = PAPER_MEANS[name]
    assert abs(prompt / want_p - 1) < 0.2, (prompt, want_p)
    assert abs(output / want_o - 1) < 0.2, (output, want_o)


@pytest.mark.parametrize("name", sorted(TRACES))
def test_large_sample_means_land_close(name):
    prompt, output = mean_lengths(TRACES[name](50_000, seed=0))
    want_p, want_o = PAPER_MEANS[name]
    assert abs(prompt / want_p - 1) < 0.05 and abs(output / want_o - 1) < 0.05


@pytest.mark.parametrize("name", sorted(TRACES))
@pytest.mark.parametrize("max_len", [2048, 512, 2])
def test_lengths_are_positive_ints_and_clipped(name, max_len):
    reqs = TRACES[name](2000, seed=1, max_len=max_len)
    for r in reqs:
        assert isinstance(r.prompt_len, int) and isinstance(r.output_len, int)
        assert 1 <= r.prompt_len <= min(MAX_PROMPT, max_len - 1)
        assert r.output_len >= 1 and r.final_len <= max_len


def test_sharegpt_is_long_tailed():
    outputs = np.array([r.output_len for r in sharegpt_like(5000, seed=0)])
    assert np.median(outputs) < 0.8 * outputs.mean()  # mean pulled up by the tail
    assert outputs.max() > 5 * outputs.mean()


@pytest.mark.parametrize("rate", [0.1, 1.0, 5.0])
def test_poisson_arrivals(rate):
    arrivals = np.array([r.arrival for r in sharegpt_like(3000, seed=4, rate=rate)])
    gaps = np.diff(arrivals, prepend=0.0)
    assert np.all(gaps >= 0)
    assert abs(gaps.mean() * rate - 1) < 0.1
    assert abs(gaps.std() / gaps.mean() - 1) < 0.1  # exponential: std == mean


def test_bad_arguments():
    with pytest.raises(ValueError, match="rate"):
        sharegpt_like(10, rate=0)
    with pytest.raises(ValueError, match="num_requests"):
        alpaca_like(-1)
    with pytest.raises(ValueError, match="max_len"):
        sharegpt_like(10, max_len=1)
    with pytest.raises(ValueError, match="empty"):
        mean_lengths([])
    with pytest.raises(ValueError, match="factor"):
        shrink([Request(1, 1, 0.0)], 0)
    assert sharegpt_like(0) == []


def test_shrink_divides_lengths_and_keeps_arrivals():
    reqs = [Request(160, 330, 1.5), Request(3, 1, 2.0)]
    assert shrink(reqs, 8) == [Request(20, 41, 1.5), Request(1, 1, 2.0)]
    assert shrink(reqs, 1) == reqs
