"""vLLM's front, as a learner's first vLLM program uses it: ``SamplingParams`` with vLLM's
keywords and defaults, stop token ids, ``min_tokens``, ``logprobs``, stop strings, finish
reasons, token-id prompts and ``LLM.beam_search``.

Log-probabilities and masked tokens are checked against transformers' logits along the
engine's own tokens (one forward pass each): the model's ``log_softmax``, before any mask.
"""

import dataclasses
import inspect

import pytest
import torch

import paged_lib
from paged_lib import engine as paged_engine
from paged_lib.data import TINY_CODE_LLAMA_DIR
from paged_lib.engine import (
    LLM,
    BeamSearchParams,
    CompletionOutput,
    LLMEngine,
    RequestOutput,
    SamplingParams,
    StaticBatchingEngine,
)
from paged_lib.model import TinyLlama
from paged_lib.tokenizer import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 17, 42], [3, 9, 11, 60, 2, 8, 71], [88]]
#: vLLM's SamplingParams defaults (vllm/sampling_params.py), the ones this engine has
VLLM_DEFAULTS = dict(n=1, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=None,
                     stop_token_ids=None, ignore_eos=False, max_tokens=16, min_tokens=0,
                     logprobs=None)


def logprobs_along(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' ``log_softmax`` of the logits that chose each of ``tokens``."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)], dim=-1)


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY_CODE_LLAMA_DIR, num_blocks=64, device="cpu")


# ---------------------------------------------------------------- SamplingParams


def test_the_defaults_and_keywords_are_vllms():
    sig = inspect.signature(SamplingParams)
    assert {k: sig.parameters[k].default for k in VLLM_DEFAULTS} == VLLM_DEFAULTS
    assert all(p.kind is p.KEYWORD_ONLY for p in sig.parameters.values())
    params = SamplingParams()
    assert (params.temperature, params.max_tokens, params.top_k, params.stop,
            params.stop_token_ids) == (1.0, 16, 0, [], [])  # lists, as vLLM makes them
    assert SamplingParams(temperature=0.8, top_p=0.95).problem() is None
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert hash(SamplingParams(stop=["a"])) == hash(SamplingParams(stop="a"))
    with pytest.raises(TypeError):
        SamplingParams(16)  # keywords only, as vLLM
    assert paged_lib.BeamSearchParams is BeamSearchParams is paged_engine.BeamSearchParams
    assert paged_lib.SamplingParams is SamplingParams


#: bad values refused when SamplingParams is built, in vLLM's words (its _verify_args;
#: ports vLLM's tests/test_sampling_params.py and tests/v1/engine/test_processor.py ideas)
BUILT_BAD = [
    (dict(max_tokens=4, min_tokens=5),
     "min_tokens must be less than or equal to max_tokens=4, got 5."),
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1."),
    (dict(stop=[""]), "stop cannot contain an empty string."),
    (dict(stop=5), "stop must be a str or a list of str"),
    (dict(stop_token_ids=[True]), "stop_token_ids must contain only integers"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be token ids"),
    (dict(logprobs=-2), "logprobs must be non-negative or -1, got -2."),
    (dict(n=0), "n must be at least 1, got 0."),
    (dict(n=2, temperature=0.0), "n must be 1 when using greedy sampling, got 2."),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0."),
    (dict(top_k=-2), "top_k must be 0 (disable), or at least 1, got -2."),
    (dict(temperature=-1.0), "temperature must be non-negative, got -1.0."),
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5."),
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0."),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5."),
    (dict(frequency_penalty=-3.0), "frequency_penalty must be in [-2, 2], got -3.0."),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0."),
    (dict(bad_words=[""]), "bad_words cannot contain an empty string."),
    (dict(allowed_token_ids=[]), "allowed_token_ids is not None and empty!"),
    (dict(top_p="0.9"), "top_p must be a number"),
    (dict(beam_width=2, n=2), "beam search ranks beams by"),
    (dict(beam_width=2, stop_token_ids=[3]), "beam search here stops at EOS"),
    (dict(beam_width=2, logprobs=1), "beam search here stops at EOS"),
    (dict(beam_width=2, repetition_penalty=1.2), "beam search here ranks the model's own"),
]


