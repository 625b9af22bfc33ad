"""See every load a Triton kernel makes in the interpreter: which program, which elements.

A NaN-poisoned cache proves that poison never reaches the *output*. It cannot prove that
nothing was *read*: a kernel that loads K past a sequence's end without a mask and then
hides the NaN with ``tl.where(valid, s, -inf)`` passes it, and on a GPU that same load
may fault or read another process's memory. In Triton's interpreter every ``tl.load``
goes through ``InterpreterBuilder.create_masked_load(ptrs, mask, other, ...)`` (an
unmasked load with an all-true mask), and every ``ptr + offset`` through
``create_addptr``. :func:`trace_loads` wraps both for the duration of a ``with`` block
and records, per program (its grid index), the byte addresses and the mask of each
load, and the integer type of each pointer offset. :class:`LoadTrace` maps addresses back
to elements of the tensors you name::

    with trace_loads() as trace:
        kernel[grid](out, x, ...)
    for read in trace.reads_of(x):        # one per load that touched x
        read.program, read.index, read.mask  # (x, y, z), [n, x.dim()] indices, [n] bools

Two more things only the builder sees. Every value computed from a loaded integer (a
block id, a row id) carries the loads it came from, so :meth:`LoadTrace.narrow_products`
finds a ``block * stride`` multiplied in 32 bits even when the sum is cast to int64
afterwards (the wrap has already happened); and every ``tl.dot`` records its operand
shapes (:attr:`LoadTrace.dots`), which a GPU limits and the interpreter does not.

Only in the interpreter (``TRITON_INTERPRET=1``) and for CPU tensors (the interpreter
then loads from the tensor's own memory); a compiled kernel is not traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Load:
    """One ``tl.load`` by one program: flat byte addresses and which lanes were enabled."""

    program: tuple[int, int, int]
    addresses: np.ndarray  # uint64, flattened
    mask: np.ndarray       # bool, same length: False = masked (not read)


@dataclass
class Offset:
    """One ``pointer + offset`` whose result lands somewhere: the offset's integer type."""

    program: tuple[int, int, int]
    dtype: np.dtype
    largest: int           # the largest |offset| in elements
    addresses: np.ndarray  # the resulting byte addresses (flattened)


@dataclass
class Product:
    """One integer multiply (or shift) narrower than 64 bits, of a value derived from loads."""

    program: tuple[int, int, int]
    dtype: np.dtype
    sources: frozenset[int]  # indices into LoadTrace.loads of the loads it derives from


@dataclass
class Dot:
    """One ``tl.dot``: the shapes of its two operands."""

    program: tuple[int, int, int]
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]


@dataclass
class TensorRead:
    """The part of one :class:`Load` that fell inside a given tensor."""

    program: tuple[int, int, int]
    index: np.ndarray  # int64 [n, tensor.dim()]: the element each lane addressed
    mask: np.ndarray   # bool [n]


@dataclass
class LoadTrace:
    """Everything recorded inside one :func:`trace_loads` block."""

    loads: list[Load] = field(default_factory=list)
    offsets: list[Offset] = field(default_factory=list)
    products: list[Product] = field(default_factory=list)
    dots: list[Dot] = field(default_factory=list)

    def reads_of(self, tensor: torch.Tensor, enabled_only: bool = False) -> list[TensorRead]:
        """Each load's lanes that address ``tensor`` (contiguous, on the CPU), as indices.

        A masked-off lane still has an address, and it can be anything: past the end of
        another tensor, and so, depending on where the allocator put them, inside this
        one. ``enabled_only=True`` keeps only enabled lanes (and so only loads that really
        read ``tensor``); count loads that way, never by ``len`` of the default.
        """
        if not self.loads:  # nothing traced (e.g. a kernel compiled for a GPU)
            return []
        lo, hi, size = _extent(tensor)
        out = []
        for load in self.loads:
            inside = (load.addresses >= lo) & (load.addresses < hi)
            if enabled_only:
                inside &= load.mask
            if inside.any():
                flat = (load.addresses[inside] - lo) // size
                index = np.stack(np.unravel_index(flat.astype(np.int64), tuple(tensor.shape)), 1)
                out.append(TensorRead(load.program, index, load.mask[inside]))
        return out

    def narrow_offsets(self, tensor: torch.Tensor, reach: int) -> list[Offset]:
        """``ptr + offset`` into ``tensor`` with a 32-bit offset of ``reach`` elements or more.

        An offset that large carries a row or block index; computed in 32 bits it wraps
        once the tensor passes 2**31 elements, and the kernel reads the wrong memory.
        """
        if not self.offsets:
            return []
        lo, hi, _ = _extent(tensor)
        return [o for o in self.offsets
                if o.dtype.itemsize < 8 and o.largest >= reach
                and ((o.addresses >= lo) & (o.addresses < hi)).any()]

    def narrow_products(self, tensor: torch.Tensor) -> list[Product]:
        """32-bit (or narrower) multiplies of values loaded from ``tensor`` (e.g. block ids).

        ``block * BLOCK_STRIDE`` in int32 wraps past 2**31 however the result is cast
        later; only a cast of the loaded id *before* multiplying is safe.
        """
        if not self.products:
            return []
        lo, hi, _ = _extent(tensor)
        inside = {i for i, load in enumerate(self.loads)
                  if ((load.addresses >= lo) & (load.addresses < hi) & load.mask).any()}
        return [p for p in self.products if p.sources & inside]

    def programs(self) -> list[tuple[int, int, int]]:
        """Every program that loaded something, in launch order."""
        return list(dict.fromkeys(load.program for load in self.loads))


