"""When a sequence is done, and why: vLLM v1's ``check_stop`` and its detokenizer's stop strings.

After each step, every sequence that drew a token is checked, in vLLM v1's order:

1. ``max_tokens`` reached: finished, ``"length"`` (vLLM also stops at ``max_model_len``;
   here a request whose prompt plus ``max_tokens`` would pass it is refused up front, with
   vLLM's message, so ``max_tokens`` always comes first);
2. before ``min_tokens`` nothing else can stop it (the sampler also masks EOS and the stop
   token ids until then: :func:`min_tokens_mask`);
3. the end-of-sequence token (unless ``ignore_eos``): ``"stop"``;
4. one of ``stop_token_ids``: ``"stop"``, the id in ``stop_reason`` (the token is kept);
5. with a tokenizer (the text front, :class:`~paged_lib.engine.llm.LLM`), one of the
   ``stop`` strings in the text so far: ``"stop"``, the string in ``stop_reason`` - even
   at ``max_tokens`` - and the text ends before it (:class:`StopStrings`).

A beam group only stops at ``max_tokens`` here; its EOS candidates become finished
hypotheses in :mod:`~paged_lib.engine.beam_search`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from paged_lib.engine.sampling_params import SamplingParams
from paged_lib.engine.sequence import Sequence, SequenceGroup


def check_stop(seq: Sequence, group: SequenceGroup, eos_token_id: int | None,
               stop_strings: Callable[[Sequence, SamplingParams], str | None] | None = None
               ) -> bool:
    """Is ``seq`` done after the token it just drew? Sets ``seq.finish_reason`` and
    ``seq.stop_reason`` when it is (the caller finishes it and frees its blocks)."""
    params, n = group.params, len(seq.output_token_ids)
    reason, stop_reason = None, None
    if n >= params.max_tokens:
        reason = "length"
    elif params.beam_width is None and n >= params.min_tokens:
        last = seq.output_token_ids[-1]
        if not params.ignore_eos and eos_token_id is not None and last == eos_token_id:
            reason = "stop"
        elif last in params.stop_token_ids:
            reason, stop_reason = "stop", last
    if stop_strings is not None and reason != "stop" and params.stop:
        if (hit := stop_strings(seq, params)) is not None:
            reason, stop_reason = "stop", hit
    if reason is None:
        return False
    seq.finish_reason, seq.stop_reason = reason, stop_reason
    return True


def min_tokens_mask(logits: torch.Tensor, params: SamplingParams, num_generated: int,
                    eos_token_id: int | None) -> torch.Tensor:
    """``logits`` with EOS (unless ``ignore_eos``) and the stop token ids at ``-inf``
    while fewer than ``min_tokens`` tokens are generated (vLLM's min-tokens logits
    processor), so neither greedy nor sampling can end the sequence early."""
    if num_generated >= params.min_tokens:
        return logits
    banned = list(params.stop_token_ids)
    if not params.ignore_eos and eos_token_id is not None:
        banned.append(eos_token_id)
    banned = [t for t in banned if t < logits.shape[-1]]
    if not banned:
        return logits
    logits = logits.clone()
    logits[..., banned] = float("-inf")
    return logits


class StopStrings:
    """The text front's stop strings, checked after each step as vLLM's detokenizer does.

    Called with a sequence that just drew a token: decodes its output, searches only the
    new text (and the ``len(stop) - 1`` characters before it, so a stop string that spans
    two tokens is found), takes the first of ``params.stop`` found, cuts
    ``seq.output_text`` before it and returns it. Text made within ``min_tokens`` is not
    searched (vLLM's rule). An incomplete UTF-8 character at the end (a byte-level
    tokenizer splits characters) counts once it is complete.
    """

    def __init__(self, decode: Callable[[Iterable[int]], str]):
        self.decode = decode

    def __call__(self, seq: Sequence, params: SamplingParams) -> str | None:
        seen = seq.output_text or ""
        text = self.decode(seq.output_token_ids).rstrip("\ufffd")
        seq.output_text = text
        new = len(text) - len(seen)
        if len(seq.output_token_ids) <= params.min_tokens or new <= 0:
            return None
        for stop in params.stop:
            at = text.find(stop, max(0, len(text) - new - len(stop) + 1))
            if at != -1:
                seq.output_text = text[:at]
                return stop
        return None
