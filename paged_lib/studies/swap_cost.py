"""What a preemption costs in time: swapping blocks over a link vs recomputing tokens.

The paper's §7.3 (Fig. 19): swapping is costly at small block sizes, because every block
is its own small CPU-GPU transfer, while recomputation costs the same at every block size;
so recompute wins at small blocks and swap at large ones. This module is that argument
as a cost model, with every number a parameter:

* a **transfer** (:class:`Link`) costs a fixed ``overhead_s`` per separate copy plus
  ``bytes / bandwidth``; :func:`fit_link` fits the overhead (and the copy bandwidth) to
  measured times of ``k`` separate copies (``paged_lib.bench.swap`` measures them);
* a **swap** (:func:`swap_seconds`) of ``num_tokens`` tokens moves ``cdiv(num_tokens,
  block_size)`` whole blocks out and back in, each as ``copies_per_block`` separate
  copies (vLLM v0 issues one ``cudaMemcpyAsync`` per block per layer, for K and for V:
  ``2 * num_layers``; one indexed copy per layer for all blocks, as this course's engine
  does, would be ``copies_per_block=0`` plus a few copies per swap);
* a **recompute** (:func:`recompute_seconds`) runs the tokens through the model again:
  ``num_tokens / tokens_per_s``, whatever the block size (:func:`tokens_per_s_from_flops`
  turns a FLOP rate into that, at ``2 * num_params`` FLOPs per token).

Swap's time falls as ``1 / block_size`` towards its bandwidth floor; recompute's is flat.
So they cross at most once (:func:`crossing_block_size`): below the crossing recompute
wins, above it swap, provided recomputing a token costs more than moving its bytes.

This is the model; :mod:`paged_lib.studies.preemption_time` measures the same two costs
on the machine at hand, with the engine's own swap and recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paged_lib.accounting import ModelSpec, kv_bytes_per_token
from paged_lib.util import cdiv

#: An assumption, not a measurement: PCIe 4.0 x16 moves 32 GB/s raw per direction;
#: about 25 GB/s is what a large pinned host-device copy reaches.
PCIE4_X16_BYTES_PER_S = 25e9


@dataclass(frozen=True)
class Link:
    """A copy costs ``overhead_s`` per separate copy plus ``bytes / bandwidth``."""

    overhead_s: float
    bandwidth: float  # bytes per second

    def seconds(self, num_copies: int | float, nbytes: int | float) -> float:
        return num_copies * self.overhead_s + nbytes / self.bandwidth


def fit_link(num_copies, nbytes, seconds) -> Link:
    """Least-squares fit of ``seconds = num_copies * overhead + nbytes / bandwidth``.

    The three arguments are equal-length sequences, one entry per measurement (each of
    ``num_copies`` separate copies moving ``nbytes`` in all). Both coefficients are
    clipped to be positive (a bandwidth term lost in the noise gives an infinite
    bandwidth, i.e. ``bytes`` cost nothing measurable).
    """
    a = np.column_stack([np.asarray(num_copies, float), np.asarray(nbytes, float)])
    y = np.asarray(seconds, float)
    if a.shape[0] < 2 or a.shape[0] != y.shape[0]:
        raise ValueError("fit_link needs at least two measurements, one time each")
    (overhead, per_byte), *_ = np.linalg.lstsq(a, y, rcond=None)
    if overhead <= 0:
        raise ValueError("the fitted per-copy overhead is not positive: measure more copies")
    return Link(float(overhead), float("inf") if per_byte <= 0 else float(1.0 / per_byte))


def copies_per_block(spec: ModelSpec) -> int:
    """Separate copies a per-block swap issues for one block: K and V of every layer."""
    return 2 * spec.num_layers


def swap_seconds(num_tokens: int, block_size: int, spec: ModelSpec, link: Link,
                 copies_per_blk: int | None = None, both_ways: bool = True) -> float:
    """Time to swap ``num_tokens`` tokens' blocks out (and, by default, back in).

    Whole blocks move (the part-filled last one too), each as ``copies_per_blk``
    separate copies (default :func:`copies_per_block`).
    """
    blocks = cdiv(num_tokens, block_size)
    per_block = copies_per_block(spec) if copies_per_blk is None else copies_per_blk
    one_way = link.seconds(blocks * per_block,
                           blocks * block_size * kv_bytes_per_token(spec))
    return 2 * one_way if both_ways else one_way


def tokens_per_s_from_flops(spec: ModelSpec, flop_per_s: float) -> float:
    """Prefill rate at ``flop_per_s`` if a token costs ``2 * num_params`` FLOPs (the
    matrix multiplies; attention over a short context adds little)."""
    if spec.num_params <= 0:
        raise ValueError(f"ModelSpec {spec.name!r} has no num_params")
    return flop_per_s / (2 * spec.num_params)


def recompute_seconds(num_tokens: int, tokens_per_s: float) -> float:
    """Time to prefill ``num_tokens`` again: the block size does not enter."""
    return num_tokens / tokens_per_s


def crossing_block_size(spec: ModelSpec, link: Link, tokens_per_s: float,
                        copies_per_blk: int | None = None) -> float | None:
    """The block size where swap (both ways) and recompute cost the same, per token,
    ignoring the part-filled last block: ``2 c o / (1 / r - 2 B / W)`` with ``c``
    copies per block, ``o`` the overhead, ``B`` bytes per token, ``W`` the bandwidth
    and ``r`` the recompute rate. ``None`` if swapping a token's bytes alone costs at
    least as much as recomputing it (then recompute wins at every block size)."""
    per_block = copies_per_block(spec) if copies_per_blk is None else copies_per_blk
    margin = 1.0 / tokens_per_s - 2 * kv_bytes_per_token(spec) / link.bandwidth
    if margin <= 0:
        return None
    return 2 * per_block * link.overhead_s / margin
