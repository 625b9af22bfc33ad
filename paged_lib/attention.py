"""Attention over blocks: the ideas of chapter 4, one small function each.

Decode attention for one query vector ``q`` over ``n`` keys and values::

    out = softmax(scale * K q) V

The softmax needs the whole row of scores before it can normalise. Split the keys into
blocks and keep, per query, three numbers' worth of *state*: the running maximum ``m``,
the running sum ``l`` of ``exp(score - m)``, and the running weighted sum ``acc`` of the
values. Two states merge exactly (:func:`merge`), so blocks can be visited one at a
time, in any order, wherever they live in memory. That is the online softmax behind
FlashAttention, and the reason PagedAttention can read K/V block by block through a
block table.

Shapes: ``q [..., d]``, ``k, v [..., n, d]``: any leading dimensions (heads, sequences)
broadcast. Everything here is written for reading, not speed; the fast path is
:mod:`paged_lib.kernels.torch_backend`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from paged_lib.util import cdiv


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float | None = None) -> torch.Tensor:
    """The textbook formula, contiguous K/V, whole score row at once: ``[..., d]``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (k @ q[..., None])[..., 0] * scale           # [..., n]
    probs = torch.softmax(scores, dim=-1)
    return (probs[..., None, :] @ v)[..., 0, :]           # [..., d]


class SoftmaxState(NamedTuple):
    """Partial result of attention over some of the keys.

    ``m``: the largest score seen (``-inf`` if none); ``l``: sum of ``exp(score - m)``;
    ``acc``: sum of ``exp(score - m) * v``. The output is ``acc / l``.
    """

    m: torch.Tensor    # [...]
    l: torch.Tensor    # [...]  # noqa: E741
    acc: torch.Tensor  # [..., d]


def _safe(m: torch.Tensor) -> torch.Tensor:
    """``m`` with ``-inf`` replaced by 0, so ``exp(-inf - m)`` is 0 rather than NaN."""
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def block_state(scores: torch.Tensor, v: torch.Tensor) -> SoftmaxState:
    """State of one block from its scores ``[..., b]`` (``-inf`` = masked) and ``v [..., b, d]``.

    A block whose scores are all ``-inf`` gives ``m = -inf, l = 0, acc = 0``: it changes
    nothing when merged. Values at masked positions must be finite (zero them first):
    their weight is 0, but ``0 * NaN`` is NaN.
    """
    m = scores.amax(dim=-1)
    p = torch.exp(scores - _safe(m)[..., None])
    return SoftmaxState(m, p.sum(dim=-1), (p[..., None, :] @ v)[..., 0, :])


def merge_states(parts: SoftmaxState) -> SoftmaxState:
    """Combine ``n`` states stacked along dim 0 (``m, l [n, ...]``, ``acc [n, ..., d]``).

    Rescale every part to the common maximum ``M``, then add: exact, in any order. A
    part that saw no key (``m = -inf``) weighs ``exp(-inf) = 0``; so do all parts when
    every one is empty (``M = -inf`` is taken as 0: no ``-inf - -inf = NaN``). A NaN
    (a poisoned read) stays NaN.
    """
    m = parts.m.amax(dim=0)
    w = torch.exp(parts.m - _safe(m))                  # [n, ...]
    weighted = w[..., None] * parts.acc
    weighted.masked_fill_(w[..., None] == 0, 0.0)  # an empty part's acc may be anything
    return SoftmaxState(m, (w * parts.l).sum(dim=0), weighted.sum(dim=0))


def merge(a: SoftmaxState, b: SoftmaxState) -> SoftmaxState:
    """Combine the states of two disjoint sets of keys, exactly: :func:`merge_states` of two.

    Commutative and associative (up to rounding), which is what lets a kernel visit
    blocks in any order or split them across programs and merge later (flash-decoding).
    """
    pairs = [torch.broadcast_tensors(x, y) for x, y in zip(a, b, strict=True)]
    return merge_states(SoftmaxState(*(torch.stack(pair) for pair in pairs)))


