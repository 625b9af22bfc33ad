"""A request's state as it moves through the engine, and what the engine reports back.

* :class:`SamplingParams` - what the caller asks for (vLLM's keywords and defaults, in
  :mod:`~paged_lib.engine.sampling_params`).
* :class:`Sequence` - one line of text being generated: its tokens, its block table,
  how many of its tokens already have K/V in the cache.
* :class:`SequenceGroup` - one request: the sequences that share its prompt (1 for
  greedy, ``n`` for parallel sampling, ``beam_width`` for beam search). The scheduler
  admits, preempts and finishes a group as a whole (all or nothing).
* :class:`RequestOutput` / :class:`CompletionOutput` / :class:`Logprob` - the answer, one
  per prompt, in vLLM's shapes (built by :func:`~paged_lib.engine.outputs.request_output`).
* :class:`EngineStats` / :class:`RequestTimeline` - what happened, step by step, in a
  shape that plots directly (one list entry per engine step).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from paged_lib.blocks import BlockTable
from paged_lib.engine.detokenize import IncrementalDetokenizer
from paged_lib.engine.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "EngineStats", "Logprob", "RequestOutput", "RequestTimeline",
           "SamplingParams", "Sequence", "SequenceGroup", "SequenceStatus", "fork_samples"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # not admitted yet, or preempted by recompute
    RUNNING = "running"    # its K/V is in the GPU pool
    SWAPPED = "swapped"    # preempted by swap: its K/V is in the CPU pool
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generated line of text and where its K/V lives.

    ``num_cached`` counts the leading tokens whose K/V is in the cache. A token's K/V is
    written when the token is *fed in*, so after a decode step the newest sampled token
    is not cached yet: ``num_cached == num_tokens - 1`` while running. A prefix-cache hit
    starts it above 0 at admission; a chunked prefill raises it chunk by chunk while its
    table already holds the whole text (chapter 10).

    Once finished, ``finish_reason`` says why (``"length"`` or ``"stop"``) and
    ``stop_reason`` names the stop token id or stop string, if one ended it
    (:func:`~paged_lib.engine.stop.check_stop`). ``output_logprobs`` holds one
    ``{token id: Logprob}`` per generated token when the request asks for ``logprobs``;
    ``output_text`` is the text the stop-string check has seen (cut before the stop
    string once one is found), made by the sequence's own ``detokenizer``.
    """

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    block_table: BlockTable | None = None
    num_cached: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_text: str | None = None
    detokenizer: IncrementalDetokenizer | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_new_tokens(self) -> int:
        """Tokens the next step feeds in: the whole text in a (re-)prefill, else 1."""
        return self.num_tokens - self.num_cached

    def append(self, token: int, logprob: float,
               top: dict[int, Logprob] | None = None) -> None:
        """Add a sampled token and its log-probability (and, when the request asks for
        ``logprobs``, the token's ``{token id: Logprob}``: the top ones and itself)."""
        self.output_token_ids.append(token)
        self.cumulative_logprob += logprob
        if top is not None:
            self.output_logprobs.append(top)

    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass
class RequestTimeline:
    """When things happened to one request, in engine steps (for the timeline plot).

    A request waits from ``arrival_step`` to its first admitted step, runs until it is
    preempted or finished, and may be admitted again after a preemption.
    """

    arrival_step: int = 0
    admitted_steps: list[int] = field(default_factory=list)
    preempted_steps: list[int] = field(default_factory=list)
    finished_step: int | None = None
    num_output_tokens: int = 0  # its longest output, once finished

    def running_intervals(self) -> list[tuple[int, int]]:
        """Steps ``[start, end)`` the request ran: from each admission to the preemption
        that ended it (a preempted request does not run in its preemption step) or to
        its last step."""
        ends = list(self.preempted_steps)
        if self.finished_step is not None:
            ends.append(self.finished_step + 1)
        return list(zip(self.admitted_steps, ends, strict=False))

    def waiting_intervals(self) -> list[tuple[int, int]]:
        """Steps ``[start, end)`` the request waited: from arrival, and from each
        preemption, to its next admission."""
        starts = [self.arrival_step] + list(self.preempted_steps)
        return [(a, b) for a, b in zip(starts, self.admitted_steps, strict=False) if b > a]


