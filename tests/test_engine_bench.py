"""The engine benchmark runs end to end on a small trace and reports every system."""

import torch

import paged_lib  # noqa: F401  # isort: split
from paged_lib.engine import bench


def test_engine_bench_small_run(capsys):
    before = torch.get_num_threads()
    try:
        assert bench.main(["--requests", "6", "--num-blocks", "40", "--block-size", "8",
                           "--max-len", "80", "--random-model", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(before)
    text = capsys.readouterr().out
    for system in ("paged engine", "static batching", "transformers generate"):
        assert system in text
    assert "overhead per decode step" in text


def test_scheduling_overhead_is_measured_for_64_sequences():
    ms = bench.scheduling_overhead_ms(num_seqs=64, steps=5)
    assert 0 < ms < 1000
