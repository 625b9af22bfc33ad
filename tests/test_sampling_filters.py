"""top_k and top_p: the same tokens as transformers' samplers, token for token.

transformers' ``generate(do_sample=True)`` divides the logits by the temperature, applies
``TopKLogitsWarper`` then ``TopPLogitsWarper`` and draws with ``torch.multinomial`` from
the global generator; seeding that with the request's seed must give the engine's
tokens, each request alone or in a batch with others.
"""

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from paged_lib.engine import LLMEngine, SamplingParams
from paged_lib.engine.sampler import apply_top_k_top_p

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 12
PROMPTS = [[5, 17, 42], [3, 9, 11, 60, 2, 8, 71], [88]]


def hf_sample(hf, prompt, seed, temperature, top_k, top_p, max_new_tokens=MAX_TOKENS):
    torch.manual_seed(seed)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=True, temperature=temperature,
                          top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_the_filter_drops_what_transformers_warpers_drop():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        logits = torch.randn(3, 97, generator=g) * 3
        logits[0, :5] = logits[0, 5]  # ties at the k-th value stay, as in transformers
        k = int(torch.randint(0, 30, (1,), generator=g))
        p = float(torch.rand(1, generator=g)) * 0.999 + 0.001
        ref = TopPLogitsWarper(p)(None, TopKLogitsWarper(k)(None, logits.clone()) if k
                                  else logits.clone())
        got = apply_top_k_top_p(logits, k, p)
        assert torch.equal(torch.isinf(got), torch.isinf(ref)), (k, p)
        assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])


def test_the_filter_keeps_the_most_likely_token_and_leaves_its_input():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9]])
    before = logits.clone()
    assert torch.isinf(apply_top_k_top_p(logits, 0, 1e-9)).tolist() == [[True, False, True,
                                                                        True]]
    assert torch.isinf(apply_top_k_top_p(logits, 2, 1.0)).tolist() == [[True, False, True,
                                                                        False]]
    assert torch.equal(logits, before)
    assert torch.equal(apply_top_k_top_p(logits, 0, 1.0), logits)
    assert torch.equal(apply_top_k_top_p(logits, -1, 1.0), logits)


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0),    # filters off: plain sampling
    (0.8, 10, 1.0),   # top-k only
    (1.0, 0, 0.6),    # top-p only
    (1.3, 20, 0.8),   # both, k first
    (0.7, 5, 0.5),
])
def test_engine_samples_equal_transformers(tiny_hf_llama, tiny_model, temperature, top_k,
                                           top_p):
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, top_k=top_k,
                             top_p=top_p,
                             seed=s) for s in (0, 1, 2)]
    want = [hf_sample(tiny_hf_llama, p, sp.seed, temperature, top_k, top_p)
            for p, sp in zip(PROMPTS, params, strict=True)]
    if top_k > 0 or top_p < 1:  # the filter matters here: unfiltered samples differ
        assert want != [hf_sample(tiny_hf_llama, p, sp.seed, temperature, 0, 1.0)
                        for p, sp in zip(PROMPTS, params, strict=True)]
    batch = LLMEngine(tiny_model, 64, 4).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in batch] == want
    alone = LLMEngine(tiny_model, 64, 4).generate([PROMPTS[1]], params[1])
    assert alone[0].outputs[0].token_ids == want[1]


def test_engine_samples_equal_transformers_under_preemption(tiny_hf_llama, tiny_model):
    """A request preempted by recompute draws each token once: still transformers' tokens."""
    params = [SamplingParams(max_tokens=16, temperature=1.0, top_k=15, top_p=0.9, seed=s)
              for s in range(3)]
    engine = LLMEngine(tiny_model, num_blocks=10, block_size=4, watermark=0.0)
    got = engine.generate(PROMPTS, params)
    assert engine.stats.preemptions > 0
    want = [hf_sample(tiny_hf_llama, p, s, 1.0, 15, 0.9, 16) for s, p in enumerate(PROMPTS)]
    assert [o.outputs[0].token_ids for o in got] == want


def test_filters_off_leave_samples_unchanged(tiny_model):
    base = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=4)
    outs = [LLMEngine(tiny_model, 64, 4).generate(PROMPTS, sp)
            for sp in (base,
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=4, top_k=-1),
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=4, top_k=97,
                                      top_p=1.0))]
    tokens = [[o.outputs[0].token_ids for o in out] for out in outs]
    assert tokens[0] == tokens[1] == tokens[2]


def test_top_k_1_and_a_tiny_top_p_are_greedy(tiny_hf_llama, tiny_model, greedy_reference):
    want = greedy_reference(tiny_hf_llama, PROMPTS, MAX_TOKENS)
    for sp in (SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5, top_k=1, seed=0),
               SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5, top_p=1e-6, seed=0)):
        got = LLMEngine(tiny_model, 64, 4).generate(PROMPTS, sp)
        assert [o.outputs[0].token_ids for o in got] == want


def test_top_k_samples_stay_among_the_k_most_likely(tiny_model, monkeypatch):
    """Parallel samples (n=4) with top_k=2: every drawn token is one of its step's two
    most likely, checked against the model's own logits."""
    import paged_lib.engine.llm_engine as llm_engine

    seen, real = [], llm_engine.sample

    def spy(logits, out, *rest):
        result = real(logits, out, *rest)
        for row, drawn in enumerate(result):
            top2 = set(torch.topk(logits[row], 2).indices.tolist())
            seen.append(all(t in top2 for t, _ in drawn))
        return result

    monkeypatch.setattr(llm_engine, "sample", spy)
    out = LLMEngine(tiny_model, 64, 4).generate(
        [PROMPTS[0]], SamplingParams(max_tokens=10, temperature=2.0, n=4, top_k=2, seed=1))
    assert len(out[0].outputs) == 4 and len(seen) >= 10 and all(seen)


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0."),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5."),
    (dict(top_p=float("nan")), "top_p must be a number"),
    (dict(top_p="0.9"), "top_p must be a number"),
    (dict(top_k=-2), "top_k must be 0 (disable), or at least 1, got -2."),
    (dict(top_k=2.5), "top_k must be an int, got 2.5"),
    (dict(top_k=True), "top_k must be an int"),
    (dict(beam_width=2, top_k=5), "beam search ranks beams by"),
    (dict(beam_width=2, top_p=0.9), "beam search ranks beams by"),
])
def test_bad_filters_are_a_value_error_naming_them(kwargs, message):
    """As vLLM (tests/test_sampling_params.py): refused when SamplingParams is built."""
    with pytest.raises(ValueError) as err:
        SamplingParams(max_tokens=4, temperature=1.0, **kwargs)
    assert message in str(err.value)

