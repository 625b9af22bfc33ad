"""vLLM's sampling options and outputs, replayed on this engine.

Each test ports the behaviour one of vLLM's own tests checks (named in its docstring:
``tests/v1/sample/``, ``tests/v1/engine/``, ``tests/test_sampling_params.py`` in the vLLM
repository), on the tiny model. Where transformers has the same option, its logits
processor is the reference (``RepetitionPenaltyLogitsProcessor``, ``MinPLogitsWarper``,
``NoBadWordsLogitsProcessor``), and a whole seeded generation with it must give the
engine's tokens.
"""

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from paged_lib.data import TINY_CODE_LLAMA_DIR
from paged_lib.engine import LLM, LLMEngine, SamplingParams
from paged_lib.engine.sampler import apply_min_p, apply_penalties, banned_bad_words

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 17, 42], [3, 9, 11, 60, 2, 8, 71], [88]]


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY_CODE_LLAMA_DIR, num_blocks=64, device="cpu")


def raw_logits(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' logits that chose each of ``tokens`` (one forward pass)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]


# ---------------------------------------------------------------- the logits options


def test_repetition_penalty_is_transformers():
    """test_sampler.py::test_sampler_repetition_penalty: every token of the prompt or the
    output is penalised (divided when positive, multiplied when negative)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(97, generator=g) * 3
        prompt = torch.randint(0, 97, (5,), generator=g).tolist()
        output = torch.randint(0, 97, (7,), generator=g).tolist()
        penalty = float(torch.rand(1, generator=g)) * 1.9 + 0.05
        ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]),
                                                        logits.clone()[None])[0]
        assert torch.allclose(apply_penalties(logits, prompt, output, repetition=penalty), ref)


def test_presence_and_frequency_penalties_count_the_output_only():
    """test_sampler.py::test_sampler_presence_penalty and
    ::test_sampler_frequency_penalty: each output token loses ``frequency`` per occurrence
    and ``presence`` once; the prompt's tokens do not count for these two."""
    logits = torch.zeros(10)
    got = apply_penalties(logits, prompt_ids=[1, 1, 2], output_ids=[3, 3, 3, 4],
                          presence=0.5, frequency=0.25)
    want = torch.zeros(10)
    want[3], want[4] = -(0.5 + 3 * 0.25), -(0.5 + 0.25)
    assert torch.equal(got, want) and torch.equal(logits, torch.zeros(10))
    # negative penalties reward repetition, as in vLLM
    assert apply_penalties(logits, [], [7], presence=-1.0)[7] == 1.0


def test_min_p_is_transformers():
    """test_sampler.py::test_sampler_min_p: tokens less likely than min_p times the most
    likely one are dropped (after temperature); the most likely always stays."""
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        logits = torch.randn(2, 97, generator=g) * 3
        min_p = float(torch.rand(1, generator=g))
        ref = MinPLogitsWarper(min_p)(None, logits.clone())
        got = apply_min_p(logits, min_p)
        assert torch.equal(torch.isinf(got), torch.isinf(ref)), min_p
    assert torch.equal(apply_min_p(logits, 0.0), logits)


def test_bad_words_are_transformers():
    """test_sampler.py::test_sampler_bad_words: a one-token word is never drawn; a longer
    one's last token is banned right after its other tokens."""
    bad = [[7], [3, 4], [1, 2, 5]]
    for output in ([], [3], [1, 2], [9, 1, 2], [2, 1], [3, 4, 3]):
        ref = NoBadWordsLogitsProcessor(bad, eos_token_id=96)(
            torch.tensor([output or [0]]) if output else torch.tensor([[0]]),
            torch.zeros(1, 97))[0]
        assert sorted(banned_bad_words(bad, output)) == \
            torch.isinf(ref).nonzero().flatten().tolist(), output


def test_seeded_generation_with_penalty_and_min_p_is_transformers(tiny_hf_llama, tiny_model):
    """The options in vLLM's order (repetition penalty on the logits, then temperature,
    then top-k and min-p), token for token against transformers' generate with the same
    processors and the same seed, in a batch."""
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_k=30, min_p=0.05,
                             repetition_penalty=1.3, seed=s) for s in (0, 1, 2)]
    want = []
    for prompt, sp in zip(PROMPTS, params, strict=True):
        torch.manual_seed(sp.seed)
        with torch.no_grad():
            out = tiny_hf_llama.generate(
                torch.tensor([prompt]), do_sample=True, temperature=0.9, top_k=30, min_p=0.05,
                repetition_penalty=1.3, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    got = LLMEngine(tiny_model, 64, 4).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == want


def test_greedy_penalties_pick_the_argmax_of_the_penalised_logits(tiny_hf_llama, tiny_model):
    """Penalties change greedy decoding too (vLLM applies them before the argmax): every
    token is the argmax of the model's logits minus the penalties for the output so far."""
    sp = SamplingParams(max_tokens=16, temperature=0.0, presence_penalty=1.5,
                        frequency_penalty=0.5, repetition_penalty=1.2)
    tokens = LLMEngine(tiny_model, 64, 4).generate([PROMPTS[1]], sp)[0].outputs[0].token_ids
    plain = LLMEngine(tiny_model, 64, 4).generate(
        [PROMPTS[1]], SamplingParams(max_tokens=16, temperature=0.0))[0].outputs[0].token_ids
    assert tokens != plain  # the penalties matter here
    logits = raw_logits(tiny_hf_llama, PROMPTS[1], tokens)
    for i, t in enumerate(tokens):
        before = tokens[:i]
        want = logits[i].clone()
        for u in set(PROMPTS[1] + before):
            want[u] = want[u] / 1.2 if want[u] > 0 else want[u] * 1.2
        for u in set(before):
            want[u] -= 1.5 + 0.5 * before.count(u)
        assert int(torch.argmax(want)) == t, i


def test_logit_bias_and_allowed_token_ids(tiny_model):
    """test_sampler.py::test_sampler_logit_bias and ::test_sampler_allowed_token_ids: a
    large bias makes its token the argmax; only the allowed tokens are ever drawn."""
    engine = LLMEngine(tiny_model, 64, 4)
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0,
                                                       logit_bias={11: 100.0}))
    assert out[0].outputs[0].token_ids == [11] * 6
    allowed = [4, 8, 15, 16, 23, 42]
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=1.5, seed=0,
                                                  allowed_token_ids=allowed))
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in out)


