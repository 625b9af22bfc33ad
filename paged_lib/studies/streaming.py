"""Measuring a sliding window with attention sinks (chapter 11; StreamingLLM, arXiv:2309.17453).

Two measurements of :mod:`paged_lib.engine.window` on the shipped model:

* :func:`stream_bits_per_byte` - how well the model predicts a long held-out stream
  (:func:`held_out_stream`: Python files the model never trained on) when its cache is a
  window with 0, 1, 4, ... sinks, or the whole stream (at positions past the 257 of its
  training windows, and past its config's 512). The stream goes through the same blocks,
  drops and K/V edits as in the engine (the engine generates; this scores given text, so
  it drives the model itself), in chunks that end where a block leaves: what feeding it
  token by token computes.
* :func:`memory_curve` - blocks the engine holds at every step of a growing stream, with
  and without the window.
"""

from __future__ import annotations

import math

import torch

from paged_lib.blocks import BlockAllocator, BlockTable
from paged_lib.data.held_out import held_out_files
from paged_lib.engine.llm_engine import LLMEngine
from paged_lib.engine.model_runner import allocate_kv_caches, build_metadata, check_metadata
from paged_lib.engine.sequence import SamplingParams, Sequence
from paged_lib.engine.window import SlidingWindow, num_dropped
from paged_lib.model import TinyLlama
from paged_lib.tokenizer import BOS_ID, EOS_ID
from paged_lib.util import cdiv


def held_out_stream(num_tokens: int) -> list[int]:
    """BOS, then the standard library's held-out ``.py`` files (the training split of
    :mod:`paged_lib.data.held_out`, in its order), each file's bytes followed by EOS, cut
    at ``num_tokens`` ids."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 2:
        raise ValueError(f"num_tokens must be an int >= 2, got {num_tokens!r}")
    ids = [BOS_ID]
    for data in held_out_files():
        ids += list(data) + [EOS_ID]
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise ValueError(f"the held-out files hold only {len(ids)} tokens, asked {num_tokens}")


@torch.no_grad()
def stream_logprobs(model: TinyLlama, token_ids: list[int],
                    windows: list[tuple[int | None, int]], block_size: int = 16,
                    backend: str = "torch", max_chunk: int = 256) -> torch.Tensor:
    """``[len(windows), len(token_ids) - 1]`` log-probabilities (nats) of each next token.

    ``windows[i] = (sliding_window, num_sink_tokens)``, or ``(None, 0)`` for the whole
    stream in the cache. Token ``t`` is fed at its position in its configuration's cache
    and predicts token ``t + 1``. The tokens go in as prefill chunks (at most
    ``max_chunk`` each) that end where a block leaves the window: between two drops the
    cache only grows, so a chunk computes what feeding its tokens one by one would.
    """
    if len(token_ids) < 2:
        raise ValueError(f"need at least 2 tokens to score one, got {len(token_ids)}")
    if not windows:
        raise ValueError("windows is empty: give at least one (sliding_window, sinks)")
    if isinstance(max_chunk, bool) or not isinstance(max_chunk, int) or max_chunk < 1:
        raise ValueError(f"max_chunk must be an int >= 1, got {max_chunk!r}")
    for w, s in windows:
        if w is None and s != 0:
            raise ValueError(f"num_sink_tokens={s} needs a sliding_window")
    cfg = model.config
    slides = [None if w is None else SlidingWindow(w, s, block_size, cfg.max_position,
                                                   cfg.rope_theta) for w, s in windows]
    return torch.stack([_score(model, token_ids, sl, block_size, backend, max_chunk)
                        for sl in slides])


def _score(model: TinyLlama, token_ids: list[int], slide: SlidingWindow | None,
           block_size: int, backend: str, max_chunk: int) -> torch.Tensor:
    n = len(token_ids)
    cap = cdiv(n, block_size) if slide is None else slide.max_blocks
    allocator = BlockAllocator(cap)
    caches = allocate_kv_caches(model, cap, block_size, model.device)
    seq = Sequence(0, [])
    seq.block_table = BlockTable(allocator, block_size)
    gone = (lambda fed: 0) if slide is None else (lambda fed: num_dropped(
        fed, slide.window, slide.num_sink_tokens, block_size))
    out = torch.empty(n - 1)
    t = 0
    while t < n - 1:  # feed tokens t .. end-1, which predict t+1 .. end
        end = t + 1
        while end < min(n - 1, t + max_chunk) and gone(end + 1) == gone(t + 1):
            end += 1
        if slide is not None:
            slide.slide(seq)  # the blocks that leave before token t goes in
        for _ in range(end - t):
            seq.block_table.append_token()
        if slide is not None:
            slide.apply(caches)
        meta = build_metadata([seq.block_table.blocks], [seq.block_table.num_tokens],
                              [end - t], block_size)
        check_metadata(meta, cap, block_size)
        ids = torch.tensor(token_ids[t:end], dtype=torch.int64, device=model.device)
        hidden = model(ids, caches, meta, backend=backend, validate=False)
        logp = torch.log_softmax(model.compute_logits(hidden), -1).cpu()
        out[t:end] = logp[torch.arange(end - t), torch.tensor(token_ids[t + 1:end + 1])]
        seq.num_cached = t = end
    return out


def stream_bits_per_byte(model: TinyLlama, token_ids: list[int],
                         windows: list[tuple[int | None, int]], block_size: int = 16,
                         backend: str = "torch") -> list[float]:
    """Mean bits per predicted token of ``token_ids`` under each of ``windows`` (a token
    is one byte, or the EOS between files: the shipped model's tokenizer); see
    :func:`stream_logprobs`."""
    logp = stream_logprobs(model, token_ids, windows, block_size, backend)
    return [float(-row.mean() / math.log(2)) for row in logp]


def memory_curve(model: TinyLlama, prompt: list[int], max_tokens: int, sliding_window: int,
                 num_sink_tokens: int = 4,
                 block_size: int = 16) -> dict[str, tuple[list[int], list[int]]]:
    """GPU blocks held while one stream generates ``max_tokens`` tokens (EOS ignored):
    ``{"full": (tokens, blocks), "window": (tokens, blocks)}``, one entry per engine step,
    ``tokens`` the stream's tokens with K/V computed after it (the prompt, then one more
    per step) and ``blocks`` those the engine held; ``"full"`` keeps every token, ``"window"``
    runs with ``sliding_window`` and ``num_sink_tokens`` (``(xs, ys)`` pairs, ready to plot)."""
    num_blocks = cdiv(len(prompt) + max_tokens, block_size) + 1
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    curves = {}
    for name, kw in (("full", {}), ("window", {"sliding_window": sliding_window,
                                              "num_sink_tokens": num_sink_tokens})):
        engine = LLMEngine(model, num_blocks, block_size=block_size, watermark=0.0, **kw)
        engine.generate([prompt], params)
        used = list(engine.stats.blocks_used)
        curves[name] = ([len(prompt) + i for i in range(len(used))], used)
    return curves
