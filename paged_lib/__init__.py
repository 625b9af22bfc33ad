"""paged_lib: the code behind the PagedAttention course.

Two parts. The system the course builds (accounting, workloads, fragmentation, blocks,
attention, kernels, model, engine) never imports the course part, :mod:`paged_lib.course`
(graders, pictures, widgets, chapter demos, show_source). Instruments both use live in
:mod:`paged_lib.instruments`, benchmarks in :mod:`paged_lib.bench`.

Importing the package decides, before any Triton kernel is defined, whether kernels
compile for a GPU or run in Triton's CPU interpreter (see :mod:`paged_lib.device`).
"""

from paged_lib.device import configure as _configure

_configure()

from paged_lib.device import default_device, mode  # noqa: E402

__all__ = ["LLM", "SamplingParams", "default_device", "mode"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``from paged_lib import LLM, SamplingParams`` (vLLM's names), imported on first use
    so that ``import paged_lib`` does not load the engine (nor Triton)."""
    if name == "LLM":
        from paged_lib.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from paged_lib.engine.sequence import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'paged_lib' has no attribute {name!r}")
