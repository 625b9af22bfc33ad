"""A request's checks before it is queued: malformed input, and requests that can never run.

Two kinds of bad request, two answers (:meth:`LLMEngine.generate`). *Malformed* input
(wrong types or values) raises ``ValueError`` naming the request before anything runs.
A *well-formed* request that can never run - longer than the model's context (vLLM's
message), more sequences than a step may run, more blocks than the whole pool - fails
alone: :func:`never_fits` says why, and the others run.
"""

from __future__ import annotations

import operator

from paged_lib.engine.block_manager import shared_prompt_blocks
from paged_lib.engine.sequence import SamplingParams
from paged_lib.util import cdiv


def worst_case_blocks(prompt_len: int, max_tokens: int, num_seqs: int, block_size: int) -> int:
    """GPU blocks a request may need at its longest, alone in the pool.

    Its last token's K/V is never written (nothing is generated after it), so a sequence
    peaks at ``prompt_len + max_tokens - 1`` cached tokens. Several sequences (``n > 1``,
    beams) share the prompt's blocks, counted once, and each adds its own blocks past
    them, plus its copy of a part-filled last prompt block (copy-on-write): that is also
    what a group preempted by recompute takes back (its prompt once, then the tails).
    Example (block size 4): 64 prompt + 32 new tokens x 4 samples -> 16 + 4 x 8 = 48.
    """
    return shared_prompt_blocks(prompt_len, [max_tokens - 1] * num_seqs, block_size)


def token_id(t) -> int | None:
    """``t`` as a Python int if it is an integer (numpy, 0-d torch too), else ``None``."""
    if isinstance(t, bool):
        return None
    try:
        return operator.index(t)
    except TypeError:
        return None


def check_request(i: int, prompt, params: SamplingParams, vocab_size: int,
                  window=None, has_tokenizer: bool = False) -> list[int]:
    """Malformed input raises ``ValueError`` naming the request; returns the prompt as
    a list of Python ints (numpy and 0-d torch integers welcome, bools are not). Stop
    strings need the engine to have a tokenizer (``has_tokenizer``) to read the text."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"request {i}: params must be SamplingParams, "
                         f"got {type(params).__name__}")
    if problem := params.problem():
        raise ValueError(f"request {i}: {problem}")
    if params.stop and not has_tokenizer:
        raise ValueError(f"request {i}: stop strings need a tokenizer to read the text: "
                         "serve it with LLM, or give LLMEngine a tokenizer")
    if bad := [t for t in params.stop_token_ids if t >= vocab_size]:
        raise ValueError(f"request {i}: stop_token_ids {bad} are not ids of this model's "
                         f"vocabulary (0..{vocab_size - 1})")
    if isinstance(prompt, str | bytes) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"request {i}: a prompt is a list of token ids, got "
                         f"{type(prompt).__name__} (tokenize it first)")
    prompt = list(prompt)
    if len(prompt) == 0:
        raise ValueError(f"request {i}: the prompt is empty (give at least one token, "
                         "e.g. BOS)")
    ids = []
    for j, t in enumerate(prompt):
        tok = token_id(t)
        if tok is None or not 0 <= tok < vocab_size:
            raise ValueError(f"request {i}: token {t!r} at position {j} is not an id of "
                             f"this model's vocabulary (0..{vocab_size - 1})")
        ids.append(tok)
    if window is not None:
        window.check_request(i, ids, params)
    return ids


def never_fits(prompt: list[int], params: SamplingParams, *, max_model_len: int,
               max_num_seqs: int, num_blocks: int, watermark_blocks: int, block_size: int,
               window=None) -> str | None:
    """Why a well-formed request can never run here, or ``None``."""
    asked = len(prompt) + params.max_tokens
    if window is None and asked > max_model_len:  # vLLM's words
        return (f"This model's maximum context length is {max_model_len} tokens. "
                f"However, you requested {asked} tokens ({len(prompt)} in the prompt, "
                f"{params.max_tokens} in the completion). Please reduce the length of "
                "the prompt or completion.")
    if params.num_seqs > max_num_seqs:
        return (f"runs {params.num_seqs} sequences at once (n or beam_width) but "
                f"max_num_seqs is {max_num_seqs}: it can never run")
    need = worst_case_blocks(len(prompt), params.max_tokens, params.num_seqs,
                             block_size)
    if window is not None:  # a windowed stream's blocks stop growing
        need = window.blocks_at_most(len(prompt), params.max_tokens)
    prompt_need = cdiv(len(prompt), block_size)
    if need > num_blocks or prompt_need > num_blocks - watermark_blocks:
        shared = (f" x {params.num_seqs} sequences sharing the prompt's "
                  f"{len(prompt) // block_size} full blocks"
                  if params.num_seqs > 1 else "")
        return (f"needs up to {need} blocks of {block_size} tokens "
                f"({len(prompt)} prompt + {params.max_tokens} new tokens{shared}) but "
                f"the whole pool has {num_blocks} blocks "
                f"({watermark_blocks} kept free at admission): it can never run")
    return None


def check_max_model_len(asked: int | None, max_position: int) -> int:
    """``max_model_len`` checked: at most the model's ``max_position`` (default)."""
    if asked is None:
        return max_position
    if isinstance(asked, bool) or not isinstance(asked, int) or not 1 <= asked <= max_position:
        raise ValueError(f"max_model_len must be an int in 1..{max_position} (the model's "
                         f"max_position), got {asked!r}")
    return asked