@pytest.mark.parametrize("kwargs, message", BUILT_BAD, ids=[str(k) for k, _ in BUILT_BAD])
def test_bad_values_raise_when_built_in_vllms_words(kwargs, message):
    """vLLM: SamplingParams.__post_init__ -> _verify_args raises ValueError at once."""
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize("params, message", [
    (SamplingParams(stop_token_ids=[500]), "stop_token_ids [500] are not ids"),
    (SamplingParams(logprobs=21), "Requested sample logprobs of 21, which is greater than "
                                  "max allowed: 20"),
    (SamplingParams(logprobs=-1), "Requested sample logprobs of 97"),
    (SamplingParams(logit_bias={300: 1.0}), "token_id(s) [300] in logit_bias contain "
                                            "out-of-vocab token ids. Vocabulary size: 97"),
    (SamplingParams(allowed_token_ids=[1, 97]), "allowed_token_ids contains out-of-vocab"),
    (SamplingParams(bad_words=["x"]), "bad_words need a tokenizer"),
    (SamplingParams(max_tokens=4, stop="x"), "stop strings need a tokenizer"),
])
def test_what_depends_on_the_model_names_the_request(tiny_model, params, message):
    """vLLM's processor checks these against the model when a request arrives."""
    with pytest.raises(ValueError) as err:
        LLMEngine(tiny_model, 16, 4).generate([[1], [2]], [SamplingParams(), params])
    assert "request 1: " in str(err.value) and message in str(err.value)


def test_beam_search_ignores_the_temperature(tiny_model):
    """vLLM's BeamSearchParams defaults to temperature 0.0, SamplingParams to 1.0: beams
    are ranked by log-probabilities either way."""
    engine = LLMEngine(tiny_model, 64, 4)
    hot = engine.generate(PROMPTS, SamplingParams(beam_width=3, max_tokens=6))
    cold = engine.generate(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=6)
                           .sampling_params())
    assert [[c.token_ids for c in o.outputs] for o in hot] == \
        [[c.token_ids for c in o.outputs] for o in cold]


# ---------------------------------------------------------------- stops and reasons


def test_a_stop_token_id_ends_the_sequence_and_is_named(tiny_model):
    engine = LLMEngine(tiny_model, 64, 4)
    full = engine.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0))
    for prompt, out in zip(PROMPTS, full, strict=True):
        c = out.outputs[0]
        assert (c.finish_reason, c.stop_reason, len(c.token_ids)) == ("length", None, 10)
        stop = c.token_ids[4]
        cut = c.token_ids.index(stop) + 1  # its first occurrence, kept
        got = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0,
                                                       stop_token_ids=[stop]))
        g = got[0].outputs[0]
        assert g.token_ids == c.token_ids[:cut]
        assert (g.finish_reason, g.stop_reason) == ("stop", stop)
        assert engine.block_manager.num_free_blocks == 64


def test_eos_is_stop_max_tokens_is_length_and_ignore_eos_goes_on(tiny_hf_llama):
    model = TinyLlama.from_hf(tiny_hf_llama)
    greedy = LLMEngine(model, 64, 4).generate(PROMPTS[:1], SamplingParams(
        max_tokens=8, temperature=0.0))[0].outputs[0].token_ids
    model.config = dataclasses.replace(model.config, eos_token_id=greedy[2])
    engine = LLMEngine(model, 64, 4)
    out = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0.0))[0]
    c = out.outputs[0]
    assert c.token_ids == greedy[:greedy.index(greedy[2]) + 1]
    assert (c.finish_reason, c.stop_reason, out.finished) == ("stop", None, True)
    c = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0.0,
                                                    ignore_eos=True))[0].outputs[0]
    assert (c.token_ids, c.finish_reason) == (greedy, "length")
    # an EOS drawn as the last allowed token is "length", as vLLM v1 checks length first
    c = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0.0)
                        )[0].outputs[0]
    assert (c.token_ids, c.finish_reason) == (greedy[:3], "length")


