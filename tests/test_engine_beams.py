"""Beam search over shared block tables, against transformers' beam search."""

import collections
import dataclasses

import pytest
import torch

import paged_lib  # noqa: F401  # isort: split
from paged_lib.blocks import BlockAllocator, BlockTable
from paged_lib.engine import LLMEngine, SamplingParams
from paged_lib.engine.beam_search import beam_step, split_candidates
from paged_lib.engine.hooks import EngineHooks
from paged_lib.model import TinyLlama

WIDTH, MAX_TOKENS = 4, 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf(tiny_hf_llama):
    return tiny_hf_llama


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in (1, 6, 13)]


@pytest.fixture(scope="module")
def reference(hf, prompts):
    """transformers' beams (best first) and their summed log-probabilities."""
    refs = []
    with torch.no_grad():
        for p in prompts:
            r = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, num_beams=WIDTH,
                            num_return_sequences=WIDTH, do_sample=False, length_penalty=1.0,
                            early_stopping=False, eos_token_id=None, pad_token_id=0,
                            output_scores=True, return_dict_in_generate=True)
            # with length_penalty 1, a beam's score is its log-probability / its length
            refs.append(([s[len(p):].tolist() for s in r.sequences],
                         (r.sequences_scores * MAX_TOKENS).tolist()))
    return refs


def check(outs, reference):
    for out, (beams, scores) in zip(outs, reference, strict=True):
        assert [c.token_ids for c in out.outputs] == beams
        assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(scores, abs=1e-4)


@pytest.mark.parametrize("mode, num_blocks", [("recompute", 64), ("recompute", 20),
                                              ("swap", 20)])
def test_beams_equal_transformers(hf, prompts, reference, mode, num_blocks):
    model = TinyLlama.from_hf(hf)
    engine = LLMEngine(model, num_blocks, block_size=4, preemption=mode, watermark=0.0,
                       num_cpu_blocks=64 if mode == "swap" else 0)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, beam_width=WIDTH))
    check(outs, reference)
    assert (engine.stats.preemptions > 0) == (num_blocks < 64)
    assert engine.block_manager.num_free_blocks == num_blocks


