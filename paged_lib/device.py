"""Where the course's kernels run: a CUDA GPU natively, or Triton's interpreter on the CPU.

Triton reads ``TRITON_INTERPRET`` when a kernel is *defined*, so the choice has to be made
before any ``@triton.jit`` function is created. ``import paged_lib`` calls
:func:`configure` first thing, and every notebook, solution and test imports ``paged_lib``
before it imports a kernel module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


def configure() -> bool:
    """Turn on Triton's interpreter when no CUDA device is present and nobody chose.

    Returns whether the interpreter is on. A learner who set ``TRITON_INTERPRET`` (to
    ``1`` or ``0``) keeps their choice.
    """
    if "TRITON_INTERPRET" not in os.environ and not _cuda_available():
        os.environ["TRITON_INTERPRET"] = "1"
    return interpreter_on()


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class Mode:
    """What the course runs on, in words a learner can act on."""

    device: str  # "cuda" or "cpu": where tensors live by default
    triton_interpreter: bool
    gpu_name: str | None

    def describe(self) -> str:
        if self.device == "cuda" and not self.triton_interpreter:
            return f"GPU mode: Triton kernels compile natively for {self.gpu_name}."
        if self.device == "cuda":
            return (
                f"GPU present ({self.gpu_name}) but TRITON_INTERPRET=1: kernels run in "
                "Triton's interpreter. Unset it to compile them."
            )
        return (
            "CPU mode: no CUDA device, so Triton kernels run in Triton's interpreter "
            "(TRITON_INTERPRET=1). Results are exact, but each kernel program runs as "
            "Python, so keep launches small; GPU benchmarks skip themselves."
        )


def mode() -> Mode:
    cuda = _cuda_available()
    name = None
    if cuda:
        import torch

        name = torch.cuda.get_device_name(0)
    return Mode(device="cuda" if cuda else "cpu", triton_interpreter=interpreter_on(),
                gpu_name=name)


def default_device() -> str:
    """The device tensors for kernels should live on: ``cuda`` if present, else ``cpu``."""
    return "cuda" if _cuda_available() else "cpu"