def test_min_tokens_masks_eos_and_stop_ids_as_vllm(tiny_hf_llama):
    """Before ``min_tokens`` tokens, EOS and the stop ids get ``-inf`` logits: greedy takes
    the best of the others; after, they stop the sequence. Logprobs stay the model's own."""
    model = TinyLlama.from_hf(tiny_hf_llama)
    prompt = PROMPTS[1]
    greedy = LLMEngine(model, 64, 4).generate([prompt], SamplingParams(
        max_tokens=12, temperature=0.0))[0].outputs[0].token_ids
    eos, stop = greedy[0], greedy[1]
    model.config = dataclasses.replace(model.config, eos_token_id=eos)
    params = SamplingParams(max_tokens=12, temperature=0.0, min_tokens=4, stop_token_ids=[stop])
    c = LLMEngine(model, 64, 4).generate([prompt], params)[0].outputs[0]
    lp = logprobs_along(tiny_hf_llama, prompt, c.token_ids)
    for i, tok in enumerate(c.token_ids):
        row = lp[i].clone()
        if i < 4:
            row[[eos, stop]] = float("-inf")
        assert tok == int(torch.argmax(row)), i
    assert all(t not in (eos, stop) for t in c.token_ids[:4])
    assert c.token_ids[-1] in (eos, stop) or len(c.token_ids) == 12
    assert c.cumulative_logprob == pytest.approx(
        float(lp[torch.arange(len(c.token_ids)), c.token_ids].sum()), abs=1e-4)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=20,
                                                                   seed=3, n=2)])
def test_logprobs_are_the_top_k_of_the_models_log_softmax_and_the_chosen(
        tiny_hf_llama, tiny_model, sampling):
    k = 3
    out = LLMEngine(tiny_model, 64, 4).generate(PROMPTS, SamplingParams(
        max_tokens=6, logprobs=k, **sampling))
    for prompt, o in zip(PROMPTS, out, strict=True):
        for c in o.outputs:
            lp = logprobs_along(tiny_hf_llama, prompt, c.token_ids)
            assert len(c.logprobs) == len(c.token_ids)
            for i, (tok, top) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
                want = torch.topk(lp[i], k)
                assert next(iter(top)) == tok  # the chosen token first, as vLLM
                assert set(top) == set(want.indices.tolist()) | {tok}
                for t, entry in top.items():
                    assert entry.logprob == pytest.approx(float(lp[i, t]), abs=1e-5)
                    assert entry.rank == int((lp[i] > lp[i, t]).sum()) + 1
            assert c.cumulative_logprob == pytest.approx(
                sum(top[t].logprob for t, top in zip(c.token_ids, c.logprobs, strict=True)))
    plain = LLMEngine(tiny_model, 64, 4).generate(PROMPTS, SamplingParams(max_tokens=6,
                                                                          **sampling))
    assert [[c.token_ids for c in o.outputs] for o in plain] == \
        [[c.token_ids for c in o.outputs] for o in out]  # asking changes no token
    assert all(c.logprobs is None for o in plain for c in o.outputs)


def test_stop_strings_cut_the_text_and_stop_the_engine(llm):
    """The byte tokenizer makes one token per ASCII character: every stop string of two
    characters or more spans tokens, and is only found across steps."""
    full = llm.generate("def ", SamplingParams(max_tokens=48, temperature=0.0))[0].outputs[0]
    text = full.text
    for stop in (text[10:12], text[20:24], [text[30:33], "never there"]):
        first = stop if isinstance(stop, str) else stop[0]
        at = text.index(first)
        c = llm.generate("def ", SamplingParams(max_tokens=48, temperature=0.0,
                                                stop=stop))[0].outputs[0]
        assert c.text == text[:at] and first not in c.text
        assert (c.finish_reason, c.stop_reason) == ("stop", first)
        assert c.token_ids == full.token_ids[:at + len(first)]  # the engine stopped there
    c = llm.generate("def ", SamplingParams(max_tokens=48, temperature=0.0,
                                            stop="never there"))[0].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (text, "length", None)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_stop_strings_wait_for_min_tokens_and_apply_to_each_sample(llm):
    full = llm.generate("def ", SamplingParams(max_tokens=40, temperature=0.0))[0].outputs[0]
    first = full.text[:2]  # the text's first two characters, also found later or not
    c = llm.generate("def ", SamplingParams(max_tokens=40, temperature=0.0, stop=first,
                                            min_tokens=2))[0].outputs[0]
    later = full.text.find(first, 1)
    assert c.text == (full.text if later < 0 else full.text[:later])
    outs = llm.generate(["def ", "class "], SamplingParams(max_tokens=40, temperature=1.0,
                                                           n=3, seed=1, stop=["(", "\n"]))
    for c in (c for o in outs for c in o.outputs):
        assert "(" not in c.text and "\n" not in c.text
        assert c.finish_reason == "stop" or len(c.token_ids) == 40
        if c.finish_reason == "stop":
            assert ByteTokenizer().decode(c.token_ids) == c.text + c.stop_reason


