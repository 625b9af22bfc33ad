"""Chapter 00's first Triton kernel: add two vectors, and time the interpreter.

It is the smallest program that shows how a Triton launch works (a grid of programs,
each handling ``BLOCK`` elements with a mask for the ragged end), and lets a learner
see what the CPU interpreter costs per program before the real kernels arrive.
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # which program am I?
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n  # the last program may run off the end
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


def add(x: torch.Tensor, y: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``x + y`` with one Triton program per ``block`` elements."""
    if x.shape != y.shape or x.device != y.device:
        raise ValueError(f"x and y must match: {tuple(x.shape)} on {x.device} vs "
                         f"{tuple(y.shape)} on {y.device}")
    out = torch.empty_like(x)
    n = x.numel()
    grid = (triton.cdiv(n, block),)
    add_kernel[grid](x, y, out, n, BLOCK=block)
    return out


def seconds_per_program(num_programs: int = 64, block: int = 128, repeats: int = 3) -> float:
    """Median wall time of one program of :func:`add` (interpreter or GPU)."""
    x = torch.randn(num_programs * block)
    if torch.cuda.is_available():
        x = x.cuda()
    add(x, x, block)  # compile / warm up
    times = []
    for _ in range(repeats):
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        add(x, x, block)
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] / num_programs
