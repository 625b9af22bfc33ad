"""The server's request fields, as OpenAI's client and chat UIs send them.

In this process: the official ``openai`` client talks to the app through FastAPI's
``TestClient`` (an ``httpx`` client), so no port is opened. Each test names the vLLM test
it ports (``tests/entrypoints/openai/`` in the vLLM repository).
"""

import logging

import openai
import pytest
from fastapi.testclient import TestClient

from paged_lib.data import TINY_CODE_LLAMA_DIR
from paged_lib.engine import LLM, SamplingParams
from paged_lib.serve import protocol
from paged_lib.serve.api_server import build_app
from paged_lib.serve.metrics import parse_metrics
from paged_lib.serve.protocol import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Write a function"}]

#: every parameter of the official client's ``chat.completions.create`` (openai 1.x/2.x
#: signature), at the value OpenAI's API reference gives as its default (or null): what a
#: client or chat UI that fills in every field sends
CHAT_DEFAULTS = dict(
    audio=None, frequency_penalty=0, function_call=None, functions=None, logit_bias={},
    logprobs=False, max_completion_tokens=None, max_tokens=None, metadata={},
    modalities=["text"], n=1, parallel_tool_calls=True, prediction=None, presence_penalty=0,
    prompt_cache_key=None, reasoning_effort=None, response_format={"type": "text"},
    safety_identifier=None, seed=None, service_tier="auto", stop=None, store=False,
    stream_options=None, temperature=1, tool_choice=None, tools=None, top_logprobs=None,
    top_p=1, user="someone", verbosity=None, web_search_options=None)
#: the same for ``completions.create``
COMPLETION_DEFAULTS = dict(
    best_of=1, echo=False, frequency_penalty=0, logit_bias={}, logprobs=None, max_tokens=16,
    n=1, presence_penalty=0, seed=None, stop=None, stream_options=None, suffix=None,
    temperature=1, top_p=1, user="someone")


@pytest.fixture(scope="module")
def http():
    with TestClient(build_app(LLM(TINY_CODE_LLAMA_DIR, num_blocks=64, device="cpu"),
                              MODEL)) as c:
        yield c


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                         max_retries=0)


def test_every_default_field_of_the_official_client_gets_200(client):
    """test_chat.py::test_extra_fields_allowed, for every field the client can send: the
    ones this server does not use are ignored (vLLM's ``extra="allow"``), not a 400."""
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, **CHAT_DEFAULTS)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True,
        **{**CHAT_DEFAULTS, "max_tokens": 8, "stream_options": {"include_usage": True}}))
    assert chunks[-1].usage.completion_tokens <= 8
    r = client.completions.create(model=MODEL, prompt="def ", **COMPLETION_DEFAULTS)
    assert r.choices[0].finish_reason in ("stop", "length")
    # a field no client knows, in the body and in a message, as vLLM's test sends it
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x", "extra_field": "0"}],
        max_tokens=2, extra_body={"some_future_field": {"a": 1}})
    assert r.choices[0].message.content is not None


def test_ignored_fields_are_logged_once(caplog):
    """vLLM's ``OpenAIBaseModel`` warns about the fields it ignores."""
    protocol._ignored_logged.discard("a_field_for_this_test")
    req = CompletionRequest(prompt="x", a_field_for_this_test=1)
    with caplog.at_level(logging.WARNING, logger="paged_lib.serve.protocol"):
        assert protocol.log_ignored(req) == ["a_field_for_this_test"]
        protocol.log_ignored(req)
    assert [r.getMessage() for r in caplog.records].count(
        "ignored request fields (this server does not use them): a_field_for_this_test") == 1


