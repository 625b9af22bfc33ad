"""The engine on chapter-02 traces: against static batching, and against the simulator."""

import pytest
import torch

import paged_lib  # noqa: F401  # isort: split
from paged_lib.engine import LLMEngine
from paged_lib.engine.static_batching import StaticBatchingEngine
from paged_lib.engine.trace import arrival_steps, simulated_blocks, trace_requests
from paged_lib.model import TinyLlama, TinyLlamaConfig
from paged_lib.workloads import Request, alpaca_like, shrink

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = TinyLlamaConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                          head_dim=16, vocab_size=64, intermediate_size=64)
    return TinyLlama(cfg).eval()


@pytest.fixture(scope="module")
def mixed_trace():
    """48 Alpaca-like requests, at most 160 tokens each."""
    return alpaca_like(48, seed=0, max_len=160)


@pytest.fixture(scope="module")
def both_systems(model, mixed_trace):
    prompts, params = trace_requests(mixed_trace, model.config.vocab_size)
    paged = LLMEngine(model, num_blocks=120, block_size=8)
    static = StaticBatchingEngine(model, num_blocks=120, block_size=8, max_len=160)
    return paged, paged.generate(prompts, params), static, static.generate(prompts, params)


def test_paged_engine_needs_at_most_half_the_steps_of_static_batching(both_systems,
                                                                      mixed_trace):
    paged, _, static, _ = both_systems
    assert static.num_slots == 6  # 960 token slots / 160
    # static: batches of 6 in arrival order, each as long as its longest output
    lens = [r.output_len for r in mixed_trace]
    assert static.stats.steps == sum(max(lens[i:i + 6]) for i in range(0, 48, 6))
    assert 2 * paged.stats.steps <= static.stats.steps
    assert paged.stats.generated_tokens == static.stats.generated_tokens == sum(lens)
    assert static.stats.peak_batch_size == 6 < paged.stats.peak_batch_size
    assert max(static.stats.blocks_used) == 120 and paged.stats.peak_blocks_used <= 120
    p, st = paged.stats.summary(), static.stats.summary()
    assert p["generated_tokens"] == st["generated_tokens"] == sum(lens)
    assert p["mean_tokens_per_step"] == round(sum(lens) / paged.stats.steps, 2)
    assert p["mean_tokens_per_step"] >= 2 * st["mean_tokens_per_step"]