def test_bad_words_are_never_generated(llm):
    """test_sampler.py::test_sampler_bad_words, through the text front (the words are
    tokenized as vLLM's ``update_from_tokenizer`` does)."""
    plain = llm.generate("def ", SamplingParams(max_tokens=24, temperature=0.0))
    text = plain[0].outputs[0].text
    word = text.strip().split()[0][:2]
    assert len(word) == 2 and word in text
    out = llm.generate("def ", SamplingParams(max_tokens=24, temperature=0.0,
                                              bad_words=[word]))
    assert word not in out[0].outputs[0].text


# ---------------------------------------------------------------- outputs and sentinels


def test_cumulative_logprob_is_none_without_logprobs(llm):
    """test_logprobs.py::test_none_logprobs: no logprobs asked, no cumulative_logprob; the
    token-id API keeps the sum (the chapters compare it between engines)."""
    none = llm.generate("def ", SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0]
    some = llm.generate("def ", SamplingParams(max_tokens=4, temperature=0.0,
                                               logprobs=0))[0].outputs[0]
    assert none.cumulative_logprob is None and none.logprobs is None
    assert some.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for lp, t in zip(some.logprobs, some.token_ids, strict=True)))
    ids = llm.tokenizer.encode("def ")
    assert isinstance(llm.llm_engine.generate([ids], SamplingParams(max_tokens=4))[0]
                      .outputs[0].cumulative_logprob, float)


def test_logprobs_minus_one_is_the_whole_vocabulary(tiny_model):
    """test_logprobs.py::test_all_logprobs: ``logprobs=-1`` returns every token's
    log-probability, when the engine's ``max_logprobs`` allows it (-1: no limit)."""
    engine = LLMEngine(tiny_model, 64, 4, max_logprobs=-1)
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=3, logprobs=-1, seed=0))
    for top in out[0].outputs[0].logprobs:
        assert len(top) == tiny_model.config.vocab_size
        assert sorted(x.rank for x in top.values()) == list(range(1, len(top) + 1))
    with pytest.raises(ValueError, match="greater than max allowed: 20"):
        LLMEngine(tiny_model, 64, 4).generate([PROMPTS[0]], SamplingParams(logprobs=-1))


def test_max_tokens_none_is_what_the_context_has_left(tiny_model):
    """test_sampling_params.py::test_max_tokens_none: ``max_tokens=None`` is valid and
    means up to ``max_model_len``."""
    engine = LLMEngine(tiny_model, 64, 4, max_model_len=20)
    out = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=None, ignore_eos=True,
                                                       temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 20 - len(PROMPTS[1])
    assert out[0].outputs[0].finish_reason == "length"


def test_a_stop_tokens_text_is_left_out_unless_asked_for(llm):
    """test_output_processor.py::test_stop_token: the stop token's id stays in
    ``token_ids``, its text is left out of ``text``, unless
    ``include_stop_str_in_output``."""
    plain = llm.generate("def ", SamplingParams(max_tokens=16, temperature=0.0))[0].outputs[0]
    stop = plain.token_ids[5]
    first = plain.token_ids.index(stop)
    for keep in (False, True):
        c = llm.generate("def ", SamplingParams(max_tokens=16, temperature=0.0,
                                                stop_token_ids=[stop],
                                                include_stop_str_in_output=keep))[0].outputs[0]
        assert c.token_ids == plain.token_ids[:first + 1] and c.stop_reason == stop
        assert c.text == llm.tokenizer.decode(plain.token_ids[:first + keep])