@dataclass(eq=False)
class SequenceGroup:
    """One request: its sequences (they share the prompt), params, and bookkeeping."""

    request_id: int
    seqs: list[Sequence]
    params: SamplingParams
    generator: torch.Generator | None = None
    timeline: RequestTimeline = field(default_factory=RequestTimeline)
    error: str | None = None
    # beam search: finished beams kept as (token_ids, cumulative_logprob)
    beam_done: list[tuple[list[int], float]] = field(default_factory=list)
    # recompute of a group of several sequences, half way: the prompt's K/V is cached in
    # the first live sequence's table; next step the others fork it and every sequence
    # recomputes its own generated tail (see the scheduler's module docstring)
    awaiting_tails: bool = False
    #: vLLM's request priority (``scheduling_policy="priority"``: lower runs first)
    priority: int = 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished()]

    def is_finished(self) -> bool:
        return self.error is not None or not self.live_seqs()


def fork_samples(group: SequenceGroup, parent: Sequence, drawn: list[tuple]) -> None:
    """The other samples of an ``n > 1`` prefill: one child per ``(token, logprob)`` (or
    ``(token, logprob, top)``) in ``drawn``, each sharing ``parent``'s blocks (a fork) and
    appending its own token."""
    base = max(s.seq_id for s in group.seqs) + 1
    for k, sample in enumerate(drawn):
        child = Sequence(base + k, parent.prompt_token_ids, list(parent.output_token_ids),
                         parent.cumulative_logprob, parent.block_table.fork(),
                         parent.num_cached, SequenceStatus.RUNNING,
                         list(parent.output_logprobs))
        if parent.detokenizer is not None:  # the same text so far, its own from now on
            child.detokenizer = parent.detokenizer.fork()
        child.append(*sample)
        group.seqs.append(child)


