"""paged_lib.studies.serving: sustained rates from a sweep, the OPT-13B step model and the
discrete-event simulation of the four policies (chapter 14)."""

import math

import pytest

from paged_lib.accounting import SPECS
from paged_lib.studies import serving as sv


def test_sustained_rate_is_the_last_rate_under_the_bound_with_all_below():
    assert sv.sustained_rate([1, 2, 4, 8], [0.1, 0.2, 0.9, 0.3], 0.5) == 2
    assert sv.sustained_rate([4, 1, 2], [0.1, 0.1, 0.1], 0.5) == 4
    assert sv.sustained_rate([1, 2], [0.6, 0.1], 0.5) == 0.0
    sweep = {"policies": ["paged", "orca-max"], "runs": [
        {"reservation": "paged", "request_rate": 2, "normalized_latency_s": 0.1},
        {"reservation": "paged", "request_rate": 1, "normalized_latency_s": 0.1},
        {"reservation": "orca-max", "request_rate": 1, "normalized_latency_s": 0.1},
        {"reservation": "orca-max", "request_rate": 2, "normalized_latency_s": 1.0}]}
    c = sv.curves(sweep)
    assert c["paged"] == ([1, 2], [0.1, 0.1])
    s = sv.sustained_rates(c, 0.5)
    assert s == {"paged": 2, "orca-max": 1}
    assert sv.rate_ratios(s) == {"orca-max": 2.0}
    assert sv.rate_ratios({"paged": 2, "orca-max": 0.0}) == {"orca-max": math.inf}


def test_step_model_is_a_roofline_of_bytes_and_flops():
    spec, gpu = SPECS["opt-13b"], sv.A100_40GB
    # one decode with no context: the weights read once, about 16.5 ms at 1.555 TB/s
    one = sv.step_seconds(spec, gpu, [], [0])
    assert one == pytest.approx((2 * spec.num_params + 819_200) / 1.555e12)
    # decoding is memory-bound: 64 decodes of 500 tokens cost the weights plus their KV
    many = sv.step_seconds(spec, gpu, [], [500] * 64)
    assert many == pytest.approx((2 * spec.num_params + 819_200 * (64 * 500 + 64)) / 1.555e12)
    # a long prefill is compute-bound
    pre = sv.step_seconds(spec, gpu, [2000], [])
    flops = 2 * spec.num_params * 2000 + 4 * 40 * 5120 * (2000 * 2001 // 2)
    assert pre == pytest.approx(flops / 312e12)


def test_simulation_orders_the_policies_as_the_paper_does():
    trace = sv.poisson_trace(200, 2.0, seed=0)
    got = {p: sv.simulate_serving(trace, p) for p in sv.RESERVATIONS}
    lat = {p: g["normalized_latency_s"] for p, g in got.items()}
    assert lat["paged"] < lat["orca-oracle"] < lat["orca-pow2"] < lat["orca-max"]
    assert got["orca-max"]["peak_batch"] < got["paged"]["peak_batch"]
    assert all(got[p]["preemptions"] == 0 for p in sv.RESERVATIONS[1:])
    assert got["paged"]["num_blocks"] == int(12e9 // (819_200 * 16))
    # at a low rate nobody waits: every policy gives the same latency
    calm = sv.poisson_trace(30, 0.05, seed=1)
    lats = {sv.simulate_serving(calm, p)["normalized_latency_s"] for p in sv.RESERVATIONS}
    assert max(lats) - min(lats) < 1e-3


def test_paged_preempts_by_recompute_when_the_pool_runs_out():
    trace = [(100, 400, 0.0)] * 6
    r = sv.simulate_serving(trace, "paged", kv_bytes=819_200 * 16 * 80)
    assert r["preemptions"] > 0 and r["num_blocks"] == 80
    with pytest.raises(RuntimeError, match="can never run"):
        sv.simulate_serving([(100, 10, 0.0)], "orca-max", kv_bytes=819_200 * 16 * 80)
    with pytest.raises(ValueError, match="policy"):
        sv.simulate_serving(trace, "buddy")