# ---------------------------------------------------------------- prompts and outputs


def test_token_id_prompts_as_vllm_takes_them(llm):
    tok = ByteTokenizer()
    params = SamplingParams(max_tokens=8, temperature=0.0)
    texts = llm.generate(["def ", "import "], params)
    ids = [tok.encode("def "), tok.encode("import ")]
    for prompts in (ids, [{"prompt_token_ids": ids[0]}, {"prompt": "import "}]):
        got = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == \
            [o.outputs[0].token_ids for o in texts]
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in texts]
    one = llm.generate(ids[0], params)  # a list of ints is one prompt
    assert len(one) == 1 and one[0].prompt is None and one[0].prompt_token_ids == ids[0]
    assert texts[0].prompt == "def "


def test_outputs_have_vllms_fields_in_vllms_order(tiny_model):
    c = CompletionOutput(0, "ab", [1, 2], -0.5, None, "length", None)
    r = RequestOutput(7, "x", [3], [c], True)
    assert (r.prompt, r.finished, r.error, c.index, c.text) == ("x", True, None, 0, "ab")
    out = LLMEngine(tiny_model, 64, 4).generate(PROMPTS, SamplingParams(
        max_tokens=4, temperature=1.0, n=3, seed=0))
    assert [[c.index for c in o.outputs] for o in out] == [[0, 1, 2]] * 3
    assert all(o.prompt is None and o.finished for o in out)
    static = StaticBatchingEngine(tiny_model, 64, 4, max_len=32, attention_backend="torch")
    s = static.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0, min_tokens=2))
    assert all(o.outputs[0].finish_reason == "length" for o in s)


def test_a_request_that_cannot_run_fails_alone_with_error(tiny_model):
    out = LLMEngine(tiny_model, 8, 4, max_model_len=40).generate(
        [PROMPTS[0], list(range(40))], SamplingParams(max_tokens=4, temperature=0.0))
    assert out[0].error is None and out[1].outputs == [] and out[1].finished
    assert "maximum context length is 40 tokens" in out[1].error


def test_beam_search_returns_the_engines_beam_groups(llm):
    prompts = ["def ", "class Stack:\n    def "]
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    got = llm.beam_search(prompts, params)
    ids = [ByteTokenizer().encode(p) for p in prompts]
    want = LLMEngine(llm.engine.model, 64, 16).generate(
        ids, SamplingParams(beam_width=3, max_tokens=10))
    for p, g, w in zip(ids, got, want, strict=True):
        assert [s.tokens for s in g.sequences] == [p + c.token_ids for c in w.outputs]
        assert [s.cum_logprob for s in g.sequences] == [c.cumulative_logprob
                                                         for c in w.outputs]
        assert [s.text for s in g.sequences] == [ByteTokenizer().decode(p + c.token_ids)
                                                 for c in w.outputs]
        assert all(s.finish_reason in ("stop", "length") for s in g.sequences)
    alone = llm.beam_search("def ", params)[0].sequences  # one str: one prompt
    assert [s.tokens for s in alone] == [s.tokens for s in got[0].sequences]
    with pytest.raises(ValueError, match="params must be BeamSearchParams"):
        llm.beam_search(prompts, SamplingParams(beam_width=3))
