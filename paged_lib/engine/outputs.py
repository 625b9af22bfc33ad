"""A finished request as vLLM reports it: :func:`request_output`, and beam search's outputs.

:func:`request_output` turns a :class:`~paged_lib.engine.sequence.SequenceGroup` into a
:class:`~paged_lib.engine.sequence.RequestOutput`: one
:class:`~paged_lib.engine.sequence.CompletionOutput` per sample (in order) or per finished
beam hypothesis (best score first), with the finish reasons
(:mod:`~paged_lib.engine.stop`) and, given a ``decode`` function (the engine's tokenizer),
the texts. :class:`BeamSearchOutput` and :class:`BeamSearchSequence` are what vLLM's
``LLM.beam_search`` returns (:meth:`~paged_lib.engine.llm.LLM.beam_search`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from paged_lib.engine.sequence import CompletionOutput, Logprob, RequestOutput, SequenceGroup

Decode = Callable[[Iterable[int]], str]


def request_output(group: SequenceGroup, decode: Decode | None = None) -> RequestOutput:
    """The answer to ``group``'s request; texts (and each logprob's ``decoded_token``)
    only when ``decode`` is given. A beam hypothesis shorter than ``max_tokens`` ended at
    EOS (``"stop"``); one that reached it is ``"length"``, as vLLM v1 checks length first.

    As vLLM v1's detokenizer: a sequence ended by EOS or one of ``stop_token_ids`` keeps
    the token in ``token_ids`` but not its text in ``text``, and one ended by a stop
    string has ``text`` cut before it; ``include_stop_str_in_output=True`` keeps both."""
    if group.error is not None:
        return RequestOutput(group.request_id, None, group.prompt_token_ids, [],
                             error=group.error)
    params, outs = group.params, []
    if params.beam_width is not None:  # finished hypotheses, best score first
        for i, (tokens, cum) in enumerate(group.beam_done):
            reason = "length" if len(tokens) >= params.max_tokens else "stop"
            outs.append(CompletionOutput(i, _text(tokens, decode), list(tokens), cum,
                                         finish_reason=reason))
    else:
        for i, seq in enumerate(group.seqs):
            text = _sequence_text(seq, params, decode)
            logprobs = None
            if params.logprobs is not None:
                logprobs = [_decoded(top, decode) for top in seq.output_logprobs]
            outs.append(CompletionOutput(i, text, list(seq.output_token_ids),
                                         seq.cumulative_logprob, logprobs,
                                         seq.finish_reason, seq.stop_reason))
    return RequestOutput(group.request_id, None, group.prompt_token_ids, outs,
                         finished=group.is_finished())


def _sequence_text(seq, params, decode: Decode | None) -> str | None:
    keep = params.include_stop_str_in_output
    if isinstance(seq.stop_reason, str):  # a stop string: the text ends before it
        return seq.output_text + (seq.stop_reason if keep else "")
    tokens = seq.output_token_ids
    if seq.finish_reason == "stop" and not keep and tokens:  # EOS or a stop token id
        tokens = tokens[:-1]
    return _text(tokens, decode)


def _text(tokens: list[int], decode: Decode | None) -> str | None:
    return None if decode is None else decode(tokens)


def _decoded(top: dict[int, Logprob], decode: Decode | None) -> dict[int, Logprob]:
    if decode is None:
        return dict(top)
    return {t: dataclasses.replace(lp, decoded_token=decode([t])) for t, lp in top.items()}


@dataclass
class BeamSearchSequence:
    """One finished beam, as vLLM's ``BeamSearchSequence``: ``tokens`` are the prompt's
    and the generated ones, ``text`` all of them decoded (as vLLM does), ``cum_logprob``
    the generated tokens' log-probabilities summed."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """vLLM's ``BeamSearchOutput``: one prompt's best beams, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)
