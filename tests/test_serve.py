"""``python -m paged_lib.serve`` against OpenAI's own client, as vLLM users meet it.

One server process for the module (the shipped tiny model, on 127.0.0.1 and a free port),
started once and stopped at the end. Greedy answers must be the engine's own
(``LLMEngine.generate`` of the same prompt, alone), also with 32 clients streaming at once;
a stream closed half way has its request aborted and its blocks freed; bad requests get
OpenAI's error shape and a 4xx; afterwards every block is free and the server answers.
"""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from paged_lib.course.demos.server import local_server
from paged_lib.data import TINY_CODE_LLAMA_DIR
from paged_lib.engine import LLM, SamplingParams
from paged_lib.serve.api_server import (
    FALLBACK_CHAT_FORMAT,
    FALLBACK_GENERATION_PROMPT,
    build_app,
)
from paged_lib.serve.metrics import parse_metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
NUM_BLOCKS, MAX_NUM_SEQS = 96, 16
STARTUP_S = 120


@pytest.fixture(scope="module")
def server():
    """The server on the tiny model, as chapter 14 starts it (waits for /health)."""
    with local_server(name=MODEL, num_blocks=NUM_BLOCKS, max_num_seqs=MAX_NUM_SEQS,
                      startup_s=STARTUP_S) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of one prompt served alone by the engine: ``reference(text, n)``."""
    llm = LLM(TINY_CODE_LLAMA_DIR, num_blocks=NUM_BLOCKS, device="cpu")

    def greedy(text: str, max_tokens: int) -> tuple[str, list[int], float]:
        ids = llm.tokenizer.encode(text)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        c = llm.engine.generate([ids], params)[0].outputs[0]
        return llm.tokenizer.decode(c.token_ids), c.token_ids, c.cumulative_logprob
    return greedy


def _metrics(base: str) -> dict[str, float]:
    """``/metrics`` by sample name, the ``model_name`` label left out."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {k.replace(f'model_name="{MODEL}",', "").replace(f'{{model_name="{MODEL}"}}', ""): v
            for k, v in parse_metrics(text).items()}


def _wait_idle(base: str, polls: int = 1200) -> dict[str, float]:
    """``/metrics`` once the server holds no request and no block. Waiting is not timed:
    it polls up to ``polls`` times, 0.1 s apart (two minutes, far past the seconds it
    takes), and fails saying the server never went idle."""
    for _ in range(polls):
        m = _metrics(base)
        if (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                and m["vllm:kv_cache_usage_perc"] == 0):
            return m
        time.sleep(0.1)
    pytest.fail(f"the server never went idle: {m}")


