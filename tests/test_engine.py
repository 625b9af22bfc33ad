"""LLMEngine end to end against transformers' generate, with ample and with scarce memory.

One random tiny Llama (GQA 6:2) is built once; transformers' greedy continuations of a
few prompts are the reference. The engine's caches start as NaN, so any read of a slot
that was never written would show up in the tokens.
"""

import dataclasses

import pytest
import torch

import paged_lib  # noqa: F401  # isort: split
from paged_lib.engine import LLMEngine, SamplingParams
from paged_lib.engine.hooks import EngineHooks
from paged_lib.engine.model_runner import build_metadata
from paged_lib.engine.scheduler import can_admit
from paged_lib.model import TinyLlama

PROMPT_LENS = (1, 5, 8, 13, 22)
MAX_TOKENS = 10


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf(tiny_hf_llama):
    return tiny_hf_llama


@pytest.fixture(scope="module")
def model(hf):
    return TinyLlama.from_hf(hf)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(hf, prompts):
    """transformers' greedy tokens and the sum of their log-probabilities, per prompt."""
    refs = []
    with torch.no_grad():
        for p in prompts:
            r = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                            output_scores=True, return_dict_in_generate=True, eos_token_id=None,
                            pad_token_id=0)
            tokens = r.sequences[0, len(p):].tolist()
            logprob = sum(float(torch.log_softmax(s[0].float(), -1)[t])
                          for s, t in zip(r.scores, tokens, strict=True))
            refs.append((tokens, logprob))
    return refs


def assert_matches(outs, reference, indices=None):
    for i, out in zip(indices or range(len(outs)), outs, strict=True):
        tokens, logprob = reference[i]
        assert out.error is None, out.error
        assert out.outputs[0].token_ids == tokens, f"prompt {i}"
        assert out.outputs[0].cumulative_logprob == pytest.approx(logprob, abs=1e-4)


