"""One tensor-parallel rank's attention (chapter 12's exercise 12.3, the library's answer):
on one rank it is the model's attention layer, summed over ranks it is too, and the
tensor-parallel runner can run it in every layer of its ranks."""

from __future__ import annotations

import pytest
import torch

from paged_lib.course.grading.ch12 import replayed, single_device, steps
from paged_lib.engine import LLMEngine, SamplingParams
from paged_lib.engine.tensor_parallel import TensorParallelRunner
from paged_lib.model import TinyLlama, TinyLlamaConfig, load_tiny_code_llama
from paged_lib.parallel import rank_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("step", [s for s in steps() if s.w.o_bias is None],
                         ids=lambda s: s.name[:40])
def test_one_rank_is_the_models_attention_layer(step):
    cfg = TinyLlamaConfig(num_layers=1, hidden_size=step.x.shape[1],
                          num_heads=step.w.num_heads, num_kv_heads=step.w.num_kv_heads,
                          head_dim=step.w.head_dim)
    attn = TinyLlama(cfg).layers[0].self_attn
    with torch.no_grad():
        for name in "qkvo":
            getattr(attn, f"{name}_proj").weight.copy_(getattr(step.w, name))
        cache = tuple(c.clone() for c in step.cache)
        want = attn(step.x, step.cos, step.sin, cache, step.meta, "torch")
    got, got_cache = single_device(step)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_cache, cache, strict=True):
        torch.testing.assert_close(a, b, equal_nan=True)


@pytest.mark.parametrize("step", steps(), ids=lambda s: s.name[:40])
def test_the_ranks_sum_to_the_one_device_layer(step):
    want, _ = single_device(step)
    for out, _ in replayed(rank_attention, step):
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def test_the_runner_serves_with_rank_attention_in_every_layer():
    model = load_tiny_code_llama()
    prompts = [[100 + i for i in range(9)], [70, 71, 72]]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    one = LLMEngine(model, 32, block_size=4)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    engine = LLMEngine(model, 32, block_size=4)
    engine.runner = TensorParallelRunner(model, 32, 4, rank_attention=rank_attention)
    try:
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    finally:
        engine.runner.close()
    assert got == want
