"""python -m paged_lib.bench serve (chapter 14): Poisson load in real time, vLLM's metrics."""

import json

import httpx
import pytest

from paged_lib.bench import serve as bs
from paged_lib.bench.__main__ import main as bench_main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_load_is_seeded_poisson_and_fits_the_model():
    a, b = bs.make_load(50, 4.0, seed=3), bs.make_load(50, 4.0, seed=3)
    assert a == b and a != bs.make_load(50, 4.0, seed=4)
    assert all(len(r.prompt) + r.output_len <= 512 and r.output_len >= 1 for r in a)
    arrivals = [r.arrival for r in a]
    assert arrivals == sorted(arrivals)
    long = bs.make_load(2000, 4.0, seed=0)
    assert 3.0 < len(long) / long[-1].arrival < 5.0  # about 4 requests per second
    with pytest.raises(ValueError, match="request_rate"):
        bs.make_load(3, 0.0)


def test_metrics_are_vllms_and_the_papers():
    served = [bs.Served(0.0, 3, [1.0, 1.5, 2.0]), bs.Served(1.0, 1, [1.25]),
              bs.Served(2.0, 2, [], error="never fits")]
    m = bs.metrics(served, duration=2.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["ttft_ms"]["mean"] == pytest.approx((1000 + 250) / 2)
    assert m["tpot_ms"]["mean"] == pytest.approx(500)       # the one-token request has none
    assert m["itl_ms"]["median"] == pytest.approx(500)
    assert m["normalized_latency_s"] == pytest.approx((2.0 / 3 + 0.25 / 1) / 2)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_token_throughput"] == pytest.approx(2.0)


@pytest.mark.parametrize("policy", ["paged", "orca-max"])
def test_a_few_requests_at_a_high_rate(policy):
    m = bs.bench(200.0, 6, policy, seed=1)
    assert m["completed"] == 6 and m["failed"] == 0 and m["preemptions"] == 0
    assert m["ttft_ms"]["mean"] > 0 and m["tpot_ms"]["mean"] > 0 and m["itl_ms"]["p99"] > 0
    assert m["normalized_latency_s"] > 0
    # orca-max reserves 512 tokens = 32 of the 64 blocks: two requests at a time
    assert m["peak_batch"] <= 2 if policy == "orca-max" else m["peak_batch"] > 2


@pytest.mark.parametrize("policy", ["paged", "orca-oracle"])
def test_a_load_far_above_what_the_engine_sustains_loses_nothing(policy):
    """40 requests at 1,000 req/s on a 36-block pool (every request waits, paged ones are
    preempted): latency grows, but every request completes, none fails, the loop ends
    (no deadlock) and every block is free afterwards."""
    m = bs.bench(1000.0, 40, policy, seed=3, num_blocks=36)
    assert m["completed"] == 40 and m["failed"] == 0
    assert m["blocks_in_use_at_end"] == 0
    assert m["ttft_ms"]["p99"] > m["ttft_ms"]["median"]


def test_command_line_prints_the_report_and_the_sweep_writes_json(tmp_path, capsys):
    assert bench_main(["serve", "--request-rate", "100", "--num-prompts", "3",
                       "--reservation", "orca-oracle"]) == 0
    out = capsys.readouterr().out
    for words in ("Request throughput (req/s):", "Output token throughput", "Mean TTFT (ms):",
                  "P99 TPOT (ms):", "Median ITL (ms):", "Mean latency / output length",
                  "orca-oracle"):
        assert words in out
    path = tmp_path / "sweep.json"
    assert bs.main(["--sweep", "--rates", "100", "--num-prompts", "2", "--output",
                    str(path)]) == 0
    data = json.loads(path.read_text())
    assert [r["reservation"] for r in data["runs"]] == list(bs.RESERVATIONS)
    assert all(r["completed"] == 2 for r in data["runs"])


def test_the_cpu_clock_counts_steps_and_skips_idle_gaps(monkeypatch):
    engine = bs.make_engine("paged")
    load = bs.make_load(4, 0.01, seed=2)  # about 100 s apart: idle gaps are skipped
    sleeps = []
    monkeypatch.setattr(bs.time, "sleep", sleeps.append)  # the wall clock's way to wait
    served, clock_end = bs.serve_load(engine, load, clock="cpu")
    assert sleeps == []  # jumped over the gaps instead of waiting for them
    assert all(len(s.token_times) == s.output_len for s in served)
    assert clock_end > load[-1].arrival - load[0].arrival  # the clock jumped to each arrival
    assert all(s.token_times[0] > s.arrival for s in served)
    assert bs.sweep_command([2, 4.5], 100, clock="cpu") == (
        "python -m paged_lib.bench serve --sweep --clock cpu --num-prompts 100 --num-blocks 64 "
        "--rates 2 4.5 --output paged_lib/data/fig12_tiny.json")
    with pytest.raises(ValueError, match="clock"):
        bs.serve_load(engine, load, clock="gpu")


@pytest.mark.parametrize("flags", [(), ("--reservation", "orca-max")], ids=["paged", "orca-max"])
def test_the_load_over_http_to_a_running_server(capsys, flags):
    from paged_lib.course.demos.server import local_server

    with local_server(name="tiny", num_blocks=64, extra_args=flags) as base_url:
        assert bs.main(["--base-url", base_url, "--request-rate", "100", "--num-prompts",
                        "3", "--seed", "1"]) == 0
        metrics_text = httpx.get(f"{base_url}/metrics").text
    assert 'finished_reason="length"} 3.0' in metrics_text
    out = capsys.readouterr().out
    assert "Successful requests:                             3" in out
    assert "Failed requests:                                 0" in out
    assert "(the server's)" in out and "Mean TTFT (ms):" in out
    with pytest.raises(SystemExit):
        bs.main(["--sweep", "--base-url", "http://127.0.0.1:9"])
