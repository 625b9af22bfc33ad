"""Linear maps at the CPU's speed: weights stacked and packed once, not per call.

``F.linear`` hands each call's weight to the BLAS as it is, so at small batches (a
decode step has one row per sequence) a CPU streams the weights well below what its
memory delivers. A :class:`LinearWeights` holds one or several weights stacked by rows
(Q, K and V as one map, gate and up as another: one pass over the input instead of
three), packed once for the fastest kernel this machine has:

- **the course's own C kernel** (``csrc/linear.c``, built into
  :mod:`paged_lib.kernels.cpu_decode`'s library where that runs on PyTorch's OpenMP
  threads): the weight in panels of 32 output columns that a thread streams front to
  back, prefetching ahead, with 8 rows' sums in registers. On SmolLM2's 30 layers of maps
  (424 MB, read from memory), two threads of a 2-core AMD EPYC (2026-12-07, the two
  timed in turn in one process), one pass took 9.0, 9.3, 10.4, 15.3 and 58.7 ms at 1, 8,
  16, 32 and 128 rows against oneDNN's 11.2, 12.3, 15.2, 22.3 and 64.2 (46-47 GB/s
  against 35-38 at 1-8 rows, 443 GFLOP/s against 304 at 32), and as long (462 GFLOP/s)
  at 512; on maps that sit in a core's cache (256 to 1,024 wide) 2-3x less than
  ``F.linear`` at 8 and 32 rows and about as long at one. Every size is packed for it.
- else **oneDNN** (PyTorch's ``mkldnn`` backend), which reorders a weight once into the
  blocked layout its fp32 kernels read fastest (``torch.ops.mkldnn._reorder_linear_weight``,
  then ``torch.ops.mkldnn._linear_pointwise``), for maps of :data:`MIN_PREPACK_BYTES` or
  more;
- else the plain weight through ``F.linear`` (another device or dtype, or neither
  kernel here).

Each sums the same products in another order: results agree to about 1e-6 relative.
The model builds them from its ``nn.Linear`` weights on first use and again whenever a
weight changes (:meth:`LinearWeights.stale`), so loading new weights needs no call.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch
from torch.nn import functional as F

#: Smaller stacked weights are not prepacked for oneDNN: they sit in a core's cache, where
#: oneDNN's call costs more than it saves (the course's tiny-code-llama, 512 KB to 1 MB per
#: map: decode steps at batch 8 and 32 took 3.0 and 5.1 ms prepacked, 2.6 and 4.7 plain);
#: SmolLM2's maps are 1.3 to 3.5 MB and stream from memory.
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


@functools.cache
def _c_library() -> ctypes.CDLL | None:
    """The C kernel's library where it is built with PyTorch's OpenMP runtime, else None
    (without it the kernel runs on one thread, slower at two than oneDNN)."""
    from paged_lib.kernels import cpu_decode

    try:
        lib = cpu_decode.library()
    except cpu_decode.KernelUnavailable:
        return None
    if not hasattr(lib, "paged_decode_team"):
        return None
    _P, _I = ctypes.c_void_p, ctypes.c_int64
    lib.linear_pack.restype = lib.linear_rows.restype = None
    lib.linear_pack.argtypes = [_P, _P, _I, _I]
    lib.linear_rows.argtypes = [_P, _I, _P, _P, _I, _I, _I, ctypes.c_int]
    return lib


#: output columns per panel of the C kernel's packed weights (``PANEL`` in linear.c)
PANEL = 32


def c_kernel_available(weight: torch.Tensor) -> bool:
    """Can ``weight`` be packed for the C kernel here (a CPU fp32 tensor, the library
    built on PyTorch's OpenMP runtime)?"""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and _c_library() is not None)


def prepack_available(weight: torch.Tensor) -> bool:
    """Can ``weight`` be prepacked for oneDNN here (a CPU fp32 tensor, oneDNN built)?"""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and _onednn_works())


class LinearWeights:
    """One or several ``[out_i, in]`` weights stacked by rows: ``plain``, and packed for
    the C kernel (``tiles``; unless ``c_kernel=False``) or else, from
    ``min_prepack_bytes`` (default :data:`MIN_PREPACK_BYTES`), for oneDNN (``packed``)
    where either works; :func:`linear` multiplies by them, :meth:`split` cuts the output
    back."""

    def __init__(self, weights: list[torch.Tensor], min_prepack_bytes: int | None = None,
                 c_kernel: bool = True):
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
            self.tiles = self.packed = None
            if c_kernel and c_kernel_available(self.plain):  # every size: see above
                n, k = self.plain.shape
                self.tiles = torch.empty(-(-n // PANEL) * k * PANEL)
                _c_library().linear_pack(self.plain.data_ptr(), self.tiles.data_ptr(), n, k)
            elif big and prepack_available(self.plain):
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.plain)

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
    """``x @ W.T`` for the stacked weights: the C kernel where they are packed for it
    (any number of rows); else oneDNN's prepacked kernel for two rows or more, and for one
    row when PyTorch has more than one thread; the plain weight for one row on one thread
    (BLAS's matrix-vector product). Inputs that need gradients take ``F.linear``.

    One row on one thread, the two are even (an AMD EPYC, 2026-12-06: 268 against 255 us
    for a SmolLM2 layer's four maps). But BLAS's matrix-vector product runs on one thread
    whatever PyTorch's count, where oneDNN's uses them all: on two threads a layer's maps
    took 267 us plain and 170 prepacked, and the LM head (113 MB) 9.7 ms against 4.1.
    """
    if x.requires_grad and torch.is_grad_enabled():
        return F.linear(x, w.plain)
    if w.tiles is not None and x.dim() == 2 and x.dtype == torch.float32 and (
            x.device.type == "cpu" and x.shape[1] == w.plain.shape[1]):
        if x.stride(1) != 1 or x.stride(0) < x.shape[1]:
            x = x.contiguous()
        (m, k), n = x.shape, w.plain.shape[0]
        y = torch.empty(m, n)
        _c_library().linear_rows(x.data_ptr(), x.stride(0), w.tiles.data_ptr(), y.data_ptr(),
                                 m, n, k, torch.get_num_threads())
        return y
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
