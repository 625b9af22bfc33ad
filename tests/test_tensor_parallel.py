"""Tensor parallelism (chapter 12): the 2-rank engine gives the 1-rank engine's tokens.

Each engine with workers starts once per module (spawning two ranks takes seconds).
"""

from __future__ import annotations

import gc
import multiprocessing as mp

import pytest
import torch

from paged_lib.engine import LLMEngine, SamplingParams
from paged_lib.engine.hooks import EngineHooks
from paged_lib.engine.model_input import ModelInput
from paged_lib.engine.tensor_parallel import TensorParallelRunner
from paged_lib.model import TinyLlama, TinyLlamaConfig, load_tiny_code_llama
from paged_lib.parallel import (
    kv_bytes_per_rank,
    kv_head_replicas,
    rank_heads,
    shard_config,
    shard_state_dict,
)
from paged_lib.tokenizer import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["def add(a, b):", "import os\n", "class Stack:\n    def push(self, x):"]


@pytest.fixture(scope="module")
def shipped():
    return load_tiny_code_llama()


@pytest.fixture(scope="module")
def prompts():
    tok = ByteTokenizer()
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def tp_engine(shipped):
    engine = LLMEngine(shipped, 48, block_size=8, tensor_parallel_size=2)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def one_kv_head():
    """Random weights, 4 query heads sharing 1 KV head: 2 ranks must replicate it."""
    torch.manual_seed(0)
    cfg = TinyLlamaConfig(name="toy-mqa", num_layers=2, hidden_size=64, num_heads=4,
                          num_kv_heads=1, head_dim=16, intermediate_size=96)
    return TinyLlama(cfg).eval()


def toy_engine(model, tp):
    """A small pool with swapping: the prompts below are preempted and swapped back."""
    return LLMEngine(model, 14, block_size=4, num_cpu_blocks=40, preemption="swap",
                     tensor_parallel_size=tp)


@pytest.fixture(scope="module")
def toy_tp_engine(one_kv_head):
    engine = toy_engine(one_kv_head, 2)
    yield engine
    engine.close()


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_same(a, b):
    assert tokens(a) == tokens(b)
    for x, y in zip(a, b, strict=True):
        for c, d in zip(x.outputs, y.outputs, strict=True):
            assert c.cumulative_logprob == pytest.approx(d.cumulative_logprob, abs=1e-3)


# ---------------------------------------------------------------- the sharding math


@pytest.mark.parametrize("heads,kv,tp", [(8, 2, 1), (8, 2, 2), (8, 2, 4), (8, 2, 8),
                                         (4, 1, 2), (6, 6, 3), (64, 8, 16)])
def test_rank_heads_cover_every_head_and_pair_queries_with_their_kv_head(heads, kv, tp):
    group = heads // kv
    owners = [rank_heads(heads, kv, tp, r) for r in range(tp)]
    assert sorted(h for q, _ in owners for h in q) == list(range(heads))
    for q, k in owners:
        assert q == list(range(q[0], q[0] + heads // tp))  # contiguous: o_proj's slice
        assert k == sorted({h // group for h in q})        # exactly the KV heads they read
    copies = [sum(h in k for _, k in owners) for h in range(kv)]
    assert copies == [kv_head_replicas(kv, tp)] * kv


@pytest.mark.parametrize("heads,kv,tp,problem", [
    (8, 2, 3, "does not divide the 8 query heads"), (12, 6, 4, "does not divide the 6 KV heads"),
    (6, 2, 3, "not a multiple of the 2 KV heads"), (8, 2, 0, ">= 1"), (8, 2, 2.0, ">= 1"),
    (8, 2, True, ">= 1")])
def test_bad_tp_sizes_are_named(heads, kv, tp, problem):
    with pytest.raises(ValueError, match=problem):
        rank_heads(heads, kv, tp, 0)


def test_kv_bytes_per_rank_with_and_without_replication():
    from paged_lib.accounting import SPECS, kv_bytes

    spec = SPECS["llama-2-70b"]  # 8 KV heads
    for tp in (1, 2, 4, 8):
        assert kv_bytes_per_rank(spec, tp, 1000) * tp == kv_bytes(spec, 1000)
    assert kv_bytes_per_rank(spec, 16, 1000) == kv_bytes_per_rank(spec, 8, 1000)
    assert kv_bytes_per_rank(spec, 8, 1) == 2 * 80 * 128 * 2
    with pytest.raises(ValueError, match="num_tokens"):
        kv_bytes_per_rank(spec, 8, -1)


def test_shards_put_back_together_are_the_weights(shipped):
    cfg, tp = shipped.config, 2
    state = shipped.state_dict()
    shards = [shard_state_dict(state, cfg, tp, r) for r in range(tp)]
    local = TinyLlama(shard_config(cfg, tp))
    for s in shards:
        local.load_state_dict(s)  # the shapes fit one rank's model
    for name, w in state.items():
        parts = [s[name] for s in shards]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, 1), w)
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                            "gate_proj.weight", "up_proj.weight")):
            assert torch.equal(torch.cat(parts, 0), w)
        else:  # embeddings, norms, LM head: every rank has all of it
            assert all(torch.equal(p, w) for p in parts)


