"""Chunked prefill (chapter 10): long texts computed over several steps, beside decodes.

The tiny model's greedy tokens must be transformers' whatever the chunking (each chunk
attends to the chunks before it through the NaN-initialised cache, so a chunk that read
a slot not yet written would show); the token budget holds every step; nothing is
sampled before a text's last chunk; decodes come first, then chunks.
"""

import pytest
import torch

import paged_lib  # noqa: F401  # isort: split
from paged_lib.engine import LLMEngine, SamplingParams

PROMPT_LENS = (1, 5, 8, 13, 22, 30)
NEW = 6
POOL = 14

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(tiny_hf_llama, prompts, greedy_reference):
    return greedy_reference(tiny_hf_llama, prompts, NEW)


def record(engine):
    """Every step's scheduled (request, is_prefill, query_len, end, text length, sample)."""
    steps, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append([(s.group.request_id, s.is_prefill, s.num_new_tokens,
                       s.seq.num_cached + s.num_new_tokens, s.seq.num_tokens, s.sample)
                      for s in out.scheduled])
        return out

    engine.scheduler.schedule = recording
    return steps


@pytest.mark.parametrize("budget", [4, 7, 12])
def test_chunked_prefill_gives_transformers_tokens_within_the_budget(model, prompts,
                                                                     reference, budget):
    engine = LLMEngine(model, 64, 4, enable_chunked_prefill=True,
                       max_num_batched_tokens=budget, max_num_seqs=budget)
    steps = record(engine)
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0),
                           arrival_steps=[0, 0, 1, 2, 2, 3])
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert max(engine.stats.computed_tokens) <= budget
    assert engine.block_manager.num_free_blocks == 64
    chunks = [e for step in steps for e in step if e[1] and not e[5]]
    assert chunks, "some prompt was split"
    for step in steps:
        for _req, prefill, _q, end, length, sample in step:
            if prefill:
                assert sample == (end == length)  # nothing drawn before the last chunk
        kinds = [e[1] for e in step]
        assert kinds == sorted(kinds), "decodes first, then chunks"
    # the 30-token prompt, arriving at step 3, is computed in budget-sized pieces
    pieces = [e[2] for step in steps for e in step if e[0] == 5 and e[1]]
    assert sum(pieces) == 30 and len(pieces) >= -(-30 // budget)


def test_without_chunking_the_budget_must_hold_the_longest_request(model, prompts):
    """vLLM's SchedulerConfig: with chunked prefill off, max_num_batched_tokens below
    max_model_len is refused (a longer text could never run in one step); lowering
    max_model_len makes longer requests fail alone, with vLLM's message."""
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(7\) is smaller than "
                                         r"max_model_len \(256\)"):
        LLMEngine(model, 64, 4, max_num_batched_tokens=7, max_num_seqs=7)
    off = LLMEngine(model, 64, 4, max_num_batched_tokens=20, max_num_seqs=8, max_model_len=20)
    on = LLMEngine(model, 64, 4, max_num_batched_tokens=7, max_num_seqs=7,
                   enable_chunked_prefill=True)
    a = off.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0))
    b = on.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0))
    for p, x, y in zip(prompts, a, b, strict=True):
        if len(p) + NEW > 20:
            assert x.error.startswith("This model's maximum context length is 20 tokens. "
                                      f"However, you requested {len(p) + NEW} tokens "
                                      f"({len(p)} in the prompt, {NEW} in the completion)")
        else:
            assert x.error is None and x.outputs[0].token_ids == y.outputs[0].token_ids
    assert max(off.stats.computed_tokens) <= 20 and max(on.stats.computed_tokens) <= 7


def test_chunked_prefill_needs_mixed_scheduling(model):
    with pytest.raises(ValueError, match="scheduling='mixed'"):
        LLMEngine(model, 16, 4, enable_chunked_prefill=True, scheduling="prefill_first")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_chunks_caching_preemption_and_sharing_mixed_give_the_same_tokens(model, mode):
    """Seeded random workloads: n > 1 samples, beams and greedy over shared prefixes, a
    pool small enough to preempt, prefix caching and chunked prefill on; the tokens are
    those of the plain engine with ample memory, and every block is free at the end."""
    g = torch.Generator().manual_seed(21 if mode == "swap" else 22)
    for trial in range(2):
        prefixes = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (12, 17)]
        prompts, params = [], []
        for i in range(6):
            suffix = torch.randint(0, 97, (int(torch.randint(1, 9, (1,), generator=g)),),
                                   generator=g).tolist()
            prompts.append(prefixes[i % 2] + suffix)
            kind = (i + trial) % 3
            params.append(SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=i) if kind == 0
                          else SamplingParams(max_tokens=6, beam_width=2) if kind == 1
                          else SamplingParams(max_tokens=9, temperature=0.0))
        arrivals = sorted(int(x) for x in torch.randint(0, 8, (6,), generator=g))
        want = LLMEngine(model, 256, 4).generate(prompts, params, arrival_steps=arrivals)
        engine = LLMEngine(model, POOL, 4, preemption=mode, watermark=0,
                           num_cpu_blocks=64 if mode == "swap" else 0,
                           enable_prefix_caching=True, enable_chunked_prefill=True,
                           max_num_batched_tokens=10, max_num_seqs=10)
        got = engine.generate(prompts, params, arrival_steps=arrivals)
        s = engine.stats
        assert s.preemptions > 0 and s.prefix_cache_hit_tokens > 0, (trial, s.summary())
        for w, o in zip(want, got, strict=True):
            assert [c.token_ids for c in o.outputs] == [c.token_ids for c in w.outputs]
        gpu = engine.block_manager.gpu
        assert gpu.num_free == POOL and sorted(gpu.free_block_queue) == list(range(POOL))
        if mode == "swap":
            assert engine.block_manager.cpu.num_free == 64


def test_the_triton_backend_reads_chunks_and_cached_blocks(model, prompts, reference):
    """Both chapter 10 paths on the triton kernels: a prefix hit and chunks over a cache."""
    engine = LLMEngine(model, 32, 4, attention_backend="triton", enable_prefix_caching=True,
                       enable_chunked_prefill=True, max_num_batched_tokens=8,
                       max_num_seqs=8)
    texts = [prompts[4], prompts[4][:20] + prompts[5][:6]]  # 20 shared tokens: 4 blocks hit
    outs = engine.generate(texts, SamplingParams(max_tokens=3, temperature=0.0),
                           arrival_steps=[0, 6])
    assert outs[0].outputs[0].token_ids == reference[4][:3]
    assert engine.stats.prefix_cache_hit_tokens == 20
    plain = LLMEngine(model, 32, 4).generate(texts, SamplingParams(max_tokens=3, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert engine.block_manager.num_free_blocks == 32
