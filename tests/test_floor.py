"""The floor the benches print beside every figure: its arithmetic, and what it records.

Every ``floor.Machine`` here but one is built by hand (bandwidth and FLOP/s given), so a
floor's ``seconds`` is arithmetic on counted bytes and FLOPs, the same on any machine,
loaded or not; the one measured machine (``measure_machine``) is checked only for what it
prints, never for a figure.
"""

import pytest

import paged_lib  # noqa: F401  # isort: split
from paged_lib.bench import floor
from paged_lib.model import TinyLlamaConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMOLLM2 = TinyLlamaConfig(name="SmolLM2-135M", num_layers=30, hidden_size=576, num_heads=9,
                          num_kv_heads=3, head_dim=64, vocab_size=49152,
                          intermediate_size=1536, tie_word_embeddings=True)


def test_smollm2_reads_538_mb_and_costs_269_mflop_per_token():
    assert floor.weight_bytes(SMOLLM2) == 538_060_032  # 134.5M fp32 parameters
    machine = floor.Machine(bandwidth=1e30, flops=1.0, threads=1)  # FLOPs decide
    f = floor.step_floor(SMOLLM2, [1], [1], machine)
    head = 2 * 49152 * 576
    assert f.flops - 4 * 30 * 9 * 64 == 2 * 30 * floor.linear_params(SMOLLM2) + head
    assert round(f.flops / 1e6) == 269 and f.seconds == f.flops
    assert floor.kv_bytes_per_token(SMOLLM2) == 46_080


def test_the_floor_is_the_larger_of_reading_and_computing():
    cfg = SMOLLM2
    slow_memory = floor.Machine(bandwidth=1e9, flops=1e15, threads=1)
    f = floor.decode_floor(cfg, batch=8, context=100, machine=slow_memory)
    assert f.bytes == floor.weight_bytes(cfg) + floor.kv_bytes_per_token(cfg) * 8 * 101
    assert f.seconds == f.bytes / 1e9 and f.ratio(2 * f.seconds) == 2
    slow_math = floor.Machine(bandwidth=1e15, flops=1e9, threads=1)
    assert floor.decode_floor(cfg, 8, 100, slow_math).seconds == f.flops / 1e9


def test_a_prompt_counts_its_causal_pairs_and_the_head_once():
    cfg = TinyLlamaConfig()
    m = floor.Machine(bandwidth=1.0, flops=1.0, threads=1)
    prompt = floor.step_floor(cfg, [4], [4], m)  # pairs 1+2+3+4 = 10, one head row
    one = floor.step_floor(cfg, [1], [1], m)
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    linear = 2 * cfg.num_layers * floor.linear_params(cfg)
    assert prompt.flops - one.flops == 3 * linear + 9 * attn


@pytest.mark.parametrize("seq_lens, query_lens", [([3], [4]), ([3], [0]), ([3, 4], [1])])
def test_bad_lengths_are_refused(seq_lens, query_lens):
    m = floor.Machine(1.0, 1.0, 1)
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        floor.step_floor(TinyLlamaConfig(), seq_lens, query_lens, m)


def test_the_recorder_sees_every_step_the_engine_runs(tiny_model):
    from paged_lib.engine import LLMEngine, SamplingParams

    engine = LLMEngine(tiny_model, num_blocks=16, block_size=4)
    rec = floor.StepRecorder(engine)
    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(rec.steps) == engine.stats.steps
    assert [sum(q) for _, q in rec.steps] == engine.stats.computed_tokens
    m = floor.Machine(1e9, 1e9, 1)
    total = rec.floor(tiny_model.config, m)
    assert total.seconds == sum(floor.step_floor(tiny_model.config, s, q, m).seconds
                                for s, q in rec.steps)


def test_machine_and_decode_step_lines(tiny_model):
    machine = floor.measure_machine(read_bytes=2**20, matmul_size=64, repeats=1)
    assert machine.threads == 1 and "GB/s" in machine.describe()
    lines = floor.decode_step_lines(tiny_model, machine, batches=(1, 3), context=9)
    assert len(lines) == 2 and lines[1].startswith("decode step at batch 3 (9 tokens each)")
    assert all("x the floor" in line for line in lines)
    with pytest.raises(ValueError, match="batch >= 1"):
        floor.time_decode_steps(tiny_model, 0, 9)


def test_decode_step_lines_set_each_step_beside_its_own_reading(tiny_model):
    # three rounds a batch, a reading right before each; the line is the median round's,
    # whatever the machine measured before the run (stale)
    rates = [1e8, 1e10, 1e12, 1e12, 1e8, 1e10]  # 100x apart: no timing noise reorders them
    readings = iter(floor.Machine(r, r, 1) for r in rates)
    stale = floor.Machine(99e9, 99e9, 1)
    lines = floor.decode_step_lines(tiny_model, stale, batches=(1, 3), context=9,
                                    measure=lambda: next(readings), rounds=3)
    assert next(readings, None) is None
    assert all("at 10.0 GB/s, 10 GFLOP/s)" in line for line in lines)
    assert all(line.endswith("median of 3 rounds, each beside its own reading")
               for line in lines)
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        floor.decode_step_lines(tiny_model, stale, batches=(1,), context=9, rounds=0)


