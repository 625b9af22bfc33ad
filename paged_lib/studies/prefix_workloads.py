"""Workloads where prefix caching matters: seeded token-id prompts that share prefixes.

Three kinds of sharing, among those SGLang's RadixAttention paper (arXiv:2312.07104,
section 3: few-shot examples, multi-turn chat, a shared system prompt) and vLLM's
"Automatic Prefix Caching" docs (multi-round conversation, questions over one long
document) give as reasons to cache, and a control:

* :func:`shared_system_prompt` - one system prompt, then a different question each time;
* :func:`multi_turn_chat` - several conversations, interleaved turn by turn; each turn
  re-sends the whole history (earlier questions *and* answers) before a new question;
* :func:`few_shot` - the same ``k`` worked examples, then a new query;
* :func:`no_sharing` - unrelated prompts whose first tokens all differ: no cache can hit.

Each returns a list of :class:`PrefixRequest` ``(prompt, output)``: the prompt's token
ids and the answer's token ids. The answer is fixed by the workload so that a chat's next
turn can contain it (a real model's answer would be re-sent the same way); a replay
caches ``prompt + output`` as an engine caches what it computed, and an engine serving
these prompts uses ``len(output)`` as ``max_tokens``.

All lengths are in tokens; a ``(lo, hi)`` pair draws uniformly from ``lo..hi``
inclusive. Defaults keep every prompt to a few hundred tokens so a CPU engine can serve
them. Token ids are drawn from ``0..vocab_size-1`` (default 256: the byte ids of
:mod:`paged_lib.tokenizer`, so no BOS or EOS appears by chance), with
``numpy.random.default_rng(seed)``: a seed gives the same workload on every machine.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from paged_lib.tokenizer import NUM_BYTES


class PrefixRequest(NamedTuple):
    """One request: ``prompt`` token ids in, ``output`` token ids out (both lists)."""

    prompt: list[int]
    output: list[int]

    @property
    def output_len(self) -> int:
        return len(self.output)


def _check_range(name: str, r: tuple[int, int]) -> tuple[int, int]:
    lo, hi = r
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ValueError(f"{name} must be a pair of ints 1 <= lo <= hi, got {r!r}")
    return lo, hi


def _check_count(name: str, n: int, lo: int = 0) -> None:
    if not isinstance(n, int) or n < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {n!r}")


class _Draw:
    """Token runs and lengths from one seeded generator."""

    def __init__(self, seed: int, vocab_size: int):
        _check_count("vocab_size", vocab_size, 2)
        self.rng = np.random.default_rng(seed)
        self.vocab_size = vocab_size

    def length(self, r: tuple[int, int]) -> int:
        return int(self.rng.integers(r[0], r[1] + 1))

    def tokens(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(0, self.vocab_size, size=n)]


def shared_system_prompt(num_requests: int = 16, system_len: int = 200,
                         question_len: tuple[int, int] = (20, 60),
                         output_len: tuple[int, int] = (16, 32), seed: int = 0,
                         vocab_size: int = NUM_BYTES) -> list[PrefixRequest]:
    """``system_len`` tokens shared by every request, then its own question.

    Default: 16 prompts of 220-260 tokens, each with the same first 200.
    """
    _check_count("num_requests", num_requests)
    _check_count("system_len", system_len, 1)
    question_len, output_len = _check_range("question_len", question_len), \
        _check_range("output_len", output_len)
    draw = _Draw(seed, vocab_size)
    system = draw.tokens(system_len)
    return [PrefixRequest(system + draw.tokens(draw.length(question_len)),
                          draw.tokens(draw.length(output_len)))
            for _ in range(num_requests)]


def multi_turn_chat(num_conversations: int = 4, num_turns: int = 4,
                    user_len: tuple[int, int] = (20, 50),
                    output_len: tuple[int, int] = (20, 40), system_len: int = 0,
                    seed: int = 0, vocab_size: int = NUM_BYTES) -> list[PrefixRequest]:
    """Interleaved conversations: turn ``t`` of every conversation, then turn ``t + 1``.

    Turn ``t``'s prompt is the conversation so far (an optional shared system prompt of
    ``system_len`` tokens, then each earlier question and its answer) followed by a new
    question; its output is the answer, which the next turn re-sends. Default: 4
    conversations of 4 turns, 16 requests, the last prompts about 200-330 tokens.
    """
    _check_count("num_conversations", num_conversations)
    _check_count("num_turns", num_turns)
    _check_count("system_len", system_len)
    user_len, output_len = _check_range("user_len", user_len), \
        _check_range("output_len", output_len)
    draw = _Draw(seed, vocab_size)
    system = draw.tokens(system_len)
    history = [list(system) for _ in range(num_conversations)]
    out = []
    for _ in range(num_turns):
        for c in range(num_conversations):
            prompt = history[c] + draw.tokens(draw.length(user_len))
            answer = draw.tokens(draw.length(output_len))
            out.append(PrefixRequest(prompt, answer))
            history[c] = prompt + answer
    return out


def few_shot(num_requests: int = 16, num_examples: int = 4,
             example_len: tuple[int, int] = (40, 60), query_len: tuple[int, int] = (10, 30),
             output_len: tuple[int, int] = (8, 16), seed: int = 0,
             vocab_size: int = NUM_BYTES) -> list[PrefixRequest]:
    """The same ``num_examples`` examples (drawn once), then a new query each time.

    Default: 4 examples of 40-60 tokens (one shared run of 160-240), queries of 10-30.
    """
    _check_count("num_requests", num_requests)
    _check_count("num_examples", num_examples)
    example_len, query_len, output_len = (_check_range("example_len", example_len),
                                          _check_range("query_len", query_len),
                                          _check_range("output_len", output_len))
    draw = _Draw(seed, vocab_size)
    shots = [t for _ in range(num_examples) for t in draw.tokens(draw.length(example_len))]
    return [PrefixRequest(shots + draw.tokens(draw.length(query_len)),
                          draw.tokens(draw.length(output_len)))
            for _ in range(num_requests)]


def no_sharing(num_requests: int = 16, prompt_len: tuple[int, int] = (200, 260),
               output_len: tuple[int, int] = (16, 32), seed: int = 0,
               vocab_size: int = NUM_BYTES) -> list[PrefixRequest]:
    """The control: random prompts whose first tokens all differ, so no request's
    prompt starts like any other request's ``prompt + output`` and no cache can hit
    (hence at most ``vocab_size`` requests). Default: 16 prompts of 200-260 tokens."""
    _check_count("num_requests", num_requests)
    prompt_len, output_len = _check_range("prompt_len", prompt_len), \
        _check_range("output_len", output_len)
    draw = _Draw(seed, vocab_size)
    if num_requests > vocab_size:
        raise ValueError(f"no_sharing gives each prompt its own first token: at most "
                         f"vocab_size={vocab_size} requests, got {num_requests}")
    firsts = draw.rng.permutation(vocab_size)[:num_requests]
    return [PrefixRequest([int(f)] + draw.tokens(draw.length(prompt_len) - 1),
                          draw.tokens(draw.length(output_len)))
            for f in firsts]


#: The four default workloads by name (each a function of ``seed``).
PREFIX_WORKLOADS = {
    "system-prompt": shared_system_prompt,
    "multi-turn": multi_turn_chat,
    "few-shot": few_shot,
    "no-sharing": no_sharing,
}


def prompt_tokens(requests: list[PrefixRequest]) -> int:
    """Prompt tokens over all requests (the denominator of a hit rate)."""
    return sum(len(r.prompt) for r in requests)


def shared_prefix_bound(requests: list[PrefixRequest]) -> int:
    """The most prompt tokens any prefix cache could serve, with unbounded memory and a
    page of one token: for each request, its longest common prefix with an earlier
    request's ``prompt + output``, keeping the last prompt token to compute."""
    seen: list[list[int]] = []
    total = 0
    for r in requests:
        best = 0
        for s in seen:
            n = 0
            while n < min(len(s), len(r.prompt) - 1) and s[n] == r.prompt[n]:
                n += 1
            best = max(best, n)
        total += best
        seen.append(r.prompt + r.output)
    return total


