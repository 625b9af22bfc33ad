"""The engine benchmark runs end to end on a small trace and reports every system."""

import pytest

import paged_lib  # noqa: F401  # isort: split
from paged_lib.bench import engine as bench

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_engine_bench_small_run(capsys):
    assert bench.main(["--requests", "6", "--num-blocks", "40", "--block-size", "8",
                       "--max-len", "80", "--random-model"]) == 0
    text = capsys.readouterr().out
    rows = {line.split("  ")[0]: line.split() for line in text.splitlines()}
    engine, static, hf = (rows[s] for s in ("paged engine", "static batching",
                                            "transformers generate"))
    # steps: static batching and transformers run the same batches; the engine fewer
    assert int(static[2]) == int(hf[2]) > int(engine[2])
    assert "overhead per decode step, 64 running sequences" in text


def test_scheduling_overhead_is_measured_for_64_sequences():
    ms = bench.scheduling_overhead_ms(num_seqs=64, steps=5)
    assert 0 < ms < 1000