@dataclass
class Logprob:
    """vLLM's ``Logprob``: a token's log-probability under the model (``log_softmax`` of
    its logits, before temperature and filters), its rank among all tokens (1: the most
    likely) and its text when a tokenizer served the request."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class CompletionOutput:
    """One finished sequence, as vLLM's ``CompletionOutput``.

    ``index`` is its place among the request's outputs; ``token_ids`` its generated
    tokens only (a stop token included); ``cumulative_logprob`` the sum of their
    log-probabilities under the model (temperature does not change it). ``text`` is the
    tokens decoded when a tokenizer served the request (:class:`~paged_lib.engine.llm.
    LLM`), ending before the stop string that stopped it; ``None`` from
    :meth:`LLMEngine.generate` without one. ``logprobs``: with ``SamplingParams(logprobs=
    k)``, one ``{token id: Logprob}`` per generated token (the ``k`` most likely and the
    chosen one), else ``None``. ``finish_reason`` is ``"length"`` (``max_tokens``) or
    ``"stop"`` (EOS, a stop token or a stop string, named in ``stop_reason``).
    """

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class RequestOutput:
    """The engine's answer to one prompt, as vLLM's ``RequestOutput``.

    ``prompt`` is the prompt's text when it came in as text (:class:`~paged_lib.engine.
    llm.LLM`), else ``None``; ``outputs`` are best first (beam search) or in sample order;
    ``finished`` is ``True`` once every output has finished (always, from ``generate``).

    ``error`` is this course's extra: a request that can never run here (longer than
    ``max_model_len``, more blocks than the whole pool) fails alone, with ``outputs``
    empty and ``error`` saying why, while the others run. vLLM has no such field: its
    ``LLM.generate`` raises ``ValueError`` for a prompt that is too long before anything
    runs, and its server answers that request with an HTTP 400 error.
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None
    #: with ``SamplingParams(prompt_logprobs=k)``: ``None``, then each prompt token's
    #: ``{token id: Logprob}`` (:mod:`~paged_lib.engine.prompt_logprobs`)
    prompt_logprobs: list | None = None


@dataclass
class EngineStats:
    """What one ``generate`` call did, one entry per engine step in every list.

    * ``batch_sizes`` - sequences that ran in the step;
    * ``blocks_used`` - GPU blocks held after the step's allocations;
    * ``step_kinds`` - ``"prefill"`` (only prompts, or texts recomputed, ran),
      ``"decode"`` (only one new token per sequence), ``"mixed"`` (both in one batch, as
      in Orca's iteration-level scheduling: ``scheduling="mixed"``; never with
      ``"prefill_first"``), ``"idle"`` when nothing had arrived yet;
    * ``prefill_seqs`` / ``decode_seqs`` - how many of the step's sequences prefilled
      and decoded (they add up to ``batch_sizes``);
    * ``step_seconds`` - wall-clock time of the step (scheduler, model, sampler);
    * ``tokens_per_step`` - tokens generated (sampled) in the step;
    * ``computed_tokens`` - tokens run through the model (prompt tokens count here);
    * ``requests`` - one :class:`RequestTimeline` per prompt, in prompt order.

    ``swapped_blocks`` counts block copies either way between GPU and CPU;
    ``recomputed_tokens`` the tokens prefilled again after a recompute preemption;
    ``prefix_cache_hit_tokens`` the tokens whose K/V a prefill found in the prefix cache
    (``enable_prefix_caching=True``) instead of computing it.
    """

    steps: int = 0
    preemptions: int = 0
    swapped_blocks: int = 0
    recomputed_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    peak_blocks_used: int = 0
    num_blocks: int = 0
    block_size: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    blocks_used: list[int] = field(default_factory=list)
    step_kinds: list[str] = field(default_factory=list)
    tokens_per_step: list[int] = field(default_factory=list)
    computed_tokens: list[int] = field(default_factory=list)
    prefill_seqs: list[int] = field(default_factory=list)
    decode_seqs: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    requests: list[RequestTimeline] = field(default_factory=list)
    #: wall-clock seconds spent in each part of the steps, summed: scheduling (schedule
    #: and update), model input, model (block moves, metadata, forward), sampling
    phase_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def generated_tokens(self) -> int:
        return sum(self.tokens_per_step)

    @property
    def peak_batch_size(self) -> int:
        return max(self.batch_sizes, default=0)

    def summary(self) -> dict[str, float | int]:
        """The scalar numbers, for a table or a sentence in a chapter (means over the
        steps that ran a model, idle steps left out)."""
        busy = [i for i, k in enumerate(self.step_kinds) if k != "idle"]
        return {"steps": self.steps, "preemptions": self.preemptions,
                "swapped_blocks": self.swapped_blocks,
                "recomputed_tokens": self.recomputed_tokens,
                "generated_tokens": self.generated_tokens,
                "peak_blocks_used": self.peak_blocks_used,
                "peak_batch_size": self.peak_batch_size,
                "mean_batch_size": round(sum(self.batch_sizes[i] for i in busy)
                                         / max(len(busy), 1), 2),
                "mean_tokens_per_step": round(self.generated_tokens / max(len(busy), 1), 2),
                "mean_blocks_used": round(sum(self.blocks_used[i] for i in busy)
                                          / max(len(busy), 1), 2)}

    def time_per_output_token(self, in_steps: bool = False) -> list[float | None]:
        """Per request (prompt order): the time from its first token to its last, over
        the tokens after the first (vLLM's TPOT), in seconds, or in engine steps
        (``in_steps=True``: deterministic, for a chapter's printed numbers). ``None`` for
        a request with fewer than two tokens."""
        ends = [0.0]
        for sec in self.step_seconds:  # when each step ended
            ends.append(ends[-1] + (1.0 if in_steps else sec))
        result: list[float | None] = []
        for t in self.requests:
            if t.num_output_tokens < 2 or t.finished_step is None or not t.admitted_steps:
                result.append(None)
                continue
            first = ends[t.admitted_steps[0] + 1]  # its first token comes from its prefill
            result.append((ends[t.finished_step + 1] - first) / (t.num_output_tokens - 1))
        return result

    def record_step(self, kind: str, batch_size: int, blocks_used: int, generated: int,
                    computed: int, prefills: int = 0, seconds: float = 0.0,
                    phases: dict[str, float] | None = None) -> None:
        for part, sec in (phases or {}).items():
            self.phase_seconds[part] = self.phase_seconds.get(part, 0.0) + sec
        self.steps += 1
        self.step_kinds.append(kind)
        self.prefill_seqs.append(prefills)
        self.decode_seqs.append(batch_size - prefills)
        self.step_seconds.append(seconds)
        self.batch_sizes.append(batch_size)
        self.blocks_used.append(blocks_used)
        self.peak_blocks_used = max(self.peak_blocks_used, blocks_used)
        self.tokens_per_step.append(generated)
        self.computed_tokens.append(computed)