class TimedRequest(NamedTuple):
    """A request that joins the waiting queue at step ``arrival``; ``group`` names the
    prompt it starts with (``"A"``, ``"B"``, or ``"outsider"``, which shares nothing)."""

    arrival: int
    request: PrefixRequest
    group: str


def two_prompt_burst(burst_steps: int = 24, system_len: int = 64,
                     question_len: tuple[int, int] = (8, 16), output_len: int = 4,
                     seed: int = 0, vocab_size: int = NUM_BYTES) -> list[TimedRequest]:
    """A burst for cache-aware scheduling: at each of ``burst_steps`` steps one request
    with system prompt A and one with system prompt B arrive (each prompt ``system_len``
    tokens, then a question); at step 0 an outsider arrives too, right after the first
    A and B, whose prompt (as long as the others) starts with no prompt's first token.

    A server that finishes one request per step falls behind, so a queue builds up.
    """
    _check_count("burst_steps", burst_steps, 1)
    _check_count("system_len", system_len, 1)
    _check_count("output_len", output_len, 1)
    question_len = _check_range("question_len", question_len)
    if vocab_size < 3:
        raise ValueError(f"two_prompt_burst needs vocab_size >= 3, got {vocab_size}")
    draw = _Draw(seed, vocab_size)
    system = {g: draw.tokens(system_len) for g in "AB"}
    out = []
    for step in range(burst_steps):
        for g in "AB":
            out.append(TimedRequest(step, PrefixRequest(
                system[g] + draw.tokens(draw.length(question_len)),
                draw.tokens(output_len)), g))
        if step == 0:
            first = next(t for t in range(vocab_size) if t not in (system["A"][0],
                                                                    system["B"][0]))
            prompt = [first] + draw.tokens(system_len + question_len[1] - 1)
            out.append(TimedRequest(0, PrefixRequest(prompt, draw.tokens(output_len)),
                                    "outsider"))
    return out
