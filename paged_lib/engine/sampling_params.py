"""What a caller asks for: vLLM's :class:`SamplingParams` and :class:`BeamSearchParams`.

The keywords and defaults are vLLM's, so a learner's first vLLM program runs here as it
is: ``SamplingParams(temperature=0.8, top_p=0.95)`` samples 16 tokens (vLLM's default
``max_tokens``), and greedy decoding is asked for by name, ``temperature=0.0``. The course
adds beam search on the engine's own beam groups (the paper's §4.4): ``beam_width``,
``length_penalty``, ``early_stopping``, as vLLM v0 had them.

Values are checked when the object is built, as vLLM's ``SamplingParams.__post_init__``
(its ``_verify_args``) does, and a bad one raises ``ValueError`` in vLLM's words:
``SamplingParams(top_p=0.0)`` raises "top_p must be in (0, 1], got 0.0.". What depends on
the model (a token id outside the vocabulary, ``logprobs`` above the engine's
``max_logprobs``) is checked when the engine takes the request, as vLLM's processor does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

#: vLLM's ``_SAMPLING_EPS``: a temperature below it is greedy decoding
SAMPLING_EPS = 1e-5
#: the most top log-probabilities a request may ask for (vLLM's default ``max_logprobs``)
MAX_LOGPROBS = 20


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to generate for one request (keywords only, vLLM's names and defaults).

    * ``n`` samples share the prompt's blocks (parallel sampling, copy-on-write);
    * the logits are changed in vLLM's order (:func:`~paged_lib.engine.sampler.sample`):
      ``allowed_token_ids`` (only those may be drawn), ``bad_words`` (a word's last token
      is banned where its other tokens were just generated), the ``min_tokens`` mask,
      ``logit_bias`` (``{token id: added to its logit}``), then the penalties:
      ``repetition_penalty`` (1.0: off; > 1 makes every token of the prompt and output
      less likely), ``frequency_penalty`` and ``presence_penalty`` (0: off; in [-2, 2]:
      subtracted once per occurrence in the output / once if it occurs at all);
    * ``temperature`` (1.0) divides the logits; ``0`` (below 1e-5) is greedy; then
      ``min_p`` (0: off) drops tokens less likely than ``min_p`` times the most likely,
      ``top_k`` (0 or -1: off) and ``top_p`` (1.0: off) keep only the ``k`` most likely
      tokens and the smallest set whose probability reaches ``p``;
    * ``seed`` fixes the request's own generator, so its samples do not depend on what
      else is in the batch;
    * ``max_tokens`` (16) new tokens at most (finish reason ``"length"``; ``None``: what
      the context has left, ``max_model_len`` minus the prompt); before ``min_tokens`` of
      them, EOS and ``stop_token_ids`` cannot be drawn (their logits are masked);
    * the request stops (finish reason ``"stop"``) at EOS unless ``ignore_eos``, at any of
      ``stop_token_ids`` (its id kept in ``token_ids``, its text left out of ``text``,
      the id in ``stop_reason``), or, when a tokenizer serves it
      (:class:`~paged_lib.engine.llm.LLM`), at any of the ``stop`` strings (a str or a
      list): its text ends before the stop string, or after it with
      ``include_stop_str_in_output=True``;
    * ``logprobs=k`` returns, for each generated token, the ``k`` most likely tokens'
      log-probabilities and the chosen token's (``CompletionOutput.logprobs``); ``-1``
      the whole vocabulary (the engine's ``max_logprobs`` permitting, as in vLLM);
      ``prompt_logprobs=k`` the same for each prompt token (``RequestOutput.
      prompt_logprobs``: :mod:`~paged_lib.engine.prompt_logprobs`).

    Beam search (the engine's beam groups, as vLLM v0 and transformers): ``beam_width``
    beams ranked by the model's log-probabilities (``temperature`` is ignored; ``n``,
    ``top_p``, ``top_k``, stop conditions, logprobs and the logits options are refused). A
    finished hypothesis scores ``cumulative_logprob / len(token_ids) ** length_penalty``;
    ``early_stopping`` says when the search ends: ``True`` as soon as ``beam_width``
    hypotheses are finished, ``False`` when no running beam can still beat the worst of
    them at its current length, ``"never"`` the same at ``max_tokens`` when
    ``length_penalty > 0``.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self):
        # as vLLM: stop becomes a list of strings, stop_token_ids and bad_words lists
        # (empty when None), logprobs=True is 1; then every value is checked
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, list | tuple):
            stop = list(stop)
        object.__setattr__(self, "stop", stop)
        for name in ("stop_token_ids", "bad_words"):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, [])
            elif isinstance(value, list | tuple):
                object.__setattr__(self, name, list(value))
        if isinstance(self.allowed_token_ids, tuple):
            object.__setattr__(self, "allowed_token_ids", list(self.allowed_token_ids))
        if self.logprobs is True:
            object.__setattr__(self, "logprobs", 1)
        if problem := self._problem():
            raise ValueError(problem)

    def __hash__(self) -> int:  # (lists and dicts are not hashable; a request's params may be)
        return hash(tuple(_frozen(getattr(self, f.name)) for f in fields(self)))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs at once (blocks are reserved for all of them)."""
        return self.beam_width if self.beam_width is not None else self.n

    @property
    def changes_logits(self) -> bool:
        """Does the sampler change this request's logits before temperature (the logits
        options: allowed ids, bad words, bias, penalties)?"""
        return bool(self.allowed_token_ids is not None or self.bad_words or self.logit_bias
                    or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def problem(self) -> str | None:
        """What is wrong with these parameters: always ``None``, since a bad value raised
        when the object was built (kept for the engine's checks, which call it)."""
        return self._problem()

    def _problem(self) -> str | None:
        """vLLM's ``_verify_args``, in its words (a wrong type gets a message of its own)."""
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p", "length_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or math.isnan(value):
                return f"{name} must be a number, got {value!r}"
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                return f"{name} must be an int, got {getattr(self, name)!r}"
        if self.max_tokens is not None and not _is_int(self.max_tokens):
            return f"max_tokens must be an int or None, got {self.max_tokens!r}"
        if self.n < 1:
            return f"n must be at least 1, got {self.n}."
        if not -2.0 <= self.presence_penalty <= 2.0:
            return f"presence_penalty must be in [-2, 2], got {self.presence_penalty}."
        if not -2.0 <= self.frequency_penalty <= 2.0:
            return f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}."
        if not 0.0 < self.repetition_penalty < math.inf:
            return f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
        if not 0.0 <= self.temperature < math.inf:
            return f"temperature must be non-negative, got {self.temperature}."
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p}."
        if self.top_k < -1:
            return f"top_k must be 0 (disable), or at least 1, got {self.top_k}."
        if not 0.0 <= self.min_p <= 1.0:
            return f"min_p must be in [0, 1], got {self.min_p}."
        if self.max_tokens is not None and self.max_tokens < 1:
            return f"max_tokens must be at least 1, got {self.max_tokens}."
        if self.min_tokens < 0:
            return f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            return (f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                    f"got {self.min_tokens}.")
        if self.logprobs is not None and not (_is_int(self.logprobs) and self.logprobs >= -1):
            return f"logprobs must be non-negative or -1, got {self.logprobs}."
        if self.prompt_logprobs is not None and not (_is_int(self.prompt_logprobs)
                                                     and self.prompt_logprobs >= -1):
            return f"prompt_logprobs must be non-negative or -1, got {self.prompt_logprobs}."
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**64):
            return f"seed must be None or an int in 0..2**64 - 1, got {self.seed!r}"
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                return f"{name} must be True or False, got {getattr(self, name)!r}"
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            return f"stop must be a str or a list of str, got {self.stop!r}"
        if any(not s for s in self.stop):
            return "stop cannot contain an empty string."
        if not isinstance(self.stop_token_ids, list) or not all(
                _is_int(t) for t in self.stop_token_ids):
            return f"stop_token_ids must contain only integers, got {self.stop_token_ids}."
        if any(t < 0 for t in self.stop_token_ids):
            return f"stop_token_ids must be token ids (>= 0), got {self.stop_token_ids}."
        if not isinstance(self.bad_words, list) or not all(
                isinstance(w, str) for w in self.bad_words):
            return f"bad_words must be a list of str, got {self.bad_words!r}"
        if any(not w for w in self.bad_words):
            return f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}"
        if problem := self._token_lists_problem():
            return problem
        if self.beam_width is not None:
            return self._beam_problem()
        if self.length_penalty != 1.0 or self.early_stopping is not False:
            return ("length_penalty and early_stopping only apply to beam search: "
                    "set beam_width, or leave them at 1.0 and False")
        if self.n > 1 and self.is_greedy:
            return f"n must be 1 when using greedy sampling, got {self.n}."
        return None

    def verify(self, vocab_size: int, max_logprobs: int = MAX_LOGPROBS, tokenizer=None
               ) -> None:
        """What depends on the model, checked when the engine takes the request (vLLM's
        ``SamplingParams.verify``, in its words); tokenizes ``bad_words`` into
        ``bad_words_token_ids`` (vLLM's ``update_from_tokenizer``)."""
        limit = vocab_size if max_logprobs == -1 else max_logprobs
        for asked, what in ((self.logprobs, "sample"), (self.prompt_logprobs, "prompt")):
            wanted = vocab_size if asked == -1 else asked
            if asked is not None and wanted > limit:
                raise ValueError(f"Requested {what} logprobs of {wanted}, which is greater "
                                 f"than max allowed: {limit}")
        if bad := [t for t in self.logit_bias or {} if not 0 <= t < vocab_size]:
            raise ValueError(f"token_id(s) {bad} in logit_bias contain out-of-vocab token "
                             f"ids. Vocabulary size: {vocab_size}")
        if self.allowed_token_ids is not None and not all(
                0 <= t < vocab_size for t in self.allowed_token_ids):
            raise ValueError("allowed_token_ids contains out-of-vocab token id!")
        if self.bad_words:
            if tokenizer is None:
                raise ValueError("bad_words need a tokenizer to read them: serve it with "
                                 "LLM, or give LLMEngine a tokenizer")
            ids = []
            for word in self.bad_words:  # alone, and after a space if that differs
                alone = tokenizer.encode(word.lstrip(), add_bos=False)
                spaced = tokenizer.encode(" " + word.lstrip(), add_bos=False)
                ids.append(alone)
                if spaced[0] != alone[0] and len(spaced) == len(alone):
                    ids.append(spaced)
            object.__setattr__(self, "bad_words_token_ids", ids)

    def _token_lists_problem(self) -> str | None:
        bias = self.logit_bias
        if bias is not None and not (isinstance(bias, dict) and all(
                _is_int(t) and _is_number(b) and math.isfinite(b) for t, b in bias.items())):
            return f"logit_bias must be a dict of token id -> finite number, got {bias!r}"
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, list) or not all(_is_int(t) for t in allowed):
                return f"allowed_token_ids must be a list of token ids, got {allowed!r}"
            if not allowed:  # vLLM's processor's words
                return "allowed_token_ids is not None and empty!"
        return None

    def _beam_problem(self) -> str | None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            return f"beam_width must be an int >= 1, got {self.beam_width!r}"
        if self.n != 1 or self.top_p != 1 or self.top_k > 0 or self.min_p:
            return ("beam search ranks beams by their log-probabilities: leave n=1, "
                    "top_p=1.0, top_k=0 and min_p=0.0 (temperature is ignored)")
        if self.stop or self.stop_token_ids or self.min_tokens or self.logprobs is not None \
                or self.prompt_logprobs is not None:
            return ("beam search here stops at EOS and max_tokens only: leave stop, "
                    "stop_token_ids, min_tokens and logprobs unset")
        if self.changes_logits or self.max_tokens is None:
            return ("beam search here ranks the model's own log-probabilities: leave the "
                    "penalties, logit_bias, allowed_token_ids and bad_words unset, and give "
                    "max_tokens")
        if not math.isfinite(self.length_penalty):
            return f"length_penalty must be a finite number, got {self.length_penalty!r}"
        if not (self.early_stopping is True or self.early_stopping is False
                or self.early_stopping == "never"):
            return f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"
        return None


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's parameters for :meth:`LLM.beam_search <paged_lib.engine.llm.LLM.beam_search>`:
    ``beam_width`` beams, at most ``max_tokens`` new tokens, ending at EOS unless
    ``ignore_eos``; ``length_penalty`` as in :class:`SamplingParams`. ``temperature`` is
    accepted and ignored: the beams are ranked by the model's log-probabilities."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def sampling_params(self) -> SamplingParams:
        """The engine's beam-group request for these parameters."""
        return SamplingParams(beam_width=self.beam_width, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos, temperature=self.temperature,
                              length_penalty=self.length_penalty)


def _frozen(v):
    if isinstance(v, dict):
        return tuple(sorted(v.items()))
    return tuple(v) if isinstance(v, list) else v


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
