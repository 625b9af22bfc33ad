"""TinyLlama against transformers' LlamaForCausalLM: same weights, same logits.

The model reads and writes the paged cache; here one sequence gets blocks in a shuffled
order (so a wrong block table shows) and unused cache slots hold NaN (so a read past the
end shows).
"""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import paged_lib  # noqa: F401  # isort: split
from paged_lib.accounting import kv_bytes_per_token
from paged_lib.model import (
    TINY_CODE_LLAMA_DIR,
    AttentionMetadata,
    TinyLlama,
    TinyLlamaConfig,
    load_tiny_code_llama,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_hf(tie: bool = False, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                      rope_theta=500.0, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def hf():
    return tiny_hf()


def run_paged(model: TinyLlama, ids: list[int], split: int, block_size: int = 4,
              backend: str = "torch") -> torch.Tensor:
    """Logits of every position: a prefill of ``ids[:split]``, then one decode per token."""
    cfg = model.config
    num_blocks = 2 * (len(ids) // block_size + 1)
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
              for _ in range(cfg.num_layers)]
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))
    table = table[: len(ids) // block_size + 1].to(torch.int32)
    out = []
    done = 0
    for end in [split] + list(range(split + 1, len(ids) + 1)):
        pos = torch.arange(done, end)
        slots = table.long()[pos // block_size] * block_size + pos % block_size
        meta = AttentionMetadata(slot_mapping=slots, block_tables=table[None, :],
                                 seq_lens=torch.tensor([end], dtype=torch.int32),
                                 query_lens=torch.tensor([end - done], dtype=torch.int32),
                                 positions=pos)
        hidden = model(torch.tensor(ids[done:end]), caches, meta, backend=backend)
        out.append(model.compute_logits(hidden))
        done = end
    return torch.cat(out)


@torch.no_grad()
@pytest.mark.parametrize("split", [1, 7, 13])
def test_logits_equal_transformers(hf, split):
    model = TinyLlama.from_hf(hf)
    ids = torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(split)).tolist()
    ref = hf(torch.tensor([ids])).logits[0]
    got = run_paged(model, ids, split)
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


@torch.no_grad()
def test_triton_backend_same_logits(hf):
    model = TinyLlama.from_hf(hf)
    ids = list(range(3, 12))
    ref = hf(torch.tensor([ids])).logits[0]
    got = run_paged(model, ids, split=6, backend="triton")
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


@torch.no_grad()
def test_tied_embeddings_and_safetensors_folder(tmp_path):
    hf = tiny_hf(tie=True, seed=3)
    hf.save_pretrained(tmp_path)  # writes model.safetensors without lm_head.weight
    for model in (TinyLlama.from_hf(hf), TinyLlama.from_pretrained(tmp_path)):
        assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
        ids = [5, 9, 2, 44, 17]
        assert torch.allclose(run_paged(model, ids, 3), hf(torch.tensor([ids])).logits[0],
                              atol=1e-4)


def test_config_is_a_model_spec(hf):
    cfg = TinyLlama.from_hf(hf).config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 6, 2, 8)
    assert cfg.rope_theta == 500.0
    assert kv_bytes_per_token(cfg) == 2 * 2 * 2 * 8 * 4  # K and V, fp32


def test_bad_folder_and_biases_are_refused(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        TinyLlama.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="safetensors"):
        TinyLlama.from_pretrained(tmp_path)
    d = tiny_hf().config.to_dict() | {"attention_bias": True}
    with pytest.raises(ValueError, match="bias"):
        TinyLlamaConfig.from_hf_dict(d)


@torch.no_grad()
@pytest.mark.skipif(not (TINY_CODE_LLAMA_DIR / "model.safetensors").is_file(),
                    reason="the shipped model has not been trained into the repo yet")
def test_shipped_model_loads_without_transformers_and_matches_it():
    model = load_tiny_code_llama()
    hf = LlamaForCausalLM.from_pretrained(TINY_CODE_LLAMA_DIR).float().eval()
    ids = list(b"def main():\n    ")
    got = run_paged(model, ids, split=10, block_size=16)
    assert torch.allclose(got, hf(torch.tensor([ids])).logits[0], atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_matches_hugging_face_formula(dtype):
    """fp32 takes PyTorch's fused ``F.rms_norm``, other dtypes the ops Hugging Face's
    ``LlamaRMSNorm`` uses (upcast, normalise, cast back, then scale): both must give that
    formula's values, for rows of any scale."""
    from paged_lib.model import RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    norm = norm.to(dtype)
    for scale in (1e-3, 1.0, 1e3):
        x = (torch.randn(5, 96, generator=g) * scale).to(dtype)
        xf = x.float()
        expected = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
                                  ).to(dtype)
        torch.testing.assert_close(norm(x), expected, rtol=1e-6 if dtype == torch.float32
                                   else 1e-3, atol=0)
