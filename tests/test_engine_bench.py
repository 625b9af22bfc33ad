"""The engine benchmark runs end to end on a small trace and reports every system."""

import pytest
from conftest import needs_smollm2

import paged_lib  # noqa: F401  # isort: split
from paged_lib.bench import engine as bench

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_engine_bench_small_run(capsys, monkeypatch):
    from paged_lib.bench import floor

    calls = []  # the run's floor, then one reading before each decode step's round
    monkeypatch.setattr(bench, "measure_machine", lambda: calls.append(1) or floor.measure_machine(
        read_bytes=2**20, matmul_size=64, repeats=1))
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
    assert "floor: this machine now, 1 thread(s): reads memory at" in text
    assert "paged engine over the trace:" in text and "x the floor" in text
    assert "decode step at batch 32 (64 tokens each)" in text
    assert len(calls) == 1 + 3 * 3
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


def test_chat_trace_is_distinct_questions_with_mixed_lengths():
    from paged_lib.bench import engine_chat

    questions, lens = engine_chat.chat_trace(32, max_tokens=160)
    assert len(set(questions)) == 32 and len(lens) == 32
    assert max(lens) <= 160 and len(set(lens)) > 10
    assert engine_chat.chat_trace(32, 160) == (questions, lens)  # seeded
    assert engine_chat.until_stop([5, 6, 2, 7], 8, eos=2) == [5, 6, 2]
    assert engine_chat.until_stop([5, 6, 2, 7], 2, eos=2) == [5, 6]
    assert engine_chat.first_difference([[1, 2], [3, 4, 5]], [[1, 2], [3, 4, 5]]) is None
    assert engine_chat.first_difference([[1, 2], [3, 4, 5]], [[1, 2], [3, 9]]) == \
        "request 1 differs at token 1 (3 vs 2 tokens: [4, 5] vs [9])"


@pytest.mark.slow
@needs_smollm2
def test_engine_bench_on_smollm2_serves_the_same_tokens_three_ways(capsys, monkeypatch):
    # A tiny chat trace (2 requests, at most 4 tokens each). transformers reads the converted
    # folder here (a second), not the GGUF file (13 s): test_smollm2 compares the two
    # loaders; this checks the bench's plumbing, budgets and token checks.
    from paged_lib.bench import engine_chat
    from paged_lib.models import smollm2

    seen = []
    run = engine_chat.run
    monkeypatch.setattr(engine_chat, "run", lambda *a, **k: seen.append(run(*a, **k)) or seen[0])
    assert bench.main(["--model", "SmolLM2-135M-Instruct", "--requests", "2",
                       "--max-tokens", "4", "--num-blocks", "8", "--no-decode-steps",
                       "--hf-weights", str(smollm2.cache_folder())]) == 0
    res, text = seen[0], capsys.readouterr().out
    assert [r["system"] for r in res["rows"]] == [
        "paged engine", "transformers generate", "transformers generate_batch"]
    assert res["same"] == {"transformers generate": 2, "transformers generate_batch": 2}
    assert len({r["tokens"] for r in res["rows"]}) == 1 and res["rows"][0]["tokens"] >= 2
    # the paged systems hold the same KV bytes: 8 blocks of 16 tokens x 45 KiB
    assert res["kv_engine"] == res["kv_cb"]["kv_bytes"] == 8 * 16 * 46_080
    assert res["kv_cb"]["pages"] == 8 and res["threads"] == 1
    assert "ratio engine / generate:" in text and "ratio engine / generate_batch:" in text
    assert "greedy tokens, engine = transformers generate_batch: 2/2 requests" in text
    assert f"the floor of its {res['engine_steps']} steps" in text
    assert "0 of " in text and "computed tokens recomputed" in text
