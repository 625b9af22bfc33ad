"""Test-wide set-up.

``paged_lib`` must be imported before ``triton`` anywhere in the process: importing it
sets ``TRITON_INTERPRET=1`` on machines without CUDA, and Triton reads that variable
when ``triton.language`` is first imported and when kernels are defined.
"""

import paged_lib  # noqa: F401