def test_request_fields_map_to_sampling_params_in_one_place():
    """vLLM's ``to_sampling_params``: each field to its SamplingParams keyword; ``null`` is
    the default; logit_bias keys read as token ids and clamped to [-100, 100]."""
    req = ChatCompletionRequest(
        messages=MESSAGES, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, n=2, seed=3,
        stop=["\n\n", ""], presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=1.1, logit_bias={"7": 500}, max_completion_tokens=9,
        logprobs=True, top_logprobs=3, min_tokens=2, stop_token_ids=[4],
        include_stop_str_in_output=True, ignore_eos=True, bad_words=["no"],
        allowed_token_ids=[1, 2, 7])
    assert req.to_sampling_params(room=100) == SamplingParams(
        temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, n=2, seed=3, stop=["\n\n"],
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
        logit_bias={7: 100.0}, max_tokens=9, logprobs=3, min_tokens=2, stop_token_ids=[4],
        include_stop_str_in_output=True, ignore_eos=True, bad_words=["no"],
        allowed_token_ids=[1, 2, 7])
    nulls = ChatCompletionRequest(messages=MESSAGES, temperature=None, top_p=None, n=None,
                                  presence_penalty=None, stream=None)
    assert nulls.to_sampling_params(room=100) == SamplingParams(max_tokens=100)
    assert CompletionRequest(prompt="x").to_sampling_params(room=100).max_tokens == 16
    assert CompletionRequest(prompt="x", max_tokens=None).to_sampling_params(50).max_tokens == 50


@pytest.mark.parametrize("body, message", [
    ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3.0."),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0.0."),
    ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
    ({"logprobs": 21}, "Requested sample logprobs of 21, which is greater than max allowed"),
    ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
    ({"prompt_logprobs": 2, "stream": True},
     "`prompt_logprobs` are not available when `stream=True`."),
    ({"prompt_logprobs": -1}, "Requested prompt logprobs of 264, which is greater than max"),
])
def test_bad_values_are_a_400_in_vllms_words(http, body, message):
    """test_completion.py's bad-parameter cases: SamplingParams' own message, a 400."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_chat_top_logprobs_are_the_k_most_likely(client):
    """test_chat.py::test_some_logprobs_chat: ``top_logprobs=k`` lists, for each token,
    the k most likely tokens (most likely first) with the model's log-probabilities."""
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        top = entry.top_logprobs
        assert len(top) == 3 and [t.logprob for t in top] == sorted(
            (t.logprob for t in top), reverse=True)
        assert top[0].token == entry.token  # greedy: the chosen token is the most likely
    streamed = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2, stream=True))
    entries = [e for ch in streamed if ch.choices and ch.choices[0].logprobs
               for e in ch.choices[0].logprobs.content]
    assert [len(e.top_logprobs) for e in entries] == [2] * len(content)
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content])
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                           temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_completion_logprobs_k_lists_the_k_most_likely_and_the_chosen(client):
    """test_completion.py::test_some_logprobs: ``logprobs=k`` gives each position a dict of
    the k most likely tokens, plus the chosen one when it is not among them."""
    r = client.completions.create(model=MODEL, prompt="def ", max_tokens=8, temperature=1.0,
                                  seed=0, logprobs=3)
    lp = r.choices[0].logprobs
    llm = LLM(TINY_CODE_LLAMA_DIR, num_blocks=64, device="cpu")  # (the server's is busy)
    ids = llm.tokenizer.encode("def ")
    want = llm.generate([ids], SamplingParams(max_tokens=8, temperature=1.0, seed=0,
                                              logprobs=3))[0].outputs[0]
    assert lp.tokens == [llm.tokenizer.decode([t]) for t in want.token_ids]
    for top, chosen, ref in zip(lp.top_logprobs, lp.tokens, want.logprobs, strict=True):
        assert chosen in top and len(top) in (3, 4)
        best = sorted(ref.values(), key=lambda x: x.rank)[:3]
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx([x.logprob
                                                                       for x in best])


