"""A Llama's shape: :class:`TinyLlamaConfig`, read from a Hugging Face ``config.json``.

The model (:mod:`paged_lib.model`, which also exports this class) is built from it; as a
:class:`~paged_lib.accounting.ModelSpec` it is also what chapter 01's byte accounting reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged_lib.accounting import ModelSpec


@dataclass(frozen=True)
class TinyLlamaConfig(ModelSpec):
    """A Llama's shape. A :class:`~paged_lib.accounting.ModelSpec` (same field names), so
    chapter 01's ``kv_bytes_per_token(config)`` works on it. ``dtype_bytes`` is the bytes
    of one number of the model's dtype: a :class:`TinyLlama`'s ``config`` follows its
    weights (4 in fp32, 2 after ``.half()``), since its KV cache is kept in that dtype.
    """

    name: str = "tiny-llama"
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    dtype_bytes: int = 4
    vocab_size: int = 264
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("vocab_size", "intermediate_size", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TinyLlamaConfig: {name} must be a positive integer, "
                                 f"got {value!r}")

    @classmethod
    def from_hf_dict(cls, d: dict) -> TinyLlamaConfig:
        """Read a Hugging Face ``LlamaConfig`` (as a dict, e.g. ``config.json``)."""
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ValueError("TinyLlama has no attention/MLP biases; this config sets them")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"TinyLlama's MLP is SwiGLU (silu), got {d['hidden_act']!r}")
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or d.get("rope_scaling"):
            raise ValueError(f"only plain RoPE is supported, got {rope or d['rope_scaling']}")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        return cls(name=d.get("_name_or_path") or "tiny-llama",
                   num_layers=d["num_hidden_layers"], hidden_size=d["hidden_size"],
                   num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
                   head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                   vocab_size=d["vocab_size"], intermediate_size=d["intermediate_size"],
                   rope_theta=float(theta), rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   max_position=d.get("max_position_embeddings", 2048),
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                   bos_token_id=d.get("bos_token_id"),
                   eos_token_id=eos[0] if isinstance(eos, list) else eos)