def test_beams_share_blocks(hf, prompts):
    model = TinyLlama.from_hf(hf)
    engine = LLMEngine(model, 64, block_size=4)
    engine.generate([prompts[2]], SamplingParams(max_tokens=MAX_TOKENS, beam_width=WIDTH))
    alone = -(-(13 + MAX_TOKENS - 1) // 4)  # one beam's blocks at its longest
    assert engine.stats.peak_blocks_used < WIDTH * alone


def test_a_replacement_beam_step_is_used(hf, prompts, reference):
    calls = []

    def my_beam_step(*args):
        calls.append(1)
        return beam_step(*args)

    engine = LLMEngine(TinyLlama.from_hf(hf), 64, 4, hooks=EngineHooks(beam_step=my_beam_step))
    check(engine.generate(prompts[:1], SamplingParams(max_tokens=MAX_TOKENS, beam_width=WIDTH)),
          reference[:1])
    assert len(calls) == MAX_TOKENS  # every step, the last one too


def test_a_beam_step_that_forgets_to_free_is_caught_as_a_leak(hf, prompts):
    def leaky(tables, cums, candidates, width):
        keep = beam_step([t.fork() for t in tables], cums, candidates, width)
        return keep  # the original tables are never freed

    engine = LLMEngine(TinyLlama.from_hf(hf), 64, 4, hooks=EngineHooks(beam_step=leaky))
    engine.generate(prompts[:1], SamplingParams(max_tokens=3, beam_width=2))
    assert engine.block_manager.num_free_blocks < 64


def test_beam_step_forks_the_chosen_and_frees_the_dead():
    alloc = BlockAllocator(10)
    a, b = BlockTable(alloc, 4), BlockTable(alloc, 4)
    for _ in range(5):
        a.append_token()
    for _ in range(2):
        b.append_token()
    new = beam_step([a, b], [-1.0, -2.0], [[(5, -0.1), (6, -0.5)], [(7, -0.2)]], 2)
    assert [(p, tok, round(c, 6)) for p, _, tok, c in new] == [(0, 5, -1.1), (0, 6, -1.5)]
    assert new[0][1] is a and new[1][1].blocks == a.blocks
    assert all(alloc.refcount(blk) == 2 for blk in a.blocks)
    assert alloc.num_free == 10 - 2  # b's block went back


def test_triton_backend_beams_and_copy_on_write(hf, prompts, reference):
    """Beams fork and copy part-filled blocks with the Triton copy_blocks kernel too."""
    engine = LLMEngine(TinyLlama.from_hf(hf), 32, 4, attention_backend="triton")
    out = engine.generate([prompts[1]], SamplingParams(max_tokens=3, beam_width=2))[0]
    torch_engine = LLMEngine(TinyLlama.from_hf(hf), 32, 4)
    want = torch_engine.generate([prompts[1]], SamplingParams(max_tokens=3, beam_width=2))[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs]
    assert engine.block_manager.num_free_blocks == 32


# ------------------------------------------------------------------ beams that end at EOS

EOS_MAX_TOKENS = 10


def hf_beams(hf, prompt, width, eos, early_stopping=True, length_penalty=1.0):
    """transformers' returned beams, cut after their EOS (it pads them), with their summed
    log-probabilities (its score times length ** length_penalty)."""
    with torch.no_grad():
        r = hf.generate(torch.tensor([prompt]), max_new_tokens=EOS_MAX_TOKENS, num_beams=width,
                        num_return_sequences=width, do_sample=False,
                        length_penalty=length_penalty, early_stopping=early_stopping,
                        eos_token_id=eos, pad_token_id=0, output_scores=True,
                        return_dict_in_generate=True)
    beams, cums = [], []
    for seq, score in zip(r.sequences, r.sequences_scores, strict=True):
        tokens = seq[len(prompt):].tolist()
        if eos is not None and eos in tokens:
            tokens = tokens[:tokens.index(eos) + 1]
        beams.append(tokens)
        cums.append(float(score) * len(tokens) ** length_penalty)
    return beams, cums


@pytest.fixture(scope="module")
def eos(hf, prompts):
    """A token the beams emit early: with it as EOS, beams really end."""
    early = collections.Counter(t for p in prompts for w in (2, 4)
                                for beam in hf_beams(hf, p, w, None)[0] for t in beam[:3])
    return early.most_common(1)[0][0]


@pytest.fixture(scope="module")
def eos_model(hf, eos):
    model = TinyLlama.from_hf(hf)
    model.config = dataclasses.replace(model.config, eos_token_id=eos)
    return model


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("early_stopping, length_penalty", [
    (True, 1.0), (False, 1.0), ("never", 2.0), (True, 0.0), (False, -0.5)])
def test_beams_that_end_at_eos_equal_transformers(hf, prompts, eos, eos_model, width,
                                                  early_stopping, length_penalty):
    params = SamplingParams(max_tokens=EOS_MAX_TOKENS, beam_width=width,
                            early_stopping=early_stopping,
                            length_penalty=length_penalty)
    engine = LLMEngine(eos_model, 64, 4)
    outs = engine.generate(prompts, params)
    refs = [hf_beams(hf, p, width, eos, early_stopping, length_penalty) for p in prompts]
    check(outs, refs)
    assert engine.block_manager.num_free_blocks == 64
    if (early_stopping, length_penalty) == (True, 1.0):
        ended = [c for o in outs for c in o.outputs if c.token_ids[-1] == eos]
        assert ended, "the test needs beams that end at EOS"
        assert all(len(c.token_ids) < EOS_MAX_TOKENS for c in ended)  # EOS included


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beams_that_end_survive_preemption(hf, prompts, eos, eos_model, mode):
    engine = LLMEngine(eos_model, 20, 4, preemption=mode, watermark=0.0,
                       num_cpu_blocks=64 if mode == "swap" else 0)
    outs = engine.generate(prompts, SamplingParams(max_tokens=EOS_MAX_TOKENS, beam_width=WIDTH,
                                                   early_stopping=True))
    check(outs, [hf_beams(hf, p, WIDTH, eos) for p in prompts])
    assert engine.stats.preemptions > 0
    assert engine.block_manager.num_free_blocks == 20


def test_early_stopping_ends_the_search_when_width_hypotheses_are_done(hf, prompts, eos,
                                                                       eos_model):
    params = SamplingParams(max_tokens=EOS_MAX_TOKENS, beam_width=2, early_stopping=True)
    steps = []
    for p in prompts:
        engine = LLMEngine(eos_model, 64, 4)
        out = engine.generate([p], params)[0]
        if all(c.token_ids[-1] == eos for c in out.outputs):  # both ended before the limit
            steps.append(engine.stats.steps)
            assert engine.stats.steps == max(len(c.token_ids) for c in out.outputs)
    assert steps and min(steps) < EOS_MAX_TOKENS


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=4, length_penalty=2.0, temperature=0.0), "only apply to beam search"),
    (dict(max_tokens=4, temperature=1.0, n=2, early_stopping=True),
     "only apply to beam search"),
    (dict(max_tokens=4, beam_width=2, early_stopping="sometimes"), "early_stopping must be"),
    (dict(max_tokens=4, beam_width=2, length_penalty=float("nan")), "length_penalty must be"),
])
def test_beam_options_are_checked(kwargs, match):
    """Refused when SamplingParams is built (as vLLM checks its own values)."""
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_split_candidates_ends_eos_only_among_the_best_width():
    # beam 0 at -1.0, beam 1 at -2.0; EOS is token 9; width 2 keeps the best 4
    cands = [[(9, -0.1), (5, -0.2), (6, -3.0)], [(9, -0.05), (7, -0.3)]]
    ended, going_on = split_candidates([-1.0, -2.0], cands, 2, eos_token_id=9)
    # sorted: (0,9) -1.1, (0,5) -1.2, (1,9) -2.05, (1,7) -2.3, (0,6) -4.0
    assert ended == [(0, 9, pytest.approx(-1.1))]  # (1, 9) is 3rd: not among the best 2
    assert going_on == [[(5, -0.2), (6, -3.0)], [(7, -0.3)]]  # each beam's best 2 non-EOS
    ended, going_on = split_candidates([-1.0, -2.0], cands, 2, eos_token_id=None)
    assert ended == [] and going_on == [[(9, -0.1), (5, -0.2)], [(9, -0.05), (7, -0.3)]]
