"""vLLM's ``prompt_logprobs``: each prompt token's log-probability given the tokens before it.

``SamplingParams(prompt_logprobs=k)`` asks, as in vLLM, for one entry per prompt token:
``None`` for the first (nothing comes before it), then ``{token id: Logprob}`` with the
token itself and the ``k`` most likely tokens at that position (``-1``: the whole
vocabulary), the same shape as the generated tokens' ``logprobs``
(:func:`~paged_lib.engine.sampler.top_logprobs`).

The engine's steps keep only each sequence's last logits, so the prompt is run once more,
on its own, in a scratch pool of its own blocks (its K/V never reaches the engine's pool
or the prefix cache). vLLM likewise computes a request's prompt logprobs from a full
prefill: such a request does not read its prompt from the prefix cache.
"""

from __future__ import annotations

import torch

from paged_lib.engine.model_runner import allocate_kv_caches, build_metadata, check_metadata
from paged_lib.engine.sampler import top_logprobs
from paged_lib.engine.sequence import Logprob
from paged_lib.util import cdiv


def prompt_logprobs(model, prompt: list[int], k: int, block_size: int, backend: str
                    ) -> list[dict[int, Logprob] | None]:
    """``[None, {token: Logprob, ...}, ...]``: one entry per token of ``prompt``."""
    blocks = cdiv(len(prompt), block_size)
    caches = allocate_kv_caches(model, blocks, block_size, model.device)
    meta = build_metadata([list(range(blocks))], [len(prompt)], [len(prompt)], block_size)
    check_metadata(meta, blocks, block_size)
    with torch.no_grad():
        hidden = model(torch.tensor(prompt, device=model.device), caches, meta,
                       backend=backend, validate=False)
        logprobs = torch.log_softmax(model.compute_logits(hidden).float().cpu(), dim=-1)
    return [None] + [top_logprobs(logprobs[i], t, k) for i, t in enumerate(prompt[1:])]
