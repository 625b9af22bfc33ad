"""The tiny byte-level Llama shipped in paged_lib/data: loadable offline, small, trained.

Chapter 06 onwards generates text with it, so these tests check what a learner
would notice: it loads without a network, its files are safetensors under the
size cap, its config is the GQA Llama the engine expects, and greedy decoding
writes the same Python-looking text every time.
"""

import json
import math
import platform
import shutil
import string
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

import paged_lib
from paged_lib.data import TINY_CODE_LLAMA_DIR
from paged_lib.tokenizer import ByteTokenizer

MAX_WEIGHT_BYTES = 10_000_000
tok = ByteTokenizer()


@pytest.fixture(scope="module")
def loaded():
    """(model,): loaded once, offline, the way the course does it."""
    # One thread: this model's matrices are tiny, and on a busy 2-core machine two
    # threads spin-wait on each other (measured: 38 s instead of 1.4 s for 20 steps).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = LlamaForCausalLM.from_pretrained(TINY_CODE_LLAMA_DIR, local_files_only=True)
    yield (model.eval(),)
    torch.set_num_threads(threads)


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (read directly, no library)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_files_are_safetensors_under_the_cap_and_nothing_pickled():
    names = {p.name for p in TINY_CODE_LLAMA_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "README.md"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt"))]
    size = (TINY_CODE_LLAMA_DIR / "model.safetensors").stat().st_size
    assert size <= MAX_WEIGHT_BYTES, f"weights are {size:,} bytes"


def test_weights_are_fp32_and_lm_head_is_tied():
    header = safetensors_header(TINY_CODE_LLAMA_DIR / "model.safetensors")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    assert {v["dtype"] for v in tensors.values()} == {"F32"}
    # tie_word_embeddings: the output layer reuses the embedding, so it is not stored
    assert "model.embed_tokens.weight" in tensors and "lm_head.weight" not in tensors


def test_loads_offline_with_the_head_tied_to_the_embedding(loaded):
    (model,) = loaded
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_config_is_a_gqa_llama_matching_the_tokenizer(loaded):
    cfg = loaded[0].config
    assert cfg.model_type == "llama"
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size
    assert cfg.hidden_act == "silu"  # SwiGLU
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id) == (
        tok.vocab_size,
        tok.bos_id,
        tok.eos_id,
    )


def test_readme_states_the_parameter_count_and_bytes(loaded):
    model = loaded[0]
    readme = (TINY_CODE_LLAMA_DIR / "README.md").read_text()
    n_params = sum(p.numel() for p in model.parameters())
    size = (TINY_CODE_LLAMA_DIR / "model.safetensors").stat().st_size
    assert f"{n_params:,}" in readme
    assert f"{size:,}" in readme


def greedy_without_cache(model, ids: list[int], n: int) -> list[int]:
    """Greedy decoding by re-running the whole prefix each step (no KV cache)."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids


@pytest.fixture(scope="module")
def def_sample(loaded) -> list[int]:
    """BOS + "def " and its 80-token greedy continuation (the README's first sample)."""
    prompt = tok.encode("def ")
    with torch.no_grad():
        out = loaded[0].generate(
            torch.tensor([prompt]), max_new_tokens=80, do_sample=False, eos_token_id=None
        )
    return out[0].tolist()


def test_greedy_generation_is_deterministic_and_readable(loaded, def_sample):
    model = loaded[0]
    prompt = tok.encode("def ")
    with torch.no_grad():
        again = model.generate(
            torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None
        )
    assert again[0].tolist() == def_sample[: len(prompt) + 20]
    # the KV-cached path and the recompute-everything path pick the same tokens
    assert greedy_without_cache(model, prompt, 20) == def_sample[: len(prompt) + 20]
    text = tok.decode(def_sample[len(prompt) :])
    printable = sum(c in string.printable for c in text) / max(len(text), 1)
    assert printable >= 0.9, f"mostly unprintable continuation: {text!r}"
    assert len(set(text)) > 5, f"degenerate continuation: {text!r}"
    punctuation = set(text) & set("():=,.[]_'\"\n")
    assert len(punctuation) >= 2, f"does not look like Python: {text!r}"


def test_readme_sample_is_what_these_weights_generate(def_sample):
    readme = (TINY_CODE_LLAMA_DIR / "README.md").read_text()
    assert tok.decode(def_sample) in readme, "README samples come from other weights"


def test_predicts_unseen_python_far_better_than_chance(loaded):
    """Bits per byte on this package's own code, which the model never saw."""
    model = loaded[0]
    source = Path(paged_lib.__file__).with_name("tokenizer.py").read_bytes()
    code = source[source.index(b"class ByteTokenizer") :][:512]
    ids = torch.tensor([tok.encode_bytes(code)])
    with torch.no_grad():
        nats = model(input_ids=ids, labels=ids).loss.item()
    bpb = nats / math.log(2)
    print(f"bits per byte on paged_lib/tokenizer.py: {bpb:.2f}")
    assert bpb < 4.0, f"{bpb:.2f} bits per byte: close to chance (8.0); untrained weights?"


def test_readme_is_what_the_training_script_writes(tmp_path):
    """README.md is rendered from tools/tiny_model_README.md.in and training.json."""
    for name in ("training.json", "config.json"):
        shutil.copy(TINY_CODE_LLAMA_DIR / name, tmp_path / name)
    script = Path(__file__).resolve().parents[1] / "tools" / "train_tiny_model.py"
    subprocess.run([sys.executable, str(script), "--readme-only", "--out", str(tmp_path)],
                   check=True)
    assert (tmp_path / "README.md").read_text() == \
        (TINY_CODE_LLAMA_DIR / "README.md").read_text(), \
        "run `python tools/train_tiny_model.py --readme-only` to rewrite README.md"


def test_the_training_script_uses_the_package_split():
    """tools/train_tiny_model.py takes its split from paged_lib.data.held_out (one definition
    for training and for every measurement on held-out text)."""
    import importlib.util

    from paged_lib.data import held_out

    script = Path(__file__).resolve().parents[1] / "tools" / "train_tiny_model.py"
    spec = importlib.util.spec_from_file_location("_train_tiny_model_under_test", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    for name in ("stdlib_files", "is_held_out", "stdlib_root", "SKIP_DIRS", "HELD_OUT_RULE"):
        assert getattr(module, name) is getattr(held_out, name), name


def test_the_split_is_the_one_the_model_was_trained_on():
    """On the Python the model was trained with, the package's split gives the files and
    bytes training.json recorded for the train and held-out parts."""
    from paged_lib.data.held_out import HELD_OUT_RULE, is_held_out, stdlib_files, stdlib_root

    record = json.loads((TINY_CODE_LLAMA_DIR / "training.json").read_text())
    assert record["held_out_rule"] == HELD_OUT_RULE
    if platform.python_version() != record["python"]:
        pytest.skip(f"the model was trained on Python {record['python']}'s standard library")
    root = stdlib_root()
    counts = {"train": [0, 0], "held_out": [0, 0]}
    for path in stdlib_files():
        part = counts["held_out" if is_held_out(path.relative_to(root).as_posix()) else "train"]
        part[0] += 1
        part[1] += path.stat().st_size
    assert {k: {"files": f, "bytes": b} for k, (f, b) in counts.items()} == record["data"]