def _extent(tensor: torch.Tensor) -> tuple[int, int, int]:
    if tensor.device.type != "cpu":
        raise ValueError(f"load tracing needs CPU tensors (the interpreter copies others), "
                         f"got a tensor on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("load tracing maps addresses to indices of contiguous tensors only; "
                         "pass tensor.contiguous() to the kernel")
    size = tensor.element_size()
    return tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * size, size


@contextlib.contextmanager
def trace_loads() -> Iterator[LoadTrace]:
    """Record every load (and pointer offset) of interpreted kernels run inside the block."""
    from triton.runtime.interpreter import InterpreterBuilder

    trace = LoadTrace()
    load, addptr = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_addptr

    def traced_load(self, ptrs, mask, other, cache_policy, is_volatile):
        trace.loads.append(Load(tuple(int(i) for i in self.grid_idx),
                                np.asarray(ptrs.data, dtype=np.uint64).ravel().copy(),
                                np.broadcast_to(mask.data, ptrs.data.shape).ravel().copy()))
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def traced_addptr(self, ptr, offset):
        result = addptr(self, ptr, offset)
        data = np.asarray(offset.data)
        if data.dtype.kind in "iu" and data.size:
            largest = int(np.abs(data.astype(np.int64)).max())  # in elements, not bytes
            trace.offsets.append(Offset(tuple(int(i) for i in self.grid_idx), data.dtype,
                                        largest, np.asarray(result.data, np.uint64).ravel()))
        return result

    originals = {name: getattr(InterpreterBuilder, name) for name in dir(InterpreterBuilder)
                 if name.startswith("create_") and callable(getattr(InterpreterBuilder, name))}
    wrapped = {name: _tainting(name, fn, trace) for name, fn in originals.items()}
    wrapped["create_masked_load"] = _tainting("create_masked_load", traced_load, trace)
    wrapped["create_addptr"] = _tainting("create_addptr", traced_addptr, trace)
    for name, fn in wrapped.items():
        setattr(InterpreterBuilder, name, fn)
    try:
        yield trace
    finally:
        for name, fn in originals.items():
            setattr(InterpreterBuilder, name, fn)


_TAINT = "load_trace.sources"  # key in a TensorHandle's attr: the loads it derives from
_NARROWING = {"create_mul", "create_shl"}


def _handles(values) -> Iterator:
    for v in values:
        if hasattr(v, "attr") and hasattr(v, "data"):
            yield v
        elif isinstance(v, list | tuple):
            yield from _handles(v)


def _tainting(name: str, fn, trace: LoadTrace):
    """``fn`` (a builder method) that passes the loads its inputs derive from to its result."""

    def run(self, *args, **kwargs):
        result = fn(self, *args, **kwargs)
        sources = frozenset().union(*(h.attr.get(_TAINT, frozenset())
                                      for h in _handles(args)))
        program = tuple(int(i) for i in self.grid_idx)
        if name == "create_masked_load":
            data = np.asarray(result.data)
            sources = frozenset({len(trace.loads) - 1}) if data.dtype.kind in "iu" \
                else frozenset()
        elif name == "create_dot":
            trace.dots.append(Dot(program, tuple(np.shape(args[0].data)),
                                  tuple(np.shape(args[1].data))))
        elif name in _NARROWING and sources:
            data = np.asarray(result.data)
            if data.dtype.kind in "iu" and data.dtype.itemsize < 8:
                trace.products.append(Product(program, data.dtype, sources))
        if sources:
            for h in _handles([result]):
                h.attr[_TAINT] = h.attr.get(_TAINT, frozenset()) | sources
        return result

    return run
