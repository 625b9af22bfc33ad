"""The sampler: from each sequence's logits to its next token(s) and their log-probabilities.

Each row's logits are first changed in vLLM v1's order (its ``Sampler``): only the
``allowed_token_ids`` kept, the ``bad_words`` banned, before ``min_tokens`` tokens EOS and
the stop token ids masked (:func:`~paged_lib.engine.stop.min_tokens_mask`), the
``logit_bias`` added, then the penalties (:func:`apply_penalties`). Greedy
(``temperature`` 0, below 1e-5 as in vLLM) takes the argmax of the result. Otherwise the
token is drawn from ``softmax(logits / temperature)`` after ``min_p`` (:func:`apply_min_p`)
and ``top_k`` / ``top_p`` with the *request's own* ``torch.Generator`` (seeded from
``SamplingParams.seed``), so a request's samples do not depend on which other requests
share its batch, or on preemptions. The log-probability reported is always
the model's own (``log_softmax(logits)``, temperature 1, before any mask or filter: vLLM's
raw logprobs), as the public API promises; with ``logprobs=k`` each draw also carries its
``{token id: Logprob}``: the ``k`` most likely tokens and the chosen one, with their ranks
(``logprobs=-1``: every token of the vocabulary).
"""

from __future__ import annotations

import torch

from paged_lib.engine.scheduler import SchedulerOutput
from paged_lib.engine.sequence import Logprob
from paged_lib.engine.stop import min_tokens_mask


def num_samples(sched) -> int:
    """How many tokens to draw for a scheduled sequence: ``n`` for the first step of an
    ``n > 1`` request (its samples fork from the prompt), else 1."""
    group, seq = sched.group, sched.seq
    first = sched.is_prefill and not seq.output_token_ids and len(group.seqs) == 1
    return group.params.n if first and group.params.beam_width is None else 1


