"""Read a Llama GGUF file (llama.cpp's format) into Hugging Face-format pieces, without
transformers: a ``config.json`` dict, a state dict with Hugging Face's parameter names,
and the tokenizer's metadata.

A GGUF holds its metadata as typed key-value pairs (``llama.block_count``,
``tokenizer.ggml.tokens``, ...) and its tensors under llama.cpp's names
(``blk.0.attn_q.weight``), most of them quantised: Q4_1 stores blocks of 32 weights as
4-bit integers with one fp16 scale and one fp16 minimum per block, Q8_0 8-bit integers
with a scale. :func:`gguf.quants.dequantize` turns each back into fp32 numbers
(``scale * q + min``): the exact values llama.cpp computes with, so the fp32 model here
*is* the quantised model, not the original bf16 one.

One conversion step is not a rename. llama.cpp's ``convert_hf_to_gguf.py`` reorders the
rows of every Q and K projection so that the two numbers a RoPE rotation pairs sit next to
each other (GPT-J's "interleaved" layout, which its kernels use). Hugging Face's Llama, and
:func:`paged_lib.model.apply_rope`, rotate the *halves* of each head instead: dimension
``i`` with ``i + head_dim/2``. :func:`unpermute_rope_rows` puts the rows back; without it
every head would rotate the wrong pairs of dimensions and the model would emit noise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

#: llama.cpp's tensor names -> Hugging Face ``LlamaForCausalLM``'s.
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass
class GGUFContents:
    """A GGUF's metadata (scalars, strings and arrays as Python values) and its reader
    (tensors are read from the memory-mapped file when asked for)."""

    path: Path
    metadata: dict
    reader: object  # gguf.GGUFReader

    @property
    def arch(self) -> str:
        return self.metadata["general.architecture"]

    def get(self, key: str, default=None):
        """``metadata[f"{arch}.{key}"]``: the architecture's own keys (``block_count``)."""
        return self.metadata.get(f"{self.arch}.{key}", default)


def read_gguf(path: str | Path) -> GGUFContents:
    """Open ``path`` (memory-mapped; tensors are not dequantised yet)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    metadata = {name: field.contents() for name, field in reader.fields.items()
                if not name.startswith("GGUF.")}
    contents = GGUFContents(Path(path), metadata, reader)
    if contents.arch != "llama":
        raise ValueError(f"{path}: only llama-architecture GGUF files are read, this one is "
                         f"{contents.arch!r}")
    return contents


def _float32_value(x: float) -> float:
    """A float stored as fp32 in the file, written back as its shortest spelling
    (``9.999999747378752e-06`` -> ``1e-05``): the same fp32 number, a readable config."""
    return float(str(np.float32(x)))


def hf_config(g: GGUFContents, name: str) -> dict:
    """The Hugging Face ``LlamaConfig`` (as ``config.json``'s dict) the file describes."""
    heads = g.get("attention.head_count")
    hidden = g.get("embedding_length")
    head_dim = g.get("rope.dimension_count") or hidden // heads
    if g.get("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{g.path}: RoPE scaling {g.get('rope.scaling.type')!r} is not "
                         "supported (TinyLlama has plain RoPE)")
    tensor_names = {t.name for t in g.reader.tensors}
    m = g.metadata
    return {
        "_name_or_path": name,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "dtype": "float32",
        "vocab_size": g.get("vocab_size") or len(m["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": g.get("feed_forward_length"),
        "num_hidden_layers": g.get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": g.get("attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": g.get("context_length"),
        "rms_norm_eps": _float32_value(g.get("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_theta": _float32_value(g.get("rope.freq_base", 10000.0)),
                            "rope_type": "default"},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": m.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": m.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": m.get("tokenizer.ggml.padding_token_id"),
    }


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of a Q or K projection's rows (``[num_heads *
    head_dim, hidden]``; ``num_heads`` is the KV head count for K).

    llama.cpp wrote, per head, the rows ``0, half, 1, half + 1, ...`` (each rotated pair
    side by side); this puts them back as ``0, 1, ..., half - 1, half, ...`` (the halves
    that Hugging Face's rotate-half RoPE pairs). The inverse of ``convert_hf_to_gguf``'s
    ``permute``: ``w.reshape(heads, 2, half, ...).swapaxes(1, 2)``.
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    if not match or match.group(2) not in LAYER_NAMES:
        raise ValueError(f"unknown tensor {gguf_name!r}: not a Llama weight this loader maps")
    return f"model.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}.weight"


def hf_state_dict(g: GGUFContents) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantised to fp32, under Hugging Face's names, Q and K
    rows in Hugging Face's order. (A tied LM head is absent, as in HF checkpoints.)"""
    from gguf import quants

    heads, kv_heads = g.get("attention.head_count"), g.get("attention.head_count_kv")
    state = {}
    for t in g.reader.tensors:
        w = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if ".attn_q." in t.name:
            w = unpermute_rope_rows(w, heads)
        elif ".attn_k." in t.name:
            w = unpermute_rope_rows(w, kv_heads or heads)
        if not w.flags.writeable:  # an fp32 tensor is a view of the memory-mapped file
            w = w.copy()
        state[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    return state
