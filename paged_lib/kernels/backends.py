"""The attention backends every entry point of :mod:`paged_lib.kernels` accepts.

One list, checked in one place. It lives in its own module, below everything else in the
package, so that a kernel module (``copy_blocks``) can check its ``backend`` argument
without importing the package's ``__init__`` (which imports the kernels).
"""

BACKENDS = ("triton", "torch", "cpu")


def check_backend(backend: str) -> None:
    """Raise ``ValueError`` naming the choices when ``backend`` is not one of them."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose one of {BACKENDS}")


def resolve_backend(backend: str, device) -> str:
    """``"auto"`` -> the fastest backend that works here, as vLLM picks its own: Triton's
    compiled kernels on a CUDA device; on a CPU the C decode kernel where this machine's
    compiler builds it, else PyTorch ops. Any other name is checked and returned."""
    if backend != "auto":
        check_backend(backend)
        return backend
    if getattr(device, "type", str(device)) == "cuda":
        return "triton"
    from paged_lib.kernels import cpu_decode  # builds the kernel once, on first use

    return "cpu" if cpu_decode.available() else "torch"