# ---------------------------------------------------------------- the engine


def test_two_ranks_give_one_rank_tokens_greedy_sampled_and_beams(shipped, prompts, tp_engine):
    one = LLMEngine(shipped, 48, block_size=8)
    params = [SamplingParams(max_tokens=24, temperature=0.0),
              SamplingParams(max_tokens=16, temperature=0.9,
                                                            n=2, seed=7),
              SamplingParams(max_tokens=10, beam_width=3)]
    want, got = one.generate(prompts, params), tp_engine.generate(prompts, params)
    assert all(len(o.outputs) == k for o, k in zip(got, (1, 2, 3), strict=True))
    assert_same(got, want)
    assert tp_engine.stats.steps == one.stats.steps
    # same block ids on every rank; rank r holds KV head r of each (2 KV heads, 2 ranks)
    block = 3
    shares = tp_engine.runner.kv_block(1, block)
    k_one, v_one = one.runner.kv_caches[1]
    assert torch.allclose(torch.cat([k for k, _ in shares], 1), k_one[block], atol=1e-5,
                          equal_nan=True)
    assert torch.allclose(torch.cat([v for _, v in shares], 1), v_one[block], atol=1e-5,
                          equal_nan=True)
    assert not k_one[block].isnan().all()


def test_kv_bytes_per_rank_on_the_shipped_model(shipped, tp_engine):
    cfg = shipped.config
    tokens_held = tp_engine.num_blocks * tp_engine.block_size
    assert tp_engine.kv_cache_bytes_per_rank == [kv_bytes_per_rank(cfg, 2, tokens_held)] * 2
    one = LLMEngine(shipped, tp_engine.num_blocks, block_size=8)
    assert sum(tp_engine.kv_cache_bytes_per_rank) == one.kv_cache_bytes_per_rank[0]


def test_one_kv_head_is_replicated_and_still_matches(one_kv_head, toy_tp_engine):
    torch.manual_seed(1)
    prompts = [torch.randint(0, 264, (n,)).tolist() for n in (9, 14, 5)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0),
              SamplingParams(max_tokens=10, temperature=1.0, n=2, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=6, beam_width=2, ignore_eos=True)]
    one = toy_engine(one_kv_head, 1)
    want, got = one.generate(prompts, params), toy_tp_engine.generate(prompts, params)
    assert toy_tp_engine.stats.preemptions > 0 and toy_tp_engine.stats.swapped_blocks > 0
    assert_same(got, want)
    # each rank keeps the whole (single) KV head: as much as the single-device engine
    assert toy_tp_engine.kv_cache_bytes_per_rank == one.kv_cache_bytes_per_rank * 2


