"""What chapter 05's graders share: launching a learner's kernel under the load trace,
and buffers with poisoned guards around them (see :mod:`~paged_lib.course.grading.ch05`).

On a GPU (kernels compiled, not interpreted) the trace is empty and only the poison runs.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from paged_lib.course import grading
from paged_lib.instruments.load_trace import LoadTrace, trace_loads

NAN = float("nan")
#: What surrounds an output: a kernel that stores there (even NaN) changes it.
OUT_GUARD = -7777.0


# ------------------------------------------------------------------ launching and tracing

def stub_not_done(kernel: Any) -> None:
    """A stub still holding ``raise NotImplementedError()`` is 'not attempted'.

    In the interpreter the raise would surface when the kernel runs; a compiling GPU
    backend would reject it as a compile error instead, so look at the source first.
    """
    fn = getattr(kernel, "fn", kernel)
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return
    if "raise NotImplementedError" in src:
        raise NotImplementedError


def interpreted() -> bool:
    from paged_lib.device import interpreter_on

    return interpreter_on()


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **constants: Any) -> LoadTrace:
    """Run the learner's kernel; return its load trace (empty when compiled on a GPU).

    The interpreter wraps what a kernel raised in its own error; the learner sees theirs.
    """
    stub_not_done(kernel)
    with trace_loads() as trace, np.errstate(all="ignore"):  # overflow: reported as such
        try:
            kernel[grid](*args, **constants)
        except Exception as err:
            cause = err.__cause__
            if isinstance(cause, NotImplementedError):
                raise NotImplementedError from err
            if cause is not None and type(err).__name__ == "InterpreterError":
                raise cause from None
            raise
    check_gpu_limits(trace)
    return trace


#: The smallest tile dimension ``tl.dot`` accepts on NVIDIA GPUs (tensor cores).
MIN_DOT = 16


def check_gpu_limits(trace: LoadTrace) -> None:
    """What a GPU would refuse and the interpreter runs anyway: ``tl.dot`` on a tile with a
    dimension under 16 (it compiles on no NVIDIA GPU)."""
    for dot in trace.dots:
        if min(dot.a_shape[-2:] + dot.b_shape[-2:]) < MIN_DOT:
            grading.fail(f"program {dot.program[:2]} called tl.dot on a "
                         f"{list(dot.a_shape)} x {list(dot.b_shape)} tile: the interpreter "
                         f"runs it, but a GPU needs every dimension of a tl.dot to be at "
                         f"least {MIN_DOT}",
                         hint="for tiles this small use tl.sum(a[:, :, None] * b[None, :, :], "
                              "axis=1); or pad the tile to 16 rows (masked) before tl.dot")


class Guarded:
    """A tensor in the middle of a flat buffer with ``pad`` poisoned elements on each side.

    A learner's kernel that loads or stores a little outside the tensor (a tile hanging
    over the edge, a negative offset) touches the guard, not memory nobody owns (which
    could crash the notebook's kernel); the trace and the guard's values show it.
    """

    def __init__(self, values: torch.Tensor, pad: int, fill: float | int = NAN):
        from paged_lib import default_device

        pad = max(pad, values.numel())  # a sign error in an offset stays in the guard
        self.pad, self.shape, self.fill = pad, tuple(values.shape), fill
        buffer = torch.full((values.numel() + 2 * pad,), fill, dtype=values.dtype)
        buffer[pad:pad + values.numel()] = values.reshape(-1)
        self.buffer = buffer.to(default_device())
        self.view = self.buffer[pad:pad + values.numel()].view(self.shape)

    def reads(self, trace: LoadTrace) -> list[tuple[tuple, np.ndarray, np.ndarray]]:
        """Per load touching the buffer: (program, flat index relative to the view, mask)."""
        return [(r.program, r.index[:, 0] - self.pad, r.mask)
                for r in trace.reads_of(self.buffer)]

    def guard_intact(self) -> bool:
        buf = self.buffer.cpu()
        guard = torch.cat([buf[:self.pad], buf[self.pad + self.view.numel():]])
        return bool(guard.isnan().all()) if isinstance(self.fill, float) and \
            math.isnan(self.fill) else bool((guard == self.fill).all())


def first_outside(guarded: Guarded, trace: LoadTrace, inside: Callable[[np.ndarray], np.ndarray]
                  ) -> tuple[tuple, int, int] | None:
    """(program, flat index, count) of the first load with unmasked lanes outside."""
    for program, flat, mask in guarded.reads(trace):
        bad = mask & ~inside(flat)
        if bad.any():
            return program, int(flat[np.flatnonzero(bad)[0]]), int(bad.sum())
    return None


def expect_no_nan(got: torch.Tensor, expected: torch.Tensor, what: str, hint: str) -> None:
    nan = got.isnan() & ~expected.isnan()
    if nan.any():
        where = tuple(int(i) for i in nan.nonzero()[0])
        grading.fail(f"{what}: NaN at {list(where)}: poison (memory the kernel must not use) "
                     "reached the output", hint)
