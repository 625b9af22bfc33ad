"""The interpreter load tracer: programs, addresses mapped back to elements, masks, int32."""

from __future__ import annotations

import paged_lib  # noqa: F401  (sets up the interpreter before anything Triton)

# isort: split
import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpreterBuilder

from paged_lib.device import interpreter_on
from paged_lib.instruments.load_trace import trace_loads

pytestmark = pytest.mark.skipif(not interpreter_on(), reason="traces the interpreter only")


@triton.jit
def _copy_rows(x_ptr, out_ptr, idx_ptr, n, D: tl.constexpr, WIDE: tl.constexpr):
    """out[i] = x[idx[i]] for i < n; WIDE casts the row id to int64 first."""
    i = tl.program_id(0)
    d = tl.arange(0, D)
    row = tl.load(idx_ptr + i)
    if WIDE:
        row = row.to(tl.int64)
    x = tl.load(x_ptr + row * D + d, mask=d < D - 1, other=0.0)  # the last column: masked
    tl.store(out_ptr + i * D + d, x)


def _run(wide: bool):
    x = torch.arange(24, dtype=torch.float32).view(6, 4)
    idx = torch.tensor([5, 0, 3], dtype=torch.int32)
    out = torch.zeros(3, 4)
    with trace_loads() as trace:
        _copy_rows[(3,)](x, out, idx, 3, D=4, WIDE=wide)
    return x, idx, out, trace


def test_reads_are_mapped_to_programs_elements_and_masks():
    x, idx, out, trace = _run(wide=True)
    assert trace.programs() == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    reads = trace.reads_of(x)
    assert len(reads) == 3  # one row load per program; the idx loads are elsewhere
    for read, row in zip(reads, [5, 0, 3], strict=True):
        assert read.index.tolist() == [[row, c] for c in range(4)]
        assert read.mask.tolist() == [True, True, True, False]
    idx_reads = trace.reads_of(idx)
    assert [r.index.ravel().tolist() for r in idx_reads] == [[0], [1], [2]]
    torch.testing.assert_close(out[:, :3], x[[5, 0, 3], :3])


@triton.jit
def _masked_stray(x_ptr, out_ptr, stray, D: tl.constexpr):
    """Loads x[0:D] with lanes >= 2 masked off and sent ``stray`` elements away."""
    d = tl.arange(0, D)
    offs = tl.where(d < 2, d, stray + d)
    tl.store(out_ptr + d, tl.load(x_ptr + offs, mask=d < 2, other=0.0))


def test_a_masked_lane_that_points_into_another_tensor_is_not_a_read_of_it():
    # Where a masked lane points depends on the allocator: on one machine past a block
    # table's end is free memory, on another it is the K cache. Counting must not care.
    x, y, out = torch.arange(4.0), torch.zeros(64), torch.zeros(4)
    stray = (y.data_ptr() - x.data_ptr()) // x.element_size()
    with trace_loads() as trace:
        _masked_stray[(1,)](x, out, stray, D=4)
    stray_reads = trace.reads_of(y)
    assert len(stray_reads) == 1 and not stray_reads[0].mask.any()
    assert trace.reads_of(y, enabled_only=True) == []
    [read] = trace.reads_of(x, enabled_only=True)
    assert read.index.ravel().tolist() == [0, 1] and read.mask.all()
    assert out.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_32_bit_offsets_that_carry_a_row_index_are_found():
    x, *_, trace = _run(wide=False)
    narrow = trace.narrow_offsets(x, reach=4)
    assert narrow and all(o.dtype == np.int32 for o in narrow)
    assert {o.program for o in narrow} == {(0, 0, 0), (2, 0, 0)}  # row 0 stays below 4
    x, *_, trace = _run(wide=True)
    assert trace.narrow_offsets(x, reach=4) == []


def test_builder_is_restored_even_after_an_error():
    load, addptr = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_addptr
    with pytest.raises(RuntimeError), trace_loads():
        raise RuntimeError("kernel failed")
    assert InterpreterBuilder.create_masked_load is load
    assert InterpreterBuilder.create_addptr is addptr


def test_tracing_refuses_what_it_cannot_map():
    *_, trace = _run(wide=True)
    with pytest.raises(ValueError, match="contiguous"):
        trace.reads_of(torch.zeros(4, 4).t())
    with trace_loads() as empty:  # nothing ran (as for a kernel compiled on a GPU)
        pass
    assert empty.reads_of(torch.zeros(4, 4).t()) == []
    assert empty.narrow_offsets(torch.zeros(4), reach=1) == []


@triton.jit
def _gather_cast_late(x_ptr, out_ptr, idx_ptr, D: tl.constexpr, LATE: tl.constexpr):
    """out[i] = x[idx[i]]; LATE multiplies the int32 row id, then casts the offset."""
    i = tl.program_id(0)
    d = tl.arange(0, D)
    row = tl.load(idx_ptr + i)
    if LATE:
        offs = (row * D + d).to(tl.int64)
    else:
        offs = row.to(tl.int64) * D + d
    tl.store(out_ptr + i * D + d, tl.load(x_ptr + offs))


def test_a_32_bit_product_of_a_loaded_id_is_found_even_when_cast_afterwards():
    x = torch.arange(24, dtype=torch.float32).view(6, 4)
    idx = torch.tensor([5, 0, 3], dtype=torch.int32)
    for late in (True, False):
        out = torch.zeros(3, 4)
        with trace_loads() as trace:
            _gather_cast_late[(3,)](x, out, idx, D=4, LATE=late)
        torch.testing.assert_close(out, x[[5, 0, 3]])
        assert trace.narrow_offsets(x, reach=4) == []  # the pointer offset itself is int64
        products = trace.narrow_products(idx)
        assert len(products) == (3 if late else 0)
        assert all(p.dtype == np.int32 for p in products)
        assert trace.narrow_products(x) == []  # nothing loaded from x is multiplied


@triton.jit
def _dot(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    m, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    tl.store(out_ptr + m[:, None] * N + n[None, :], tl.dot(a, b))


def test_dot_shapes_are_recorded_and_the_builder_is_restored():
    before = InterpreterBuilder.create_dot
    a, b, out = torch.randn(2, 16), torch.randn(16, 4), torch.zeros(2, 4)
    with trace_loads() as trace:
        _dot[(1,)](a, b, out, M=2, K=16, N=4)  # runs here; a GPU needs every dim >= 16
    assert [(d.a_shape, d.b_shape) for d in trace.dots] == [((2, 16), (16, 4))]
    assert InterpreterBuilder.create_dot is before
    torch.testing.assert_close(out, a @ b, atol=1e-2, rtol=1e-2)