def test_health_and_models(server, client):
    assert httpx.get(f"{server}/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_is_the_engines_greedy_answer(client, reference):
    text, ids, cumulative = reference("def ", 16)
    r = client.completions.create(model=MODEL, prompt="def ", max_tokens=16, temperature=0,
                                  logprobs=0)
    c = r.choices[0]
    assert c.text == text and c.finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == len(ids) and r.usage.prompt_tokens == 5
    assert sum(c.logprobs.token_logprobs) == pytest.approx(cumulative, abs=1e-4)


def test_streamed_completion_equals_the_whole_one(client, reference):
    text, _, _ = reference("class Stack:\n    def ", 24)
    chunks = list(client.completions.create(model=MODEL, prompt="class Stack:\n    def ",
                                            max_tokens=24, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == text
    assert len([ch for ch in chunks if ch.choices[0].text]) > 1  # pieces, as they come
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_chat_whole_and_streamed(client, reference):
    messages = [{"role": "user", "content": "Write a function"}]
    prompt = FALLBACK_CHAT_FORMAT.format(**messages[0]) + FALLBACK_GENERATION_PROMPT
    text, _, _ = reference(prompt, 12)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_n_samples(client):
    r = client.completions.create(model=MODEL, prompt="import ", max_tokens=8, n=2,
                                  temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens <= 16
    again = client.completions.create(model=MODEL, prompt="import ", max_tokens=8, n=2,
                                      temperature=1.0, seed=3)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded
    ended = [ch.choices[0].index for ch in client.completions.create(
        model=MODEL, prompt="import ", max_tokens=8, n=2, temperature=1.0, seed=3, stream=True)
        if ch.choices[0].finish_reason]
    assert sorted(ended) == [0, 1]


def test_stop_string_across_tokens_is_cut(client, reference):
    text, _, _ = reference("def ", 24)
    stop = text[6:9]  # three byte tokens: a stop that straddles them
    want = text[:text.index(stop)]
    r = client.completions.create(model=MODEL, prompt="def ", max_tokens=24, temperature=0,
                                  stop=[stop, "never-seen"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == stop
    streamed = list(client.completions.create(model=MODEL, prompt="def ", max_tokens=24,
                                              temperature=0, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_32_concurrent_streams_each_get_their_own_tokens(server, client, reference):
    prompts = [f"def f{i}(x):\n    " if i % 2 else f"# step {i}\nimport " for i in range(32)]

    def ask(prompt: str) -> str:
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                           temperature=0, stream=True)
        return "".join(ch.choices[0].text for ch in stream)

    start = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(ask, prompts))
    seconds = time.perf_counter() - start
    print(f"32 concurrent streaming clients, 12 tokens each: {seconds:.2f} s")
    assert got == [reference(p, 12)[0] for p in prompts]
    _wait_idle(server)


def test_a_closed_stream_is_aborted_and_its_blocks_freed(server, client):
    before = _metrics(server)
    stream = client.completions.create(model=MODEL, prompt="def ", max_tokens=400,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    pieces = iter(stream)
    next(pieces), next(pieces)
    stream.close()  # the connection goes, the request is still running
    key = 'vllm:request_success_total{finished_reason="abort"}'
    for _ in range(1200):  # polled, not timed: up to two minutes
        if _metrics(server)[key] != before[key]:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the closed stream was never aborted")
    after = _wait_idle(server)
    made = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 2 <= made < 400, made
    print(f"closed stream: {made:.0f} of 400 tokens made before the abort")


BAD = [
    ("malformed JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', 400),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404),
    ("max_tokens < 1", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400),
    ("prompt too long", "/v1/completions",
     {"model": MODEL, "prompt": "x" * 600, "max_tokens": 4}, 400),
    ("penalty out of range", "/v1/completions",
     {"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400),
    ("n > max_num_seqs", "/v1/completions",
     {"model": MODEL, "prompt": "x", "n": MAX_NUM_SEQS + 1, "temperature": 1.0}, 400),
    ("greedy n > 1", "/v1/completions",
     {"model": MODEL, "prompt": "x", "n": 2, "temperature": 0}, 400),
    ("token id outside the vocabulary", "/v1/completions",
     {"model": MODEL, "prompt": [999]}, 400),
    ("two prompts", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400),
    ("negative temperature", "/v1/completions",
     {"model": MODEL, "prompt": "x", "temperature": -1}, 400),
    ("no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("unknown role", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
    ("chat too long", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x" * 600}]}, 400),
    ("not a route", "/v1/nothing", {}, 404),
]


@pytest.mark.parametrize(("path", "body", "status"), [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])
def test_bad_requests_get_openais_error_shape_and_a_4xx(server, path, body, status):
    kw = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server}{path}", timeout=30, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == status


def test_bad_requests_through_the_client(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="x" * 600, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", stream=True, max_tokens=0)


def test_an_engine_failure_is_a_503_or_an_error_event_and_serving_goes_on():
    """In this process (a step made to fail): OpenAI's error shape, never a stuck request."""
    from fastapi.testclient import TestClient

    llm = LLM(TINY_CODE_LLAMA_DIR, num_blocks=32, device="cpu")
    execute, failing = llm.engine.runner.execute, [True]

    def execute_or_fail(inp):
        if failing[0]:
            raise RuntimeError("planted failure")
        return execute(inp)

    llm.engine.runner.execute = execute_or_fail
    body = {"model": MODEL, "prompt": "def ", "max_tokens": 4, "temperature": 0}
    with TestClient(build_app(llm, MODEL)) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 503 and "planted failure" in r.json()["error"]["message"]
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line]
        assert r.status_code == 200 and events[-1] == "data: [DONE]"
        assert "planted failure" in events[-2] and '"error"' in events[-2]
        failing[0] = False
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert llm.engine.block_manager.num_used_blocks == 0


def test_afterwards_every_block_is_free_and_the_server_answers(server, client):
    m = _wait_idle(server)
    assert m["vllm:prompt_tokens_total"] > 0 and m["vllm:generation_tokens_total"] > 0
    assert m["vllm:time_to_first_token_seconds_count"] > 0
    assert m["vllm:num_preemptions_total"] >= 0 and "vllm:prefix_cache_hits_total" in m
    r = client.completions.create(model=MODEL, prompt="def ", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4 or r.choices[0].finish_reason == "stop"
    assert _wait_idle(server)["vllm:kv_cache_usage_perc"] == 0
