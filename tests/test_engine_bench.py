"""The engine benchmark runs end to end on a small trace and reports every system."""

import pytest

import paged_lib  # noqa: F401  # isort: split
from paged_lib.bench import engine as bench

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_engine_bench_small_run(capsys):
    assert bench.main(["--requests", "6", "--num-blocks", "40", "--block-size", "8",
                       "--max-len", "80", "--random-model", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    rows = {line.split("  ")[0]: line.split() for line in text.splitlines()}
    engine, static, hf = (rows[s] for s in ("paged engine", "static batching",
                                            "transformers generate"))
    # steps: static batching and transformers run the same batches; the engine fewer
    assert int(static[2]) == int(hf[2]) > int(engine[2])
    assert "overhead per decode step, 64 running sequences" in text
    assert "goal: engine >= 2x transformers, wall clock:" in text
    parts = next(line for line in text.splitlines() if line.startswith("paged engine, ms per"))
    for part in ("scheduling", "model input", "model", "sampling", "other", "total"):
        assert f"{part} " in parts


def test_step_breakdown_adds_up_from_the_engines_own_phases(tiny_model):
    from paged_lib.engine import LLMEngine, SamplingParams

    parts = bench.step_breakdown(tiny_model, [[1, 2, 3], [4, 5]],
                                 SamplingParams(max_tokens=4, temperature=0.0),
                                 16, 4, "torch")
    assert set(parts) == {"scheduling", "model input", "model", "sampling", "other"}
    assert all(ms > 0 for part, ms in parts.items() if part != "other")
    assert parts["model"] > parts["sampling"]
    seen = []
    engine = LLMEngine(tiny_model, 16, 4, on_step=lambda out, stats: seen.append(
        (out.step, stats.steps, round(sum(stats.phase_seconds.values()), 9))))
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0))
    assert [s[:2] for s in seen] == [(0, 1), (1, 2), (2, 3)]  # after each step, recorded
    assert seen[-1][2] <= sum(engine.stats.step_seconds) + 1e-9


def test_scheduling_overhead_is_measured_for_64_sequences():
    ms = bench.scheduling_overhead_ms(num_seqs=64, steps=5)
    assert 0 < ms < 1000