@pytest.mark.parametrize("prompt", ["def add(a, b):", [104, 105, 40, 41]])
@pytest.mark.parametrize("logprobs_arg", [1, 0])
def test_echo_logprob_completion(client, prompt, logprobs_arg):
    """test_completion.py::test_echo_logprob_completion: with ``echo`` the text starts with
    the prompt (text, or token ids decoded), and with ``logprobs`` the prompt's tokens come
    first, the first with ``null`` logprob and top logprobs."""
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0,
                                  echo=True, logprobs=logprobs_arg)
    prompt_text = prompt if isinstance(prompt, str) else bytes(prompt).decode()
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                      temperature=0.0)
    assert r.choices[0].text == prompt_text + plain.choices[0].text
    lp = r.choices[0].logprobs
    n = len(prompt_text) + (1 if isinstance(prompt, str) else 0)  # (BOS with a text prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for top in lp.top_logprobs[1:]:
        assert max(logprobs_arg, 1) <= len(top) <= logprobs_arg + 1
    assert "".join(lp.tokens) == r.choices[0].text
    # streamed: the first chunk carries the prompt
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                            temperature=0.0, echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith(prompt_text)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_prompt_logprobs_completion_and_chat(client):
    """test_chat.py::test_prompt_logprobs_chat (and its completions twin): vLLM's extra
    ``prompt_logprobs`` field, ``null`` first, then each prompt token's ``{id: {logprob,
    rank, decoded_token}}`` with the token and the k most likely; equal to the engine's
    ``RequestOutput.prompt_logprobs``; absent unless asked for."""
    r = client.completions.create(model=MODEL, prompt="def f", max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    llm = LLM(TINY_CODE_LLAMA_DIR, num_blocks=64, device="cpu")  # (the server's is busy)
    ids = llm.tokenizer.encode("def f")
    want = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0,
                                              prompt_logprobs=2))[0].prompt_logprobs
    assert got[0] is None and len(got) == len(ids) == len(want)
    for tok, entry, ref in zip(ids[1:], got[1:], want[1:], strict=True):
        assert str(tok) in entry and 2 <= len(entry) <= 3
        assert {int(k): v["logprob"] for k, v in entry.items()} == pytest.approx(
            {k: v.logprob for k, v in ref.items()}, abs=1e-4)
        assert {v["rank"] for v in entry.values()} >= {1, 2}
        assert entry[str(tok)]["decoded_token"] == llm.tokenizer.decode([tok])
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == chat.usage.prompt_tokens
    assert all(len(entry) == 1 for entry in plp[1:])  # the prompt token itself
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert plain.model_extra["prompt_logprobs"] is None


def test_penalties_and_logit_bias_reach_the_engine(client):
    """vLLM's sampling fields do what the engine does with them: a bias of 100 makes its
    token the greedy answer; a stop token's text is left out, its id named."""
    x = ord("x")
    r = client.completions.create(model=MODEL, prompt="def ", max_tokens=4, temperature=0,
                                  logit_bias={str(x): 100})
    assert r.choices[0].text == "xxxx"
    r = client.completions.create(model=MODEL, prompt="def ", max_tokens=4, temperature=0,
                                  logit_bias={str(x): 100}, extra_body={
                                      "stop_token_ids": [x]})
    assert r.choices[0].text == "" and r.choices[0].stop_reason == x
    assert r.usage.completion_tokens == 1
    r = client.completions.create(model=MODEL, prompt="def ", max_tokens=4, temperature=0,
                                  logit_bias={str(x): 100}, extra_body={
                                      "stop_token_ids": [x], "include_stop_str_in_output": True})
    assert r.choices[0].text == "x"
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                       temperature=0, presence_penalty=2.0,
                                       frequency_penalty=2.0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_metrics_has_vllms_latency_histograms(http, client):
    """vLLM's ``vllm:e2e_request_latency_seconds``, ``vllm:inter_token_latency_seconds``
    and ``vllm:request_time_per_output_token_seconds`` (tests/entrypoints/openai/
    test_metrics.py lists them): one e2e and one per-request TPOT observation per finished
    request, one inter-token observation per output after the first."""
    def counts():
        m = parse_metrics(http.get("/metrics").text)
        return {k.split("_seconds")[0]: v for k, v in m.items()
                if k.endswith(f'_seconds_count{{model_name="{MODEL}"}}')}
    before = counts()
    assert set(before) == {"vllm:time_to_first_token", "vllm:e2e_request_latency",
                           "vllm:inter_token_latency", "vllm:request_time_per_output_token"}
    client.completions.create(model=MODEL, prompt="def ", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = counts()
    assert {k: after[k] - before[k] for k in after} == {
        "vllm:time_to_first_token": 1, "vllm:e2e_request_latency": 1,
        "vllm:inter_token_latency": 4, "vllm:request_time_per_output_token": 1}
