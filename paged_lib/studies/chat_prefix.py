"""Prefix caching on a real chat template: one system prompt, conversations turn by turn.

SGLang's RadixAttention paper (arXiv:2312.07104) and vLLM's "Automatic Prefix Caching" docs
name the multi-turn chat as the workload a prefix cache is for: every turn re-sends the
system prompt and the whole history. :mod:`paged_lib.studies.prefix_workloads` draws such
a workload as random token ids; this module serves a real one on a real chat model
(SmolLM2-135M-Instruct through :class:`paged_lib.LLM`): the system prompt and the user
turns are text, every prompt is rendered with the model's own chat template (ChatML:
``<|im_start|>system ... <|im_end|>``), and each answer is the model's own, put back into
the history as text and rendered again next turn.

:func:`serve_chat` runs the conversations round by round (one ``generate`` call per
round: every conversation's next turn in one batch) on an engine with
``enable_prefix_caching=True`` and records, per request, the prompt tokens the engine
read from the cache. Beside it, what the template *could* share: the longest start this
prompt has in common with anything the engine computed before it (an earlier request's
prompt and answer, but the answer's last token, whose K/V is never written; or the prompt
of a request scheduled before it in the same step): the system prompt and the template's
``<|im_start|>user`` after it, and for a later turn the conversation's whole history. A
cache only hits whole blocks, and never the last prompt token, so
:attr:`ChatTurn.reusable_hit` is that, rounded down to blocks: on a pool large enough
never to evict, the engine's hit must equal it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: The shared system prompt (a help desk), about 60 tokens in SmolLM2's vocabulary.
SYSTEM_PROMPT = ("You are Sage, the help desk assistant of the Riverside public library. "
                 "Answer in one or two short, friendly sentences. The library opens at 9 am "
                 "and closes at 8 pm, Monday to Saturday; it is closed on Sundays. Members "
                 "may borrow up to ten items for three weeks.")
#: Users' turns, one list per conversation.
CONVERSATIONS = (("Can I borrow books on a Sunday?", "How many books can I take?",
                  "And for how long?"),
                 ("When do you open on Monday?", "Is it open late on Friday?", "Thank you!"),
                 ("I lost my library card. What should I do?", "Does it cost anything?",
                  "Can I still borrow today?"),
                 ("Do you have books for kids?", "Can children get their own card?",
                  "What time do you close?"))


@dataclass(frozen=True)
class ChatTurn:
    """One request of the workload: a conversation's turn, as the engine served it."""

    conversation: int
    turn: int
    prompt_tokens: int
    hit_tokens: int       # prompt tokens whose K/V the engine read from the prefix cache
    system_tokens: int    # the rendered system message's tokens, at the start of every prompt
    computed_before: int  # tokens the engine computed for this conversation's last turn
    history_tokens: int   # of those, how many this prompt starts with
    shared_tokens: int    # the longest start in common with anything computed before it
    block_size: int
    answer: str
    finish_reason: str

    @property
    def reusable_hit(self) -> int:
        """What the template lets a cache hit: :attr:`shared_tokens`, capped one token
        before the prompt's end, in whole blocks."""
        return (min(self.shared_tokens, self.prompt_tokens - 1)
                // self.block_size * self.block_size)

    @property
    def history_came_back(self) -> bool:
        """Whether this prompt starts with every token the engine computed for the
        conversation's last turn: the answer, decoded to text and rendered again by the
        template, gave back the tokens the model generated."""
        return self.history_tokens == self.computed_before

    @property
    def system_hit(self) -> int:
        """The part of :attr:`hit_tokens` that falls in the system prompt."""
        return min(self.hit_tokens, self.system_tokens)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def serve_chat(llm, params, system_prompt: str = SYSTEM_PROMPT,
               conversations: Sequence[Sequence[str]] = CONVERSATIONS) -> list[ChatTurn]:
    """Serve every conversation turn by turn on ``llm`` (a :class:`paged_lib.LLM` built with
    ``enable_prefix_caching=True`` and a chat template; no chunked prefill, so a prefill is
    one piece); ``params`` the :class:`~paged_lib.engine.SamplingParams` of every answer.
    Round ``t`` sends turn ``t`` of every conversation that has one, in one batch. Returns
    one :class:`ChatTurn` per request, round by round."""
    engine, tok = llm.engine, llm.tokenizer
    if not engine.block_manager.enable_prefix_caching:
        raise ValueError("serve_chat measures the prefix cache: build the LLM with "
                         "enable_prefix_caching=True")
    if engine.scheduler.enable_chunked_prefill:
        raise ValueError("serve_chat reads a request's hit off its one prefill: build the "
                         "LLM without enable_chunked_prefill")
    system = [{"role": "system", "content": system_prompt}]
    system_tokens = len(tok.apply_chat_template(system, add_generation_prompt=False))
    histories = [list(system) for _ in conversations]
    computed: list[list[int]] = [[] for _ in conversations]  # K/V the last turn wrote
    everything: list[list[int]] = []  # every token sequence whose K/V the engine wrote
    hits: dict[int, int] = {}

    def watch(out, stats) -> None:
        for sc in out.scheduled:
            if sc.is_prefill and sc.group in out.admitted:
                hits[sc.group.request_id] = len(sc.seq.prompt_token_ids) - sc.num_new_tokens

    turns: list[ChatTurn] = []
    before = engine.on_step
    engine.on_step = watch
    try:
        for t in range(max(len(c) for c in conversations)):
            live = [i for i, c in enumerate(conversations) if t < len(c)]
            prompts = []
            for i in live:
                histories[i].append({"role": "user", "content": conversations[i][t]})
                prompts.append(tok.apply_chat_template(histories[i]))
                if prompts[-1][:system_tokens] != tok.apply_chat_template(
                        system, add_generation_prompt=False):
                    raise ValueError("the template does not start every prompt with the "
                                     "rendered system message")
            hits.clear()
            outs = engine.generate(prompts, params)
            before_round = list(everything)
            for k, (i, prompt, out) in enumerate(zip(live, prompts, outs, strict=True)):
                c = out.outputs[0]
                text = tok.decode(c.token_ids)
                earlier = before_round + prompts[:k]  # same step: the prompts before it
                turns.append(ChatTurn(i, t, len(prompt), hits[k], system_tokens,
                                      len(computed[i]), _common_prefix(prompt, computed[i]),
                                      max((_common_prefix(prompt, e) for e in earlier),
                                          default=0),
                                      engine.block_manager.block_size, text, c.finish_reason))
                histories[i].append({"role": "assistant", "content": text})
                computed[i] = prompt + c.token_ids[:-1]
                everything.append(computed[i])
    finally:
        engine.on_step = before
    return turns


def hit_rate(turns: Sequence[ChatTurn]) -> float:
    """Prompt tokens read from the cache over all prompt tokens."""
    return sum(t.hit_tokens for t in turns) / sum(t.prompt_tokens for t in turns)
