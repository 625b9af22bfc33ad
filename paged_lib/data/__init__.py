"""Files the course ships inside the package (found without any download).

``TINY_CODE_LLAMA_DIR`` holds a small byte-level Llama trained on the Python
standard library by ``tools/train_tiny_model.py``. Load it with
``transformers.LlamaForCausalLM.from_pretrained(TINY_CODE_LLAMA_DIR)`` and
tokenize with ``paged_lib.tokenizer.ByteTokenizer``; its README says how it
was trained. This is the one place that names the folder: :mod:`paged_lib.model`,
the benchmarks and the training script all use this constant.
:mod:`paged_lib.data.held_out` is the split of its training text (the files it
never saw).
"""

from pathlib import Path

TINY_CODE_LLAMA_DIR = Path(__file__).resolve().parent / "tiny-code-llama"