def assert_all_free(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == engine.num_blocks, "blocks leaked"
    if bm.cpu is not None:
        assert bm.cpu.num_free == bm.cpu.num_blocks, "CPU blocks leaked"


def test_greedy_equals_transformers_with_ample_blocks(model, prompts, reference):
    engine = LLMEngine(model, num_blocks=64, block_size=4)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.request_id for o in outs] == list(range(len(prompts)))
    assert_matches(outs, reference)
    s = engine.stats
    # everyone is admitted in step 0 and produces one token per step
    assert s.steps == MAX_TOKENS and s.preemptions == 0
    assert s.batch_sizes == [len(prompts)] * MAX_TOKENS
    assert s.step_kinds == ["prefill"] + ["decode"] * (MAX_TOKENS - 1)
    assert s.computed_tokens[0] == sum(PROMPT_LENS)
    # blocks held after step k: the prompt plus k earlier generated tokens, per sequence
    want = [sum(-(-(n + k) // 4) for n in PROMPT_LENS) for k in range(MAX_TOKENS)]
    assert s.blocks_used == want and s.peak_blocks_used == want[-1]
    assert all(t.finished_step == MAX_TOKENS - 1 for t in s.requests)
    assert_all_free(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_is_invisible_in_the_output(model, prompts, reference, mode):
    # 12 blocks of 4: the longest request needs 8 alone, all five together need 27
    engine = LLMEngine(model, num_blocks=12, block_size=4, preemption=mode,
                       num_cpu_blocks=32 if mode == "swap" else 0, watermark=0.0)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert_matches(outs, reference)
    s = engine.stats
    assert s.preemptions > 0
    assert max(s.blocks_used) <= 12
    if mode == "swap":
        assert s.swapped_blocks > 0 and s.recomputed_tokens == 0
    else:
        assert s.recomputed_tokens > 0 and s.swapped_blocks == 0
    assert any(t.preempted_steps for t in s.requests)
    assert_all_free(engine)


def test_triton_backend_gives_the_same_tokens(model, prompts, reference):
    engine = LLMEngine(model, num_blocks=16, block_size=4, attention_backend="triton")
    outs = engine.generate(prompts[1:3], SamplingParams(max_tokens=3, temperature=0.0))
    for i, out in zip((1, 2), outs, strict=True):
        assert out.outputs[0].token_ids == reference[i][0][:3]


def test_eos_stops_a_request_unless_ignored(hf, prompts, reference):
    eos = reference[3][0][4]  # the 5th token of prompt 3 becomes the end of sequence
    model = TinyLlama.from_hf(hf)
    model.config = dataclasses.replace(model.config, eos_token_id=eos)
    outs = LLMEngine(model, 64, 4).generate([prompts[3]],
                                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    stop = reference[3][0].index(eos)
    assert outs[0].outputs[0].token_ids == reference[3][0][:stop + 1]
    outs = LLMEngine(model, 64, 4).generate([prompts[3]],
                                            SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                           temperature=0.0))
    assert outs[0].outputs[0].token_ids == reference[3][0]


@pytest.mark.parametrize("bad, match", [
    ([[3], [], [4]], "request 1: the prompt is empty"),
    ([[3], [4, 97], [4]], r"request 1: token 97 at position 1"),
    ([[3], [4, -1], [4]], r"request 1: token -1"),
])
def test_bad_prompt_names_the_request(model, bad, match):
    engine = LLMEngine(model, 16, 4)
    with pytest.raises(ValueError, match=match):
        engine.generate(bad, SamplingParams(max_tokens=3, temperature=0.0))
    assert engine.stats.steps == 0 and engine.block_manager.num_free_blocks == 16


def test_bad_params_name_the_request(model):
    engine = LLMEngine(model, 16, 4)
    params = [SamplingParams(max_tokens=3, temperature=0.0),
              SamplingParams(max_tokens=3, temperature=0.0),
              SamplingParams(max_tokens=3, temperature=0.0, stop_token_ids=[999])]
    with pytest.raises(ValueError, match=r"request 2: stop_token_ids \[999\] are not ids"):
        engine.generate([[1], [2], [3]], params)
    with pytest.raises(ValueError, match="2 prompts but 3"):
        engine.generate([[1], [2]], params)


def test_a_request_that_can_never_fit_fails_alone(model, prompts, reference):
    engine = LLMEngine(model, num_blocks=10, block_size=4, watermark=0.0)
    huge = list(range(50))  # 50 + 10 tokens need 15 blocks: more than the whole pool
    outs = engine.generate([prompts[0], huge, prompts[2]],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert outs[1].outputs == [] and "can never run" in outs[1].error
    assert "15 blocks" in outs[1].error
    assert_matches([outs[0], outs[2]], reference, indices=[0, 2])
    assert_all_free(engine)


def test_seeded_sampling_repeats_and_ignores_the_batch(model, prompts):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    alone = LLMEngine(model, 64, 4).generate([prompts[2]], params)[0].outputs[0].token_ids
    mixed = LLMEngine(model, 64, 4).generate(
        [prompts[0], prompts[2]], [SamplingParams(max_tokens=8, temperature=0.8, seed=1), params])
    assert mixed[1].outputs[0].token_ids == alone
    other = LLMEngine(model, 64, 4).generate([prompts[2]],
                                             SamplingParams(max_tokens=8, temperature=1.0, seed=8))
    assert other[0].outputs[0].token_ids != alone


def test_parallel_samples_share_the_prompt_blocks(model):
    prompt = list(range(1, 65))  # 64 tokens: 16 full blocks of 4
    params = SamplingParams(max_tokens=32, temperature=1.0, n=4, seed=3)
    engine = LLMEngine(model, 128, 4, watermark=0.0)
    out = engine.generate([prompt], params)[0]
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 32 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4, "samples should differ"
    unshared = 4 * -(-(64 + 31) // 4)
    assert engine.stats.peak_blocks_used <= 0.75 * unshared
    again = LLMEngine(model, 128, 4).generate([prompt], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_all_free(engine)


def test_teaching_hooks_are_used(model, prompts, reference):
    calls = {"meta": 0, "admit": 0}

    def my_build_metadata(*args):
        calls["meta"] += 1
        return build_metadata(*args)

    def my_can_admit(*args):
        calls["admit"] += 1
        return can_admit(*args)

    engine = LLMEngine(model, 64, 4, hooks=EngineHooks(build_metadata=my_build_metadata,
                                                     can_admit=my_can_admit))
    assert_matches(engine.generate(prompts[:2], SamplingParams(max_tokens=MAX_TOKENS,
                                                               temperature=0.0)),
                   reference, [0, 1])
    assert calls["meta"] == MAX_TOKENS and calls["admit"] >= 2


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full(model, prompts, reference):
    engine = LLMEngine(model, num_blocks=12, block_size=4, preemption="swap",
                       num_cpu_blocks=4, watermark=0.0)  # room for one victim of two
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert_matches(outs, reference)
    s = engine.stats
    assert s.swapped_blocks > 0 and s.recomputed_tokens > 0  # both kinds happened
    assert_all_free(engine)
    # and the same engine serves a second batch from a clean state
    assert_matches(engine.generate(prompts[:2], SamplingParams(max_tokens=MAX_TOKENS,
                                                               temperature=0.0)),
                   reference, [0, 1])
    assert engine.stats.requests[0].arrival_step == 0 and engine.stats.steps == MAX_TOKENS


@pytest.mark.parametrize("mistake, match", [
    ("first block only", "block table row"),
    ("int32 slots", "slot_mapping must be a torch.int64"),
    ("slot past the pool", "slots outside"),
])
def test_a_wrong_build_metadata_gets_a_clear_error(model, prompts, mistake, match):
    def wrong(tables, seq_lens, query_lens, block_size):
        meta = build_metadata(tables, seq_lens, query_lens, block_size)
        if mistake == "first block only":
            meta.block_tables = meta.block_tables[:, :1]
        if mistake == "int32 slots":
            meta.slot_mapping = meta.slot_mapping.int()
        if mistake == "slot past the pool":
            meta.slot_mapping[-1] = 10**6
        return meta

    engine = LLMEngine(model, 64, 4, hooks=EngineHooks(build_metadata=wrong))
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts[3:4], SamplingParams(max_tokens=3, temperature=0.0))


@pytest.mark.parametrize("mode, num_blocks", [("recompute", 64), ("recompute", 12), ("swap", 12)])
def test_prefill_first_gives_the_same_tokens_in_pure_steps(model, prompts, reference, mode,
                                                           num_blocks):
    arrivals = [0, 1, 1, 3, 6]  # requests join while others decode
    kw = dict(preemption=mode, num_cpu_blocks=32 if mode == "swap" else 0, watermark=0.0)
    runs = {}
    for scheduling in ("mixed", "prefill_first"):
        engine = LLMEngine(model, num_blocks, 4, scheduling=scheduling, **kw)
        outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                               arrival_steps=arrivals)
        assert_matches(outs, reference)
        assert_all_free(engine)
        runs[scheduling] = engine.stats
    mixed, first = runs["mixed"], runs["prefill_first"]
    assert "mixed" in mixed.step_kinds and "mixed" not in first.step_kinds
    for s in (mixed, first):
        assert [p + d for p, d in zip(s.prefill_seqs, s.decode_seqs, strict=True)] == s.batch_sizes
        assert len(s.step_seconds) == s.steps and all(t >= 0 for t in s.step_seconds)
        assert all(k != "prefill" or d == 0 for k, d in zip(s.step_kinds, s.decode_seqs,
                                                           strict=True))
    # a prefill step makes the running requests skip a step: more steps per output token
    if num_blocks == 64:
        assert mixed.time_per_output_token(in_steps=True) == [1.0] * len(prompts)
        assert max(first.time_per_output_token(in_steps=True)) > 1.0


@pytest.mark.parametrize("prompts, params, arrivals, match", [
    ([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0), None, "got a list of ints"),
    ([[1], "hello"], SamplingParams(max_tokens=3, temperature=0.0), None,
     "request 1: a prompt is a list of token ids"),
    ([[1], 5], SamplingParams(max_tokens=3, temperature=0.0), None,
     "request 1: a prompt is a list of token ids, got int"),
    ([[1], [True]], SamplingParams(max_tokens=3, temperature=0.0), None,
     "request 1: token True at position 0"),
    ([[1], [2.0]], SamplingParams(max_tokens=3, temperature=0.0), None,
     "request 1: token 2.0 at position 0"),
    ([[1], [2]], SamplingParams(max_tokens=3, temperature=0.0), [0, True],
     "request 1: arrival step"),
    ([[1], [2]], [SamplingParams(max_tokens=3, temperature=0.0), "greedy"], [0, 9],
     "request 1: params must be"),
])
def test_malformed_input_raises_before_anything_runs(model, prompts, params, arrivals, match):
    engine = LLMEngine(model, 16, 4)
    engine.generate([[1, 2]], SamplingParams(max_tokens=2, temperature=0.0))
    before = engine.stats
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, params, arrival_steps=arrivals)
    # nothing ran and nothing was lost: the last run's stats stand, every block is free
    assert engine.stats is before and engine.block_manager.num_free_blocks == 16
    assert not engine.scheduler.has_unfinished()


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=True), "max_tokens"),
    (dict(temperature="0.5"), "temperature must be a number"),
    (dict(temperature=float("nan")), "temperature"), (dict(seed="7"), "seed"),
    (dict(ignore_eos=1), "ignore_eos")])
