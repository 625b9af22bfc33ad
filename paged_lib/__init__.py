"""paged_lib: the code behind the PagedAttention course.

Importing the package decides, before any Triton kernel is defined, whether kernels
compile for a GPU or run in Triton's CPU interpreter (see :mod:`paged_lib.device`).
"""

from paged_lib.device import configure as _configure

_configure()

from paged_lib._show import show_source  # noqa: E402
from paged_lib.device import default_device, mode  # noqa: E402

__all__ = ["default_device", "mode", "show_source"]
__version__ = "0.1.0"
