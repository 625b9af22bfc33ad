"""The sampler: from each sequence's logits to its next token(s) and their log-probabilities.

Greedy (``temperature == 0``) takes the argmax. Otherwise the token is drawn from
``softmax(logits / temperature)`` with the *request's own* ``torch.Generator`` (seeded
from ``SamplingParams.seed``), so a request's samples do not depend on which other
requests share its batch, or on preemptions. The log-probability reported is always the
model's own (``log_softmax(logits)``, temperature 1), as the public API promises.
"""

from __future__ import annotations

import torch

from paged_lib.engine.scheduler import SchedulerOutput


def num_samples(sched) -> int:
    """How many tokens to draw for a scheduled sequence: ``n`` for the first step of an
    ``n > 1`` request (its samples fork from the prompt), else 1."""
    group, seq = sched.group, sched.seq
    first = sched.is_prefill and not seq.output_token_ids and len(group.seqs) == 1
    return group.params.n if first and group.params.beam_width is None else 1


def sample(logits: torch.Tensor, out: SchedulerOutput) -> list[list[tuple[int, float]]]:
    """``(token, logprob)`` pairs for every scheduled sequence, in ``out.scheduled`` order."""
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
        if params.temperature == 0:
            tokens = [int(torch.argmax(logits[row]))] * k
        else:
            probs = torch.softmax(logits[row].float() / params.temperature, dim=-1)
            tokens = torch.multinomial(probs, k, replacement=True,
                                       generator=sched.group.generator).tolist()
        result.append([(t, float(logprobs[row, t])) for t in tokens])
    return result
