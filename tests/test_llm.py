"""``LLM``: text in, text out, over the shipped model and byte tokenizer.

The token ids behind each text must be the engine's own and transformers' (greedy and
with top_k / top_p sampling, same seed); bad input is a ValueError that says what is wrong.
"""

import pytest
import torch

from paged_lib.data import TINY_CODE_LLAMA_DIR
from paged_lib.engine import LLM, LLMEngine, SamplingParams
from paged_lib.engine.llm import DEFAULT_POOL_SEQS
from paged_lib.model import TinyLlama
from paged_lib.tokenizer import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["def ", "class Stack:\n    def ", "import "]


@pytest.fixture(scope="module")
def shipped_hf():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(TINY_CODE_LLAMA_DIR).float().eval()


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY_CODE_LLAMA_DIR, num_blocks=64, device="cpu")


def _hf(hf, ids, max_new_tokens, **sampling):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                          pad_token_id=257, **sampling)
    return out[0, len(ids):].tolist()


def test_import_like_vllm():
    from paged_lib import LLM as top_llm
    from paged_lib import SamplingParams as top_params

    assert top_llm is LLM and top_params is SamplingParams


def test_text_in_text_out_equals_transformers_greedy(llm, shipped_hf):
    tok = ByteTokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok.encode(prompt)
        assert out.prompt == prompt and out.prompt_token_ids == ids
        want = _hf(shipped_hf, ids, 24, do_sample=False)
        if tok.eos_id in want:  # the engine stops at EOS (and keeps it), as generate does
            want = want[:want.index(tok.eos_id) + 1]
        c = out.outputs[0]
        assert c.token_ids == want
        assert c.text == tok.decode(want) and isinstance(c.text, str)


def test_top_k_top_p_sampling_equals_transformers(llm, shipped_hf):
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, top_k=20, seed=3,
                            ignore_eos=True)
    got = llm.generate(["def "], params)[0].outputs[0]
    torch.manual_seed(3)
    want = _hf(shipped_hf, ByteTokenizer().encode("def "), 30, do_sample=True,
               temperature=0.8, top_p=0.95, top_k=20, eos_token_id=None)
    assert got.token_ids == want and got.text == ByteTokenizer().decode(want)


def test_the_same_tokens_as_the_token_id_api_with_engine_options():
    model = TinyLlama.from_pretrained(TINY_CODE_LLAMA_DIR)
    params = [SamplingParams(max_tokens=16, temperature=1.0, top_k=10, seed=1, n=2),
              SamplingParams(max_tokens=12, beam_width=2),
              SamplingParams(max_tokens=10, temperature=0.0)]
    prompts = ["def add(a, b):\n    ", "def add(a, b):\n    return", "for i in "]
    llm = LLM(model, num_blocks=24, block_size=4, enable_prefix_caching=True)
    first = llm.generate(prompts, params)
    text = llm.generate(prompts, params)  # the prompts' blocks are cached now
    assert [[c.text for c in o.outputs] for o in first] == \
        [[c.text for c in o.outputs] for o in text]
    ids = LLMEngine(model, 24, 4).generate([ByteTokenizer().encode(p) for p in prompts],
                                           params)
    assert [[c.token_ids for c in o.outputs] for o in text] == \
        [[c.token_ids for c in o.outputs] for o in ids]
    assert [len(o.outputs) for o in text] == [2, 2, 1]
    assert llm.stats.prefix_cache_hit_tokens > 0
    assert all(c.text is None for o in ids for c in o.outputs)  # the token-id API: no text


def test_one_string_and_defaults(llm):
    out = llm.generate("def ")
    assert len(out) == 1 and out[0].prompt == "def "
    assert len(out[0].outputs[0].token_ids) <= 16  # vLLM's default max_tokens
    default = LLM(TINY_CODE_LLAMA_DIR, device="cpu").engine
    assert default.num_blocks == DEFAULT_POOL_SEQS * -(-default.model.config.max_position // 16)


@pytest.mark.parametrize("prompts, message", [
    ("", "prompt 0 is empty"),
    (["def ", ""], "prompt 1 is empty"),
    ([[256, 100], [256, 999]], "request 1: token 999 at position 1 is not an id"),
    (["def ", b"x"], "prompt 1 must be a str, a list of token ids, {'prompt': str} or "
                     "{'prompt_token_ids': [...]}, got bytes"),
    ([{"text": "def "}], "got dict {'text': 'def '}"),
    (5, "prompts must be a str, a list of token ids, or a list of them"),
])
def test_bad_prompts_are_a_value_error(llm, prompts, message):
    with pytest.raises(ValueError) as err:
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    assert message in str(err.value)


def test_bad_params_and_models_are_a_value_error(llm):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        llm.generate("def ", SamplingParams(max_tokens=4, temperature=1.0, top_p=2.0))
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=4, temperature=0.0)])
    with pytest.raises(ValueError, match="model must be a model folder"):
        LLM(42)
    with pytest.raises(ValueError, match="no config.json"):
        LLM(TINY_CODE_LLAMA_DIR.parent)


def test_a_model_smaller_than_the_tokenizer_is_refused(tiny_model):
    with pytest.raises(ValueError, match="the tokenizer has 264 ids but the model only 97"):
        LLM(tiny_model)