def test_the_parts_floors_add_up_to_the_steps_arithmetic():
    slow_math = floor.Machine(bandwidth=1e30, flops=1e9, threads=1)
    seq_lens, query_lens = [40, 7, 9], [1, 7, 2]
    parts = floor.part_floors(SMOLLM2, seq_lens, query_lens, slow_math)
    assert list(parts) == ["linear maps", "LM head", "decode attention", "prefill attention"]
    whole = floor.step_floor(SMOLLM2, seq_lens, query_lens, slow_math)
    assert sum(parts.values()) == pytest.approx(whole.seconds, rel=1e-12)
    slow_memory = floor.Machine(bandwidth=1e9, flops=1e30, threads=1)
    parts = floor.part_floors(SMOLLM2, seq_lens, query_lens, slow_memory)
    assert parts["decode attention"] == floor.kv_bytes_per_token(SMOLLM2) * 41 / 1e9
    norms = (2 * SMOLLM2.num_layers + 1) * SMOLLM2.hidden_size * 4  # read, not a part
    whole = floor.step_floor(SMOLLM2, seq_lens, query_lens, slow_memory)
    assert sum(parts.values()) == pytest.approx(whole.seconds - norms / 1e9, rel=1e-12)


def test_a_decode_steps_layers_in_one_call_are_one_part_with_their_maps_and_attention():
    for machine in (floor.Machine(1e30, 1e9, 1), floor.Machine(1e9, 1e30, 1)):
        apart = floor.part_floors(SMOLLM2, [40, 9], [1, 1], machine)
        fused = floor.part_floors(SMOLLM2, [40, 9], [1, 1], machine, decode_layers=True)
        assert list(fused) == ["LM head", "decode layers"]
        assert fused["LM head"] == apart["LM head"]
        # one bound over the sum of both parts' bytes and FLOPs: here one of the two binds
        # both parts, so the sum of their floors
        assert fused["decode layers"] == pytest.approx(
            apart["linear maps"] + apart["decode attention"], rel=1e-12)
        # a step with a prefill keeps its parts (its layers run step by step)
        assert floor.part_floors(SMOLLM2, [40, 9], [1, 9], machine, decode_layers=True) == \
            floor.part_floors(SMOLLM2, [40, 9], [1, 9], machine)


def test_engine_parts_prints_each_part_beside_its_floor():
    from paged_lib.bench import engine_parts

    res = {"tokens": 10, "steps": 4, "threads": 1, "backend": "cpu", "wall": 2.0, "cpu": 1.5,
           "machine": floor.Machine(20e9, 100e9, 1), "floor": 0.5,
           "part_floors": {"linear maps": 0.25, "LM head": 0.125, "decode attention": 0.0625,
                           "prefill attention": 0.5},
           "parts": {("model forward",): (1.5, 1.2, 4),
                     ("model forward", "linear maps"): (1.0, 1.0, 40),
                     ("model forward", "decode attention"): (0.2, 0.125, 8),
                     ("LM head",): (0.3, 0.25, 4), ("LM head", "linear maps"): (0.3, 0.25, 4)}}
    lines = engine_parts.format_parts(res).splitlines()
    assert lines[0].endswith("the run's steps at best 0.50 s: wall 4.00x, process CPU per "
                             "thread 3.00x")
    assert lines[2].endswith("CPU   1.00 s (4.00x its floor 0.25 s), 40 calls")
    assert lines[3].endswith("CPU   0.12 s (2.00x its floor 0.06 s), 8 calls")
    head = next(line for line in lines if line.startswith("  LM head"))
    assert head.endswith("(2.00x its floor 0.12 s), 4 calls")
    assert lines[-2].endswith(", 4 calls") and "floor" not in lines[-2]  # the head's map


class _TickingClocks:
    """Fake clocks, in whole microseconds (nothing here reads a real clock): a wall clock,
    and a process CPU clock that counts the calling thread exactly but a second torch
    thread's time only in 4 ms ticks, as Linux's process clock does for a thread running
    on another core. Each call of ``work`` costs 6 ms of both threads."""

    def __init__(self):
        self.us = 0

    def perf_counter(self):
        return self.us / 1e6

    def process_time(self):
        return (self.us + self.us // 4000 * 4000) / 1e6

    def work(self):
        self.us += 6000


def test_a_rate_is_timed_over_runs_long_enough_for_the_process_clock(monkeypatch):
    """One 6-ms call timed alone reads one tick (4 ms) of the second thread or two, so CPU
    seconds per thread said 5 ms: a 256 MiB read 'ran' faster than the machine can. A run
    of MIN_RUN_SECONDS is 17 calls (102 ms), whose second thread reads 100 or 104 ms: 101
    ms per thread at worst, within 1% of the truth. The clocks are fake, so these are
    exact shares of a call's cost, the same on any machine."""
    clocks = _TickingClocks()
    fake = (clocks.perf_counter, clocks.process_time)
    monkeypatch.setattr(floor.torch, "get_num_threads", lambda: 2)
    share = floor._best_seconds(clocks.work, repeats=5, clocks=fake) / 0.006
    assert share == pytest.approx(101 / 102)
    monkeypatch.setattr(floor, "MIN_RUN_SECONDS", 0.0)  # the old way: one call a run
    share = floor._best_seconds(clocks.work, repeats=5, clocks=fake) / 0.006
    assert share == pytest.approx(5 / 6)
