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
