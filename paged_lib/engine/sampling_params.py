"""What a caller asks for: vLLM's :class:`SamplingParams` and :class:`BeamSearchParams`.

The keywords and defaults are vLLM's, so a learner's first vLLM program runs here as it
is: ``SamplingParams(temperature=0.8, top_p=0.95)`` samples 16 tokens (vLLM's default
``max_tokens``), and greedy decoding is asked for by name, ``temperature=0.0``. The course
adds beam search on the engine's own beam groups (the paper's §4.4): ``beam_width``,
``length_penalty``, ``early_stopping``, as vLLM v0 had them.

Values are not checked when the object is built, as in vLLM: :meth:`SamplingParams.problem`
says what is wrong, and the engine raises ``ValueError`` naming the request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: vLLM's ``_SAMPLING_EPS``: a temperature below it is greedy decoding
SAMPLING_EPS = 1e-5
#: the most top log-probabilities a request may ask for (vLLM's default ``max_logprobs``)
MAX_LOGPROBS = 20


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to generate for one request (keywords only, vLLM's names and defaults).

    * ``n`` samples share the prompt's blocks (parallel sampling, copy-on-write);
    * ``temperature`` (1.0) divides the logits; ``0`` (below 1e-5) is greedy; ``top_k``
      (0 or -1: off) and ``top_p`` (1.0: off) then keep only the ``k`` most likely tokens
      and the smallest set whose probability reaches ``p``
      (:func:`~paged_lib.engine.sampler.apply_top_k_top_p`);
    * ``seed`` fixes the request's own generator, so its samples do not depend on what
      else is in the batch;
    * ``max_tokens`` (16) new tokens at most (finish reason ``"length"``); before
      ``min_tokens`` of them, EOS and ``stop_token_ids`` cannot be drawn (their logits
      are masked, as vLLM does);
    * the request stops (finish reason ``"stop"``) at EOS unless ``ignore_eos``, at any of
      ``stop_token_ids`` (kept in the output, named in ``stop_reason``), or, when a
      tokenizer serves it (:class:`~paged_lib.engine.llm.LLM`), at any of the ``stop``
      strings (a str or a list): its text ends before the stop string;
    * ``logprobs=k`` returns, for each generated token, the ``k`` most likely tokens'
      log-probabilities and the chosen token's (``CompletionOutput.logprobs``).

    Beam search (the engine's beam groups, as vLLM v0 and transformers): ``beam_width``
    beams ranked by the model's log-probabilities (``temperature`` is ignored; ``n``,
    ``top_p``, ``top_k``, stop conditions and logprobs are refused). A finished hypothesis
    scores ``cumulative_logprob / len(token_ids) ** length_penalty``; ``early_stopping``
    says when the search ends: ``True`` as soon as ``beam_width`` hypotheses are
    finished, ``False`` when no running beam can still beat the worst of them at its
    current length, ``"never"`` the same at ``max_tokens`` when ``length_penalty > 0``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self):
        # as vLLM: stop becomes a list of strings, stop_token_ids a list (both empty when
        # None); anything else is left for problem() to name
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, list | tuple):
            stop = list(stop)
        ids = self.stop_token_ids
        if ids is None:
            ids = []
        elif isinstance(ids, list | tuple):
            ids = list(ids)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", ids)

    def __hash__(self) -> int:  # (stop lists are not hashable; a request's params may be)
        return hash(tuple(tuple(v) if isinstance(v, list) else v
                          for v in self.__dict__.values()))

    @property
    def is_greedy(self) -> bool:
        return _is_number(self.temperature) and self.temperature < SAMPLING_EPS

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs at once (blocks are reserved for all of them)."""
        return self.beam_width if self.beam_width is not None else self.n

    def problem(self) -> str | None:
        """What is wrong with these parameters, or ``None`` (used for error messages)."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            return f"max_tokens must be an int >= 1, got {self.max_tokens!r}"
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            return (f"min_tokens must be an int in 0..max_tokens ({self.max_tokens}), "
                    f"got {self.min_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            return f"temperature must be a number >= 0, got {self.temperature!r}"
        if not _is_int(self.n) or self.n < 1:
            return f"n must be an int >= 1, got {self.n!r}"
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**64):
            return f"seed must be None or an int in 0..2**64 - 1, got {self.seed!r}"
        if not isinstance(self.ignore_eos, bool):
            return f"ignore_eos must be True or False, got {self.ignore_eos!r}"
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            return f"top_p must be a number in (0, 1], got {self.top_p!r}"
        if not _is_int(self.top_k) or self.top_k < -1:
            return f"top_k must be an int >= 1, or 0 or -1 for all tokens, got {self.top_k!r}"
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s
                                                      for s in self.stop):
            return f"stop must be a non-empty str or a list of them, got {self.stop!r}"
        if not isinstance(self.stop_token_ids, list) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            return f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
        if self.logprobs is not None and not (_is_int(self.logprobs)
                                              and 0 <= self.logprobs <= MAX_LOGPROBS):
            return (f"logprobs must be None or an int in 0..{MAX_LOGPROBS} (top "
                    f"log-probabilities per token), got {self.logprobs!r}")
        if self.beam_width is not None:
            return self._beam_problem()
        if self.length_penalty != 1.0 or self.early_stopping is not False:
            return ("length_penalty and early_stopping only apply to beam search: "
                    "set beam_width, or leave them at 1.0 and False")
        if self.n > 1 and self.is_greedy:
            return f"n={self.n} greedy samples would all be equal: set temperature > 0"
        return None

    def _beam_problem(self) -> str | None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            return f"beam_width must be an int >= 1, got {self.beam_width!r}"
        if self.n != 1 or self.top_p != 1 or self.top_k > 0:
            return ("beam search ranks beams by their log-probabilities: leave n=1, "
                    "top_p=1.0 and top_k=0 (temperature is ignored)")
        if self.stop or self.stop_token_ids or self.min_tokens or self.logprobs is not None:
            return ("beam search here stops at EOS and max_tokens only: leave stop, "
                    "stop_token_ids, min_tokens and logprobs unset")
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
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


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