def merge_partials(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Merge partial attention results stacked along dim 0 (flash-decoding's reduce).

    ``out [n, ..., d]``: each part already divided by its own softmax denominator;
    ``lse [n, ...]``: the natural log of that denominator (``logsumexp`` of the part's
    scores), ``-inf`` for a part that saw no key. Returns ``[..., d]``::

        sum_j exp(lse_j - M) * out_j / sum_j exp(lse_j - M),   M = max_j lse_j

    It is :func:`merge_states` again: a normalised part is the state ``m = lse_j,
    l = 1, acc = out_j`` (same output ``acc / l``, same mass ``exp(m) * l``). When every
    part is empty the result is zeros.
    """
    lse = lse.to(out.dtype)
    state = merge_states(SoftmaxState(lse, torch.ones_like(lse), out))
    l = state.l[..., None]  # noqa: E741
    return torch.where(l == 0, 0.0, state.acc / torch.where(l == 0, 1.0, l))


def empty_state(q: torch.Tensor, d_v: int | None = None) -> SoftmaxState:
    """The state of no keys at all: the identity of :func:`merge`."""
    shape = q.shape[:-1]
    d_v = q.shape[-1] if d_v is None else d_v
    return SoftmaxState(torch.full(shape, float("-inf"), dtype=q.dtype),
                        torch.zeros(shape, dtype=q.dtype),
                        torch.zeros(*shape, d_v, dtype=q.dtype))


def finalize(state: SoftmaxState) -> torch.Tensor:
    """The attention output ``acc / l``."""
    return state.acc / state.l[..., None]


@dataclass
class Trace:
    """What the running state looked like after each block (for the picture)."""

    block_max: list[torch.Tensor] = field(default_factory=list)    # max score in the block
    running_max: list[torch.Tensor] = field(default_factory=list)  # m after merging it
    running_sum: list[torch.Tensor] = field(default_factory=list)  # l after merging it


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int,
                        scale: float | None = None, mask: torch.Tensor | None = None,
                        trace: Trace | None = None) -> torch.Tensor:
    """Attention computed one block of keys at a time with the online softmax.

    Equal to :func:`naive_attention` up to rounding. ``mask [..., n]`` (True = attend)
    is optional; masked keys score ``-inf``. Pass a :class:`Trace` to record the running
    max and sum after each block.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n = k.shape[-2]
    state = empty_state(q, v.shape[-1])
    for start in range(0, n, block_size):
        kb, vb = k[..., start:start + block_size, :], v[..., start:start + block_size, :]
        scores = (kb @ q[..., None])[..., 0] * scale
        if mask is not None:
            scores = scores.masked_fill(~mask[..., start:start + block_size], float("-inf"))
        block = block_state(scores, vb)
        state = merge(state, block)
        if trace is not None:
            trace.block_max.append(block.m)
            trace.running_max.append(state.m)
            trace.running_sum.append(state.l)
    return finalize(state)


def paged_blockwise_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_table: torch.Tensor, seq_len: int,
                              scale: float | None = None) -> torch.Tensor:
    """One sequence's decode attention, reading K/V block by block through its block table.

    ``q [num_heads, d]``; caches ``[num_blocks, block_size, num_kv_heads, d]``. This is
    the loop the Triton kernel of chapter 5 runs: logical block ``j`` lives in physical
    block ``block_table[j]``; only the last block is partly filled, and its slots past
    ``seq_len`` are masked *and* their values zeroed (they may hold NaN).
    """
    num_heads, d = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    scale = d ** -0.5 if scale is None else scale
    qg = q.view(num_kv_heads, group, d)               # query heads grouped by KV head
    state = empty_state(qg, v_cache.shape[-1])
    for j in range(cdiv(seq_len, block_size)):
        block = int(block_table[j])
        valid = torch.arange(block_size) < seq_len - j * block_size      # [block_size]
        kb = k_cache[block].transpose(0, 1)[:, None]   # [kv_heads, 1, block_size, d]
        vb = v_cache[block].transpose(0, 1)[:, None]
        kb = torch.where(valid[:, None], kb, 0.0)
        vb = torch.where(valid[:, None], vb, 0.0)
        scores = (kb @ qg[..., None])[..., 0] * scale  # [kv_heads, group, block_size]
        scores = scores.masked_fill(~valid, float("-inf"))
        state = merge(state, block_state(scores, vb))
    return finalize(state).reshape(num_heads, d)