def test_both_systems_generate_the_same_tokens(both_systems, mixed_trace):
    _, paged_out, _, static_out = both_systems
    for i, (a, b, r) in enumerate(zip(paged_out, static_out, mixed_trace, strict=True)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"request {i}"
        assert len(a.outputs[0].token_ids) == r.output_len


def test_static_batching_refuses_requests_longer_than_a_slot(model):
    static = StaticBatchingEngine(model, num_blocks=20, block_size=8, max_len=40)
    out = static.generate([[1] * 30, [2] * 5], [
        paged_lib.engine.SamplingParams(max_tokens=20, temperature=0.0),
        paged_lib.engine.SamplingParams(max_tokens=3, temperature=0.0)])
    assert "max_len=40" in out[0].error and len(out[1].outputs[0].token_ids) == 3


def test_engine_blocks_per_step_equal_the_simulator_shifted_by_one_token(model):
    # a small Alpaca-like trace under heavy memory pressure, prompts of >= 2 tokens
    trace = [r._replace(prompt_len=max(2, r.prompt_len))
             for r in shrink(alpaca_like(30, seed=1), 2)]
    prompts, params = trace_requests(trace, model.config.vocab_size)
    engine = LLMEngine(model, num_blocks=40, block_size=4, watermark=0.0,
                       max_num_seqs=10**6, max_num_batched_tokens=10**6)
    engine.generate(prompts, params)
    blocks, preemptions = simulated_blocks(trace, 40, 4)
    assert engine.stats.preemptions == preemptions > 0
    assert engine.stats.blocks_used == blocks
    # without the one-token shift the simulator holds more (the rule matters)
    unshifted, _ = simulated_blocks([r._replace(prompt_len=r.prompt_len + 1) for r in trace],
                                    40, 4)
    assert unshifted != engine.stats.blocks_used


def test_with_arrivals_the_engine_still_matches_the_simulator(model):
    trace = [r._replace(prompt_len=max(2, r.prompt_len))
             for r in shrink(alpaca_like(20, seed=4, rate=0.25), 2)]
    prompts, params = trace_requests(trace, model.config.vocab_size)
    engine = LLMEngine(model, num_blocks=24, block_size=4, watermark=0.0,
                       max_num_seqs=10**6, max_num_batched_tokens=10**6)
    arrivals = arrival_steps(trace)
    engine.generate(prompts, params, arrival_steps=arrivals)
    blocks, preemptions = simulated_blocks(trace, 24, 4, with_arrivals=True)
    assert engine.stats.blocks_used == blocks
    assert engine.stats.preemptions == preemptions > 0
    assert [t.arrival_step for t in engine.stats.requests] == arrivals
    assert all(t.admitted_steps[0] >= t.arrival_step for t in engine.stats.requests)
    assert "idle" in engine.stats.step_kinds  # the trace starts (or pauses) with no one


def test_preemption_cost_of_swap_and_recompute(model):
    """The one preemption report (chapter 07's): per run, block copies and bytes a swap
    moved, tokens a recompute prefilled again, on one trace and one KV budget."""
    from paged_lib.accounting import kv_bytes_per_token
    from paged_lib.course.demos.engine_compare import preemption_cost

    prompts, params = trace_requests(alpaca_like(10, seed=0, max_len=80),
                                     model.config.vocab_size)
    per_token = kv_bytes_per_token(model.config)
    for block_size in (4, 16):
        num_blocks = 160 // block_size
        for mode in ("swap", "recompute"):
            engine = LLMEngine(model, num_blocks, block_size, preemption=mode,
                               num_cpu_blocks=4 * num_blocks if mode == "swap" else 0)
            engine.generate(prompts, params)
            s = engine.stats
            cost = preemption_cost(s, model.config)
            assert cost["preemptions"] == s.preemptions > 0
            if mode == "swap":
                assert cost["recomputed_tokens"] == 0
                assert cost["swapped_blocks"] == s.swapped_blocks > 0
                assert cost["swapped_bytes"] == s.swapped_blocks * block_size * per_token
            else:
                assert cost["swapped_blocks"] == cost["swapped_bytes"] == 0
                assert cost["recomputed_tokens"] == s.recomputed_tokens > 0


def test_trace_requests_random_prompts_have_the_trace_lengths():
    trace = alpaca_like(12, seed=2, max_len=60)
    prompts, params = trace_requests(trace, 50, seed=3)
    assert [len(p) for p in prompts] == [r.prompt_len for r in trace]
    assert all(0 <= t < 50 for p in prompts for t in p)
    assert [sp.max_tokens for sp in params] == [r.output_len for r in trace]
    assert all(sp.ignore_eos and sp.temperature == 0.0 and sp.n == 1 for sp in params)
    assert trace_requests(trace, 50, seed=3)[0] == prompts
    assert trace_requests(trace, 50, seed=4)[0] != prompts


def test_trace_requests_text_prompts_start_at_lines_and_wrap():
    trace = [Request(5, 1, 0.0), Request(5, 1, 0.0), Request(12, 2, 0.0)]
    prompts, params = trace_requests(trace, text="ab\ncdef\n", bos_id=9)
    assert prompts == [[9, *b"ab\ncd"], [9, *b"cdef\n"], [9, *b"ab\ncdef\nab\nc"]]
    assert [sp.max_tokens for sp in params] == [1, 1, 2]
    assert trace_requests(trace, text="ab\ncdef\n")[0][0] == list(b"ab\ncd")  # no BOS
    with pytest.raises(ValueError, match="vocabulary of 100"):
        trace_requests(trace, 100, text="ab\ncdef\n", bos_id=256)
    with pytest.raises(ValueError, match="vocab_size"):
        trace_requests(trace)
