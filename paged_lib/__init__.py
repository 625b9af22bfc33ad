"""paged_lib: the code behind the PagedAttention course.

Three parts:

* **the system** the course builds, which runs alone: accounting, workloads, fragmentation
  (with the ``contiguous`` allocators paging is compared with), blocks, attention,
  kernels (with ``kv_quant``, the 8-bit cache format), model, models (a real pretrained
  model, SmolLM2-135M-Instruct, read from a package's GGUF file), engine, parallel
  (tensor parallelism's sharding), tokenizer, util, device, data (the shipped model and
  its held-out split); the instruments that watch it work in :mod:`paged_lib.instruments`,
  benchmarks in :mod:`paged_lib.bench`;
* **the studies**, :mod:`paged_lib.studies`: the chapters' measurements and comparisons
  (sharing's savings, block size, SGLang's radix tree against the prefix cache, quantised
  blocks, sliding windows, a CPU tier, swap against recompute), built on the system;
* **the course**, :mod:`paged_lib.course`: graders, pictures, widgets, chapter demos,
  show_source.

The system imports neither the studies nor the course, the studies never import the
course, and no modules import one another in a cycle (``tests/test_layout.py``).

Importing the package decides, before any Triton kernel is defined, whether kernels
compile for a GPU or run in Triton's CPU interpreter (see :mod:`paged_lib.device`).
"""

from paged_lib.device import configure as _configure

_configure()

from paged_lib.device import default_device, mode  # noqa: E402

__all__ = ["LLM", "BeamSearchParams", "SamplingParams", "default_device", "mode"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``from paged_lib import LLM, SamplingParams, BeamSearchParams`` (vLLM's names),
    imported on first use so that ``import paged_lib`` does not load the engine (nor
    Triton)."""
    if name == "LLM":
        from paged_lib.engine.llm import LLM

        return LLM
    if name in ("SamplingParams", "BeamSearchParams"):
        from paged_lib.engine import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(f"module 'paged_lib' has no attribute {name!r}")