def test_include_stop_str_in_output(llm):
    """test_output_processor.py::test_stop_string (include_stop_str_in_output): the text
    ends before the stop string, or just after it when asked."""
    text = llm.generate("def ", SamplingParams(max_tokens=24, temperature=0.0))[0] \
        .outputs[0].text
    stop = text[4:6]
    for keep, want in ((False, text[:text.index(stop)]),
                       (True, text[:text.index(stop) + len(stop)])):
        c = llm.generate("def ", SamplingParams(max_tokens=24, temperature=0.0, stop=stop,
                                                include_stop_str_in_output=keep))[0].outputs[0]
        assert c.text == want and c.stop_reason == stop


def test_llm_engine_and_reset_prefix_cache():
    """vLLM's ``LLM.llm_engine`` and ``LLM.reset_prefix_cache`` (test_prefix_caching.py::
    test_reset_prefix_cache: refused while blocks are in use, the cache empty after)."""
    llm = LLM(TINY_CODE_LLAMA_DIR, num_blocks=32, block_size=4, enable_prefix_caching=True,
              device="cpu")
    assert llm.llm_engine is llm.engine
    llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4, temperature=0.0))
    gpu = llm.llm_engine.block_manager.gpu
    assert gpu.cached_blocks
    group = llm.llm_engine.add_request(9, PROMPTS[1], SamplingParams(max_tokens=4))
    llm.llm_engine.step()
    assert llm.reset_prefix_cache() is False and gpu.cached_blocks
    llm.llm_engine.abort_request(group.request_id)
    assert llm.reset_prefix_cache() is True and not gpu.cached_blocks


def test_use_tqdm_draws_vllms_progress_bar(llm):
    """vLLM's ``LLM._run_engine`` bar (no vLLM test checks it): "Processed prompts" over
    the requests, one update per finished request, the input/output speeds as postfix;
    ``use_tqdm`` may be a tqdm-like class."""
    bars = []

    class Bar:
        def __init__(self, total, desc, dynamic_ncols, postfix):
            self.total, self.desc, self.postfix, self.n, self.closed = total, desc, postfix, 0, 0
            self.format_dict = {"elapsed": 1.0}
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed += 1

    out = llm.generate(["def ", "class ", "import "], SamplingParams(max_tokens=5,
                                                                     ignore_eos=True),
                       use_tqdm=Bar)
    (bar,) = bars
    assert (bar.total, bar.desc, bar.n, bar.closed) == (3, "Processed prompts", 3, 1)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in out)
    assert bar.postfix == (f"est. speed input: {prompt_tokens:.2f} toks/s, "
                           f"output: {15:.2f} toks/s")  # (elapsed fixed at 1 s above)
    llm.generate("def ", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(bars) == 1


def test_prompt_logprobs_are_transformers_log_softmax(tiny_hf_llama, tiny_model):
    """test_logprobs.py::test_get_logprobs_and_prompt_logprobs: ``prompt_logprobs=k`` gives
    ``None`` for the first prompt token, then each token's log-probability given the
    tokens before it (with its rank) and the k most likely; the generation is unchanged,
    and a prefix-cache hit does not change them (the prompt is run on its own)."""
    prompt = PROMPTS[1]
    with torch.no_grad():
        ref = torch.log_softmax(tiny_hf_llama(torch.tensor([prompt])).logits[0].float(), -1)
    engine = LLMEngine(tiny_model, 64, 4, enable_prefix_caching=True)
    plain = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0]
    for _ in range(2):  # the second run hits the cached prompt blocks
        out = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0,
                                                       prompt_logprobs=2))[0]
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
        assert plain.prompt_logprobs is None and out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt)
        for i, (token, top) in enumerate(zip(prompt[1:], out.prompt_logprobs[1:],
                                             strict=True)):
            assert top[token].logprob == pytest.approx(float(ref[i, token]), abs=1e-4)
            assert top[token].rank == int((ref[i] >= ref[i, token]).sum())
            best = torch.topk(ref[i], 2).indices.tolist()
            assert set(best) <= set(top) and len(top) in (2, 3)
    assert engine.stats.prefix_cache_hit_tokens > 0
    with pytest.raises(ValueError, match="prompt_logprobs must be non-negative or -1"):
        SamplingParams(prompt_logprobs=-2)
    with pytest.raises(ValueError, match="Requested prompt logprobs of 21"):
        engine.generate([prompt], SamplingParams(prompt_logprobs=21))
