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
   at ``max_tokens`` - and the text ends before it (:class:`StopStrings`: one
   :class:`~paged_lib.engine.detokenize.IncrementalDetokenizer` per sequence, the one
   the server streams with).

A beam group only stops at ``max_tokens`` here; its EOS candidates become finished
hypotheses in :mod:`~paged_lib.engine.beam_search`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from paged_lib.engine.detokenize import IncrementalDetokenizer
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
    """The text front's stop strings, checked after each step with vLLM v1's detokenizer.

    Called with a sequence that just drew a token: the sequence's own
    :class:`~paged_lib.engine.detokenize.IncrementalDetokenizer` (kept in
    ``seq.detokenizer``, made at its first check) takes the tokens it has not seen, so
    each token is decoded once; ``seq.output_text`` is the text decided so far. A stop
    string found (the first to complete, ties the first listed, as vLLM; one may span
    tokens) cuts the text before it
    and is returned. Text made within ``min_tokens`` is not searched (vLLM's rule); an
    incomplete UTF-8 character at the end (a byte-level tokenizer splits characters)
    counts once it is complete. The server streams with the same class
    (:func:`paged_lib.serve.outputs.text_pieces`), so both see the same text.

    A forked sample starts from a :meth:`~IncrementalDetokenizer.fork` of its parent's
    (:func:`~paged_lib.engine.sequence.fork_samples`); a sequence without one (a beam
    made by beam search, whose requests have no stop strings) gets one fed all its tokens.
    """

    def __init__(self, decode: Callable[[Iterable[int]], str]):
        self.decode = decode

    def __call__(self, seq: Sequence, params: SamplingParams) -> str | None:
        det = seq.detokenizer
        if det is None:
            det = seq.detokenizer = IncrementalDetokenizer(self.decode, params.stop,
                                                           params.min_tokens)
        det.add(seq.output_token_ids[det.num_tokens:])
        seq.output_text = det.text
        return det.stopped
