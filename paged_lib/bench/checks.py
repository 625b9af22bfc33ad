"""Nothing unchecked is timed: each output is compared with the float64 reference on the
very batch it is then timed on, and :func:`measure` is the only way to a time."""

from __future__ import annotations

from collections.abc import Callable

import torch

from paged_lib.util import CheckFailed

#: How close a benchmarked (or GPU-checked) output must be to the float64 reference.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
#: Text a row shows instead of a time when its output was wrong.
WRONG = "WRONG"


def check_output(name: str, out: torch.Tensor, expected: torch.Tensor) -> None:
    """Raise :class:`CheckFailed` unless ``out`` matches ``expected`` within the tolerance."""
    if out.shape != expected.shape:
        raise CheckFailed(f"{name}: shape {tuple(out.shape)}, expected {tuple(expected.shape)}")
    tol = TOLERANCE.get(out.dtype, 1e-4)
    err = (out.double() - expected.double()).abs()
    bound = tol + tol * expected.double().abs()
    if not bool(torch.isfinite(out).all()) or bool((err > bound).any()):
        raise CheckFailed(f"{name}: max error {float(err.nan_to_num(float('inf')).max()):.3g} "
                          f"(tolerance {tol:g})")


def measure(name: str, fn: Callable[[], torch.Tensor], expected: torch.Tensor,
            timer: Callable[[Callable[[], object]], float]) -> float:
    """Run ``fn`` once, check its output against ``expected``, then time it (ms).

    The one way to a time in the benchmarks: a wrong output raises :class:`CheckFailed`
    and nothing is timed.
    """
    check_output(name, fn(), expected)
    return timer(fn)