def apply_top_k_top_p(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0
                      ) -> torch.Tensor:
    """``logits [..., vocab]`` with the filtered-out tokens set to ``-inf`` (a new tensor).

    ``top_k > 0`` keeps the tokens whose logit is at least the ``k``-th largest (ties at
    the ``k``-th value all stay); ``top_p < 1`` then keeps the most likely tokens whose
    probabilities, added from the most likely down, first reach ``p`` (the most likely
    token always stays). ``top_k`` of 0 or -1 and ``top_p`` of 1 leave ``logits`` as they
    are. The same rule as vLLM's ``apply_top_k_top_p`` and transformers'
    ``TopKLogitsWarper`` / ``TopPLogitsWarper``.
    """
    logits = logits.clone()
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits.masked_fill_(logits < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(logits, dim=-1)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[..., -1] = False  # the most likely token stays
        logits.masked_fill_(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def apply_penalties(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                    presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0
                    ) -> torch.Tensor:
    """One row of ``logits [vocab]`` with vLLM's penalties (a new tensor): every token of
    the prompt or the output has its logit divided by ``repetition`` when positive,
    multiplied when negative (transformers' ``RepetitionPenaltyLogitsProcessor``); then
    each output token loses ``frequency`` per occurrence and ``presence`` once (OpenAI's
    definition; the prompt does not count for these two)."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    if repetition != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[[t for t in prompt_ids + output_ids if t < vocab]] = True
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
    if (frequency or presence) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids), minlength=vocab)[:vocab].float()
        logits -= frequency * counts + presence * (counts > 0).float()
    return logits


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """``logits`` (already divided by the temperature) with every token whose probability
    is below ``min_p`` times the most likely token's at ``-inf`` (vLLM's ``min_p``,
    transformers' ``MinPLogitsWarper``: the most likely token always stays)."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values,
                              float("-inf"))


def banned_bad_words(bad_words_ids: list[list[int]], output_ids: list[int]) -> list[int]:
    """The tokens ``bad_words`` forbid next (vLLM v1's rule, transformers'
    ``NoBadWordsLogitsProcessor`` over the output): a one-token word always; a longer one's
    last token when the output ends with the word's other tokens."""
    banned = []
    for word in bad_words_ids:
        prefix = word[:-1]
        if not prefix or output_ids[len(output_ids) - len(prefix):] == prefix:
            banned.append(word[-1])
    return banned


def logits_options(logits: torch.Tensor, params, prompt_ids: list[int],
                   output_ids: list[int]) -> torch.Tensor:
    """One row's logits after the options that come before temperature, in vLLM's order:
    ``allowed_token_ids``, ``bad_words`` (their token ids: ``params.bad_words_token_ids``,
    set by the engine), ``logit_bias``, penalties (``logits`` itself when none is set; the
    ``min_tokens`` mask comes first, in :func:`sample`)."""
    if not params.changes_logits:
        return logits
    logits = logits.clone()
    if params.allowed_token_ids is not None:
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
        keep[params.allowed_token_ids] = True
        logits.masked_fill_(~keep, float("-inf"))
    bad = getattr(params, "bad_words_token_ids", None)
    if bad:
        logits[banned_bad_words(bad, output_ids)] = float("-inf")
    for token, bias in (params.logit_bias or {}).items():
        logits[token] += bias
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1:
        logits = apply_penalties(logits, prompt_ids, output_ids, params.presence_penalty,
                                 params.frequency_penalty, params.repetition_penalty)
    return logits


def sample(logits: torch.Tensor, out: SchedulerOutput, eos_token_id: int | None = None
           ) -> list[list[tuple]]:
    """``(token, logprob)`` pairs for every scheduled sequence, in ``out.scheduled`` order
    (``(token, logprob, top)`` when the request asks for ``logprobs``: :func:`top_logprobs`).
    ``eos_token_id`` is masked out before ``min_tokens``."""
    logits = logits.float().cpu()  # small; the requests' generators live on the CPU
    logprobs = torch.log_softmax(logits, dim=-1)
    result = []
    for row, sched in enumerate(out.scheduled):
        params, k = sched.group.params, num_samples(sched)
        if not sched.sample:  # a shared recompute's prompt step: nothing to draw yet
            result.append([])
            continue
        if params.beam_width is not None:  # best first; one more than the width, so
            # that width of them go on even if one is the EOS token
            top = torch.topk(logprobs[row], min(params.beam_width + 1, logprobs.shape[1]))
            result.append(list(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
            continue
        output_ids = sched.seq.output_token_ids
        scores = min_tokens_mask(logits[row], params, len(output_ids), eos_token_id)
        scores = logits_options(scores, params, sched.group.prompt_token_ids, output_ids)
        if params.is_greedy:
            tokens = [int(torch.argmax(scores))] * k
        else:
            scaled = apply_min_p(scores / params.temperature, params.min_p)
            if params.top_k > 0 or params.top_p < 1.0:
                scaled = apply_top_k_top_p(scaled, params.top_k, params.top_p)
            probs = torch.softmax(scaled, dim=-1)
            tokens = torch.multinomial(probs, k, replacement=True,
                                       generator=sched.group.generator).tolist()
        if params.logprobs is None:
            result.append([(t, float(logprobs[row, t])) for t in tokens])
        else:
            result.append([(t, float(logprobs[row, t]), top_logprobs(logprobs[row], t,
                                                                     params.logprobs))
                           for t in tokens])
    return result


def top_logprobs(logprobs: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
    """``{token id: Logprob}`` for one draw, as vLLM builds it: the chosen ``token`` first
    (its rank: how many tokens are at least as likely), then the ``k`` most likely tokens
    (ranks 1..k; a chosen token among them keeps its first place in the dict); ``k=-1``:
    the whole vocabulary."""
    if k == -1:
        k = logprobs.shape[-1]
    chosen = float(logprobs[token])
    entries = [(token, chosen, int((logprobs >= chosen).sum()))]
    top = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    entries += [(t, v, rank) for rank, (t, v) in enumerate(
        zip(top.indices.tolist(), top.values.tolist(), strict=True), start=1)]
    return {t: Logprob(v, rank) for t, v, rank in entries}
