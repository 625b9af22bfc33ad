"""Chapter 10's measured studies: prefix-cache hits on a chat workload rendered through a
chat template (:mod:`paged_lib.studies.chat_prefix`) and what chunked prefill costs a long
prompt's first token (:mod:`paged_lib.studies.chunked_ttft`).

The fast tests serve the shipped tiny model with a ChatML-like template over its byte
tokenizer; one test serves SmolLM2-135M-Instruct through its own template (a few tokens,
a few seconds), skipped when the package that ships it is not installed.
"""

from __future__ import annotations

import pytest
from conftest import needs_smollm2

from paged_lib.engine import LLM, SamplingParams
from paged_lib.model import load_tiny_code_llama
from paged_lib.studies import chat_prefix, chunked_ttft
from paged_lib.tokenizer import ByteTokenizer
from paged_lib.util import cdiv

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ByteChat(ByteTokenizer):
    """A ChatML-like template over the byte tokenizer (BOS, then one line per message)."""

    def render_chat(self, messages, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return self.encode(self.render_chat(messages, add_generation_prompt))


@pytest.fixture(scope="module")
def tiny():
    return load_tiny_code_llama()


def _llm(model, **options):
    return LLM(model, tokenizer=ByteChat(), num_blocks=96, block_size=8,
               enable_prefix_caching=True, **options)


def test_chat_hits_are_what_the_template_shares_in_whole_blocks(tiny):
    convs = (("def add(a, b):", "and sub?", "now mul"), ("class Point:", "add __eq__"))
    params = SamplingParams(temperature=0.0, max_tokens=6)
    turns = chat_prefix.serve_chat(_llm(tiny), params, "You write short Python code.", convs)
    assert [(t.conversation, t.turn) for t in turns] == [(0, 0), (1, 0), (0, 1), (1, 1),
                                                          (0, 2)]
    system = len(ByteChat().apply_chat_template(
        [{"role": "system", "content": "You write short Python code."}], False))
    assert all(t.system_tokens == system for t in turns)
    assert turns[0].hit_tokens == 0  # nothing cached yet
    # the second conversation's first turn hits the system prompt computed in the same step
    # (the system message and the template's "<user>" after it, in whole blocks)
    assert turns[1].hit_tokens == turns[1].shared_tokens // 8 * 8 >= system // 8 * 8 > 0
    assert turns[1].shared_tokens == system + len("<user>")
    for t in turns:
        assert t.hit_tokens == t.reusable_hit, t
        assert t.hit_tokens % 8 == 0 and t.hit_tokens < t.prompt_tokens
        assert t.system_hit == min(t.hit_tokens, system)
    later = [t for t in turns if t.turn > 0]
    assert all(t.computed_before == 0 for t in turns if t.turn == 0)
    prev = {(t.conversation, t.turn + 1): t for t in turns}
    for t in later:  # the last prompt and up to 6 - 1 answer tokens (the last is unwritten)
        p = prev[t.conversation, t.turn].prompt_tokens
        assert p <= t.computed_before <= p + 5
    # a later turn re-sends its history: it hits more than the system prompt
    assert all(t.history_tokens > system and t.hit_tokens > system // 8 * 8 for t in later)
    rate = chat_prefix.hit_rate(turns)
    assert rate == pytest.approx(sum(t.hit_tokens for t in turns)
                                 / sum(t.prompt_tokens for t in turns))
    assert 0.3 < rate < 1


def test_chat_hits_match_a_run_without_caching(tiny):
    convs = (("def f(x):", "again"),)
    params = SamplingParams(temperature=0.0, max_tokens=5)
    cached = chat_prefix.serve_chat(_llm(tiny), params, "sys", convs)
    plain = LLM(tiny, tokenizer=ByteChat(), num_blocks=96, block_size=8)
    # the same answers without a cache (and serve_chat refuses an engine without one)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        chat_prefix.serve_chat(plain, params, "sys", convs)
    tok = ByteChat()
    history = [{"role": "system", "content": "sys"}]
    for turn, text in zip(cached, convs[0], strict=True):
        history.append({"role": "user", "content": text})
        out = plain.engine.generate([tok.apply_chat_template(history)], params)[0]
        assert tok.decode(out.outputs[0].token_ids) == turn.answer
        history.append({"role": "assistant", "content": turn.answer})


def test_chat_refuses_chunked_prefill(tiny):
    llm = _llm(tiny, enable_chunked_prefill=True, max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="chunked"):
        chat_prefix.serve_chat(llm, SamplingParams(max_tokens=2), "s", (("q",),))


@pytest.mark.slow
@needs_smollm2
def test_chat_on_smollm2_s_own_template():
    llm = LLM("SmolLM2-135M-Instruct", num_blocks=64, block_size=16,
              enable_prefix_caching=True)
    convs = (("Hi!", "Thanks."), ("Hello!",))
    turns = chat_prefix.serve_chat(llm, SamplingParams(temperature=0.0, max_tokens=3),
                                   conversations=convs)
    # ChatML: the rendered system message ends with <|im_end|>\n; every prompt starts with it
    assert llm.tokenizer.decode(llm.tokenizer.apply_chat_template(
        [{"role": "system", "content": chat_prefix.SYSTEM_PROMPT}], False),
        skip_special_tokens=False).startswith("<|im_start|>system\n")
    assert all(t.hit_tokens == t.reusable_hit for t in turns)
    assert turns[1].hit_tokens >= turns[1].system_tokens // 16 * 16 > 0
    # the model's answer, rendered again as text, gives back the tokens it generated
    assert turns[2].history_came_back
    assert turns[2].computed_before == turns[0].prompt_tokens + 2  # 3 tokens, last unwritten


# ------------------------------------------------------------------ chunked prefill: TTFT


def test_ttft_of_one_prompt_is_its_number_of_chunks(tiny):
    prompt = [256] + list(range(100, 199))  # BOS + 99 bytes
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    runs = chunked_ttft.measure_ttft(tiny, [prompt], params, [0],
                                     chunked_ttft.budget_configs((16, 32, 100)))
    assert [r.ttft_steps[0] for r in runs.values()] == [1, cdiv(100, 16), cdiv(100, 32), 1]
    assert [r.max_step_tokens for r in runs.values()] == [100, 16, 32, 100]
    for r in runs.values():
        assert r.ttft_seconds[0] == pytest.approx(sum(r.step_seconds[:r.ttft_steps[0]]))
        assert r.mean_ttft_steps([0]) == r.ttft_steps[0]
    again = chunked_ttft.serve_and_time(tiny, [prompt], params, [0], "x", repeats=3,
                                        enable_chunked_prefill=True, max_num_batched_tokens=32,
                                        max_num_seqs=32)
    assert again.ttft_steps == [cdiv(100, 32)] and len(again.step_seconds) == 6
    with pytest.raises(ValueError, match="repeats"):
        chunked_ttft.serve_and_time(tiny, [prompt], params, [0], repeats=0)


def test_ttft_counts_from_arrival_and_grows_as_the_budget_shrinks(tiny):
    from paged_lib.course.demos import prefix_cache as demo

    prompts, params, arrivals = demo.long_prompt_trace()
    runs = chunked_ttft.measure_ttft(tiny, prompts, params, arrivals,
                                     chunked_ttft.budget_configs((16, 32, 64)))
    long = [i for i, p in enumerate(prompts) if len(p) > 100]
    means = [r.mean_ttft_steps(long) for r in runs.values()]
    assert means[0] == 1  # whole prompts: prefilled the step they arrive in
    assert means[1] > means[2] > means[3] > 1  # budgets 16, 32, 64
    for budget, r in zip((16, 32, 64), list(runs.values())[1:], strict=True):
        assert r.max_step_tokens <= budget
        # 4 decodes share the budget: each long prompt needs at least this many chunks
        assert all(r.ttft_steps[i] >= cdiv(len(prompts[i]), budget) for i in long)
        assert all(0 < r.ttft_seconds[i] <= sum(r.step_seconds) for i in range(7))


def test_prefill_first_and_mixed_give_one_step_to_a_lone_prompt(tiny):
    prompt = [256] + list(range(100, 140))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    configs = {"whole": {}, "prefill first": {"scheduling": "prefill_first"}}
    runs = chunked_ttft.measure_ttft(tiny, [prompt], params, [0], configs)
    assert list(runs) == ["whole", "prefill first"]
    assert [r.ttft_steps for r in runs.values()] == [[1], [1]]
    with pytest.raises(RuntimeError, match="never produced"):
        # a prompt that can never fit the pool fails alone, with no token
        chunked_ttft.serve_and_time(tiny, [prompt], params, [0], num_blocks=2, block_size=8)