def test_bad_sizes_and_unsupported_options_raise_before_any_worker_starts(shipped):
    before = len(mp.active_children())
    for tp, problem in [(3, "does not divide the 8 query heads"), (0, ">= 1"), (-2, ">= 1"),
                        (True, ">= 1"), ("2", ">= 1")]:
        with pytest.raises(ValueError, match=problem):
            LLMEngine(shipped, 16, tensor_parallel_size=tp)
    from paged_lib.engine.model_runner import build_metadata

    with pytest.raises(ValueError, match="build_metadata"):
        LLMEngine(shipped, 16, tensor_parallel_size=2,
                  hooks=EngineHooks(build_metadata=lambda *a: build_metadata(*a)))
    with pytest.raises(ValueError, match="num_blocks must be an integer >= 1"):
        LLMEngine(shipped, 0, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not supported"):
        LLMEngine(shipped, 16, tensor_parallel_size=2, kv_cache_dtype="int8")
    assert len(mp.active_children()) == before


def test_ranks_agree_on_the_smallest_pool_and_a_rank_error_surfaces(one_kv_head):
    runner = TensorParallelRunner(one_kv_head, 20, 4, tensor_parallel_size=2,
                                  max_blocks_per_rank=[None, 5], timeout=60)
    try:
        assert runner.num_blocks == 5
        assert runner.kv_cache_bytes_per_rank[0] == runner.kv_cache_bytes_per_rank[1]
        bad = ModelInput()
        assert bad.is_empty() and runner.execute(bad).shape == (0, 264)
        bad.blocks_to_copy = [(0, 99)]  # a block no rank has
        with pytest.raises(RuntimeError, match="rank [01] failed.*\n.*Traceback"):
            runner.execute(bad)
        assert runner.closed and not any(p.is_alive() for p in runner.processes)
        with pytest.raises(RuntimeError, match="closed"):
            runner.execute(bad)
    finally:
        runner.close()


def test_a_killed_rank_stops_the_engine_with_a_clear_error(toy_tp_engine):
    toy_tp_engine.runner.processes[1].kill()
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        toy_tp_engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    assert not any(p.is_alive() for p in toy_tp_engine.runner.processes)


class _ExitedRank:
    """A worker process seen from the driver after it was killed."""

    exitcode = -9

    def is_alive(self) -> bool:
        return False

    def join(self, timeout=None) -> None:
        pass


def test_the_dead_rank_is_named_when_a_survivor_reports_its_broken_collective_first():
    """The race behind a once-in-a-while failure: rank 1 is killed, rank 0's all-reduce
    breaks and rank 0's error reaches the driver first. The error must still name rank 1."""
    import weakref

    runner = TensorParallelRunner.__new__(TensorParallelRunner)
    ours0, theirs0 = mp.Pipe()
    ours1, _theirs1 = mp.Pipe()
    theirs0.send(("error", "RuntimeError: Connection reset by peer (gloo all_reduce)"))
    runner.conns, runner.timeout = [ours0, ours1], 5.0
    runner.processes = [object(), _ExitedRank()]
    runner._finalizer = weakref.finalize(runner, lambda: None)
    with pytest.raises(RuntimeError, match=r"rank 1 exited \(code -9\) during step, so rank "
                                           r"0's collective failed"):
        runner._wait_replies("step")
    alone = TensorParallelRunner.__new__(TensorParallelRunner)  # nobody died: rank 0's words
    a0, b0 = mp.Pipe()
    b0.send(("error", "ValueError: bad step"))
    alone.conns, alone.timeout = [a0], 5.0
    alone.processes = [object()]
    alone._finalizer = weakref.finalize(alone, lambda: None)
    with pytest.raises(RuntimeError, match="rank 0 failed during step(.|\n)*bad step"):
        alone._wait_replies("step")


def test_workers_exit_cleanly_on_close(tp_engine):
    processes = list(tp_engine.runner.processes)
    assert all(p.is_alive() for p in processes)
    tp_engine.close()
    assert [p.exitcode for p in processes] == [0, 0]
    tp_engine.close()  # twice is fine


def test_workers_stop_when_the_engine_is_garbage_collected(one_kv_head):
    engine = LLMEngine(one_kv_head, 8, block_size=4, tensor_parallel_size=2)
    processes = list(engine.runner.processes)
    del engine
    gc.collect()
    assert [p.exitcode for p in processes] == [0, 0]
