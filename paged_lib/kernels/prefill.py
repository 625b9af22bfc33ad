"""Paged prefill, by the names chapter 05 imports: the kernel lives in
:mod:`~paged_lib.kernels.triton_prefill`, the PyTorch version in
:mod:`~paged_lib.kernels.torch_backend`, the float64 definition in
:mod:`~paged_lib.kernels.reference`."""

from paged_lib.kernels.reference import ref_paged_prefill
from paged_lib.kernels.torch_backend import paged_prefill_torch
from paged_lib.kernels.triton_prefill import _paged_prefill_kernel, paged_prefill_triton

__all__ = ["_paged_prefill_kernel", "paged_prefill_torch", "paged_prefill_triton",
           "ref_paged_prefill"]
