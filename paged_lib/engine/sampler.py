"""The sampler: from each sequence's logits to its next token(s) and their log-probabilities.

Greedy (``temperature`` 0, below 1e-5 as in vLLM) takes the argmax. Otherwise the token is
drawn from ``softmax(logits / temperature)`` (after ``top_k`` / ``top_p``) with the
*request's own* ``torch.Generator`` (seeded from ``SamplingParams.seed``), so a request's
samples do not depend on which other requests share its batch, or on preemptions. Before
``min_tokens`` tokens, EOS and the stop token ids are masked out first
(:func:`~paged_lib.engine.stop.min_tokens_mask`). The log-probability reported is always
the model's own (``log_softmax(logits)``, temperature 1, before any mask or filter: vLLM's
raw logprobs), as the public API promises; with ``logprobs=k`` each draw also carries its
``{token id: Logprob}``: the ``k`` most likely tokens and the chosen one, with their ranks.
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
        scores = min_tokens_mask(logits[row], params, len(sched.seq.output_token_ids),
                                 eos_token_id)
        if params.is_greedy:
            tokens = [int(torch.argmax(scores))] * k
        else:
            scaled = scores / params.temperature
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
    (ranks 1..k; a chosen token among them keeps its first place in the dict)."""
    chosen = float(logprobs[token])
    entries = [(token, chosen, int((logprobs >= chosen).sum()))]
    top = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    entries += [(t, v, rank) for rank, (t, v) in enumerate(
        zip(top.indices.tolist(), top.values.tolist(), strict=True), start=1)]
    return {t: Logprob(v, rank) for t, v, rank in entries}
