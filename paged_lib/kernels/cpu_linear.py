"""Linear maps at the CPU's speed: weights stacked and prepacked once, not per call.

``F.linear`` hands each call's weight to the BLAS as it is, so at small batches (a
decode step has one row per sequence) a CPU streams the weights well below what its
memory delivers. oneDNN (PyTorch's ``mkldnn`` backend) can reorder a weight once into
the blocked layout its fp32 kernels read fastest
(``torch.ops.mkldnn._reorder_linear_weight``) and then multiply by it with
``torch.ops.mkldnn._linear_pointwise``: the same products, summed in another order
(results agree to about 1e-6 relative). A :class:`LinearWeights` holds one or several
weights stacked by rows (Q, K and V as one map, gate and up as another: one pass over
the input instead of three) in both forms, the plain one for a single row on one thread
(a matrix-vector product, already at the bandwidth in BLAS), for maps small enough to sit
in a core's cache (:data:`MIN_PREPACK_BYTES`), and where oneDNN is missing (not built,
another device, another dtype).

The model builds them from its ``nn.Linear`` weights on first use and again whenever a
weight changes (:meth:`LinearWeights.stale`), so loading new weights needs no call.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.nn import functional as F

#: Smaller stacked weights stay plain: they sit in a core's cache, where oneDNN's call
#: costs more than it saves (the course's tiny-code-llama, 512 KB to 1 MB per map: decode
#: steps at batch 8 and 32 took 3.0 and 5.1 ms prepacked, 2.6 and 4.7 plain); SmolLM2's
#: maps are 1.3 to 3.5 MB and stream from memory.
MIN_PREPACK_BYTES = 5 * 2**18  # 1.25 MiB


@functools.cache
def _onednn_works() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or ops is None:
        return False
    try:  # present is not enough: a build may lack the fp32 kernels (a clear no, once)
        w = torch.ones(4, 8)
        packed = ops._reorder_linear_weight(w)
        out = ops._linear_pointwise(torch.ones(2, 8), packed, None, "none", [], "")
        return bool((out == 8).all())
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def prepack_available(weight: torch.Tensor) -> bool:
    """Can ``weight`` be prepacked for oneDNN here (a CPU fp32 tensor, oneDNN built)?"""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and _onednn_works())


class LinearWeights:
    """One or several ``[out_i, in]`` weights stacked by rows, plain and (where it works)
    prepacked; :func:`linear` multiplies by them, :meth:`split` cuts the output back."""

    def __init__(self, weights: list[torch.Tensor], min_prepack_bytes: int | None = None):
        if not weights or any(w.ndim != 2 or w.shape[1] != weights[0].shape[1]
                              for w in weights):
            raise ValueError("LinearWeights needs 2-D weights with the same input size, got "
                             f"{[tuple(w.shape) for w in weights]}")
        self.key = self._key(weights)
        self.sizes = [w.shape[0] for w in weights]
        with torch.no_grad():
            plain = weights[0] if len(weights) == 1 else torch.cat(weights)
            self.plain = plain.detach().contiguous()
            least = MIN_PREPACK_BYTES if min_prepack_bytes is None else min_prepack_bytes
            big = self.plain.numel() * self.plain.element_size() >= least
            self.packed = (torch.ops.mkldnn._reorder_linear_weight(self.plain)
                           if big and prepack_available(self.plain) else None)

    @staticmethod
    def _key(weights: list[torch.Tensor]) -> tuple:
        # an inference-mode tensor has no version counter (and cannot change in place)
        return tuple((w.data_ptr(), -1 if w.is_inference() else w._version, w.dtype,
                      w.device) for w in weights)

    def stale(self, weights: list[torch.Tensor]) -> bool:
        """Were these weights replaced or changed in place since they were stacked?"""
        return self._key(weights) != self.key

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The stacked map's output cut back into each weight's columns."""
        return y.split(self.sizes, dim=-1)


def linear(x: torch.Tensor, w: LinearWeights) -> torch.Tensor:
    """``x @ W.T`` for the stacked weights: oneDNN's prepacked kernel for two rows or
    more, and for one row when PyTorch has more than one thread; the plain weight for one
    row on one thread (BLAS's matrix-vector product).

    One row on one thread, the two are even (an AMD EPYC, 2026-12-06: 268 against 255 us
    for a SmolLM2 layer's four maps). But BLAS's matrix-vector product runs on one thread
    whatever PyTorch's count, where oneDNN's uses them all: on two threads a layer's maps
    took 267 us plain and 170 prepacked, and the LM head (113 MB) 9.7 ms against 4.1.
    """
    if w.packed is not None and x.dim() == 2 and x.dtype == torch.float32 and (
            x.shape[0] > 1 or torch.get_num_threads() > 1):
        return torch.ops.mkldnn._linear_pointwise(x, w.packed, None, "none", [], "")
    return F.linear(x, w.plain)


#: each module's stacked (and prepacked) weights, kept outside the modules, so a copy or a
#: pickle of a model never carries oneDNN's opaque tensors (they cannot be copied)
_STACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stacked_weights(module: torch.nn.Module, name: str,
                    weights: list[torch.Tensor]) -> LinearWeights:
    """``module``'s ``weights`` stacked as one map called ``name``: the ones built before
    if those weights have not changed since, else built (and prepacked) now."""
    cache = _STACKED.setdefault(module, {})
    w = cache.get(name)
    if w is None or w.stale(weights):
        cache[name] = w = LinearWeights(weights)
    return w