def test_malformed_params_raise_when_built(kwargs, match):
    """As vLLM's SamplingParams: checked when built, before any engine sees them."""
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{"max_tokens": 3, "temperature": 0.0, **kwargs})


def test_integer_prompts_of_numpy_or_torch_are_welcome(model, prompts, reference):
    import numpy as np

    engine = LLMEngine(model, 64, 4)
    outs = engine.generate([np.array(prompts[1]), torch.tensor(prompts[2])],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert_matches(outs, reference, [1, 2])


def test_a_well_formed_request_that_never_fits_fails_alone_even_late(model, prompts, reference):
    engine = LLMEngine(model, num_blocks=10, block_size=4, watermark=0.0)
    outs = engine.generate([prompts[0], list(range(50)), prompts[2]],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                           arrival_steps=[0, 3, 5])
    assert outs[1].outputs == [] and "can never run" in outs[1].error
    assert_matches([outs[0], outs[2]], reference, indices=[0, 2])
    assert_all_free(engine)


def test_the_group_hooks_are_used_by_the_engine(model, prompts, reference):
    from paged_lib.engine import choose_victim, num_required_blocks

    calls = {"blocks": 0, "victim": 0}

    def my_blocks(group, block_size):
        calls["blocks"] += 1
        return num_required_blocks(group, block_size)

    def my_victim(running):
        calls["victim"] += 1
        return choose_victim(running)

    engine = LLMEngine(model, 12, 4, watermark=0.0,
                       hooks=EngineHooks(num_required_blocks=my_blocks, choose_victim=my_victim))
    assert_matches(engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)),
                   reference)
    assert calls["blocks"] >= len(prompts) and calls["victim"] == engine.stats.preemptions > 0
