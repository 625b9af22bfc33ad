"""Beam search over shared block tables, against transformers' beam search."""

import pytest
import torch

import paged_lib  # noqa: F401  # isort: split
from paged_lib.blocks import BlockAllocator, BlockTable
from paged_lib.engine import LLMEngine, SamplingParams
from paged_lib.engine.beam_search import beam_step
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
    outs = engine.generate(prompts, SamplingParams(MAX_TOKENS, beam_width=WIDTH))
    check(outs, reference)
    assert (engine.stats.preemptions > 0) == (num_blocks < 64)
    assert engine.block_manager.num_free_blocks == num_blocks


def test_beams_share_blocks(hf, prompts):
    model = TinyLlama.from_hf(hf)
    engine = LLMEngine(model, 64, block_size=4)
    engine.generate([prompts[2]], SamplingParams(MAX_TOKENS, beam_width=WIDTH))
    alone = -(-(13 + MAX_TOKENS - 1) // 4)  # one beam's blocks at its longest
    assert engine.stats.peak_blocks_used < WIDTH * alone


def test_a_replacement_beam_step_is_used(hf, prompts, reference):
    calls = []

    def my_beam_step(*args):
        calls.append(1)
        return beam_step(*args)

    engine = LLMEngine(TinyLlama.from_hf(hf), 64, 4, beam_step=my_beam_step)
    check(engine.generate(prompts[:1], SamplingParams(MAX_TOKENS, beam_width=WIDTH)),
          reference[:1])
    assert len(calls) == MAX_TOKENS


def test_a_beam_step_that_forgets_to_free_is_caught_as_a_leak(hf, prompts):
    def leaky(tables, cums, candidates, width):
        keep = beam_step([t.fork() for t in tables], cums, candidates, width)
        return keep  # the original tables are never freed

    engine = LLMEngine(TinyLlama.from_hf(hf), 64, 4, beam_step=leaky)
    engine.generate(prompts[:1], SamplingParams(3, beam_width=2))
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
    out = engine.generate([prompts[1]], SamplingParams(3, beam_width=2))[0]
    torch_engine = LLMEngine(TinyLlama.from_hf(hf), 32, 4)
    want = torch_engine.generate([prompts[1]], SamplingParams(3, beam_width=2))[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs]
    assert engine.block_manager.num_free_blocks == 32
