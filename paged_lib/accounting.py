"""KV-cache accounting: how many bytes a model keeps per token, per request, per block.

Every layer stores, for every token it has seen, one key vector and one value vector per
*KV head*, each ``head_dim`` numbers of ``dtype_bytes`` bytes. So::

    kv_bytes_per_token = 2 (K and V) x num_layers x num_kv_heads x head_dim x dtype_bytes

Multi-head attention (MHA) has one KV head per query head; grouped-query attention (GQA)
shares each KV head among a group of query heads; multi-query attention (MQA) keeps a
single KV head. Query heads do not appear in the formula: queries are never cached.

Multi-head latent attention (MLA, DeepSeek-V2, arXiv:2405.04434 §2.1) caches neither: per
layer and token it keeps one ``kv_lora_rank``-wide latent, from which every head's K and V
are rebuilt, plus one ``qk_rope_head_dim``-wide key that carries the rotary position and
is shared by all heads::

    kv_bytes_per_token (MLA) = num_layers x (kv_lora_rank + qk_rope_head_dim) x dtype_bytes

Units: the vLLM paper's "800 KB" is 819,200 bytes, i.e. 800 KiB (1 KiB = 1024 B). This
module counts in bytes and names units explicitly (``KiB`` vs ``KB``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from paged_lib.util import cdiv

KB, MB, GB = 10**3, 10**6, 10**9  # decimal (SI) units
KiB, MiB, GiB = 2**10, 2**20, 2**30  # binary units

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True, repr=False)
class ModelSpec:
    """The architecture numbers that decide a model's KV-cache size.

    ``dtype_bytes`` is the size of one cached number (2 for fp16/bf16). ``num_params`` is
    the parameter count (for weight memory); 0 when unknown.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    num_params: int = 0
    kv_lora_rank: int = 0  # MLA: width of the cached latent (0: not MLA)
    qk_rope_head_dim: int = 0  # MLA: width of the cached RoPE key, shared by all heads

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "dtype_bytes"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelSpec {self.name!r}: {field} must be a positive "
                                 f"integer, got {value!r}")
        if not isinstance(self.num_params, int) or self.num_params < 0:
            raise ValueError(f"ModelSpec {self.name!r}: num_params must be a non-negative "
                             f"integer, got {self.num_params!r}")
        for field in ("kv_lora_rank", "qk_rope_head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelSpec {self.name!r}: {field} must be a non-negative "
                                 f"integer, got {value!r}")
        if self.qk_rope_head_dim and not self.kv_lora_rank:
            raise ValueError(f"ModelSpec {self.name!r}: qk_rope_head_dim "
                             f"({self.qk_rope_head_dim}) is an MLA field; set kv_lora_rank too")
        if self.num_kv_heads > self.num_heads:
            raise ValueError(f"ModelSpec {self.name!r}: num_kv_heads ({self.num_kv_heads}) "
                             f"cannot exceed num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelSpec {self.name!r}: num_heads ({self.num_heads}) must be "
                             f"a multiple of num_kv_heads ({self.num_kv_heads}) so every KV "
                             f"head serves the same number of query heads")

    def __repr__(self) -> str:
        """The dataclass repr, without the MLA fields when they are unset (0)."""
        shown = [f for f in fields(self)
                 if f.name not in ("kv_lora_rank", "qk_rope_head_dim") or getattr(self, f.name)]
        return (f"{type(self).__name__}("
                + ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in shown) + ")")

    @property
    def attention(self) -> str:
        """``"MHA"``, ``"GQA"``, ``"MQA"`` (how many query heads share a KV head) or
        ``"MLA"`` (a latent is cached instead of K and V)."""
        if self.kv_lora_rank:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA)."""
        return self.num_heads // self.num_kv_heads

    def with_dtype(self, dtype: str | int) -> ModelSpec:
        """The same model with its KV cache stored in another dtype (``"fp8"`` or bytes)."""
        return replace(self, dtype_bytes=_dtype_bytes(dtype))


# Published architectures (the models' config.json files). num_params is the exact count
# of the released checkpoint; tests/test_accounting.py recomputes several from their layers.
SPECS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        # OPT (Zhang et al. 2022): the vLLM paper's models. Plain MHA.
        ModelSpec("opt-6.7b", 32, 4096, 32, 32, 128, num_params=6_658_473_984),
        ModelSpec("opt-13b", 40, 5120, 40, 40, 128, num_params=12_853_473_280),
        ModelSpec("opt-66b", 64, 9216, 72, 72, 128, num_params=65_719_701_504),
        # LLaMA-2 (Touvron et al. 2023): 7B and 13B MHA, 70B GQA with 8 KV heads.
        ModelSpec("llama-2-7b", 32, 4096, 32, 32, 128, num_params=6_738_415_616),
        ModelSpec("llama-2-13b", 40, 5120, 40, 40, 128, num_params=13_015_864_320),
        ModelSpec("llama-2-70b", 80, 8192, 64, 8, 128, num_params=68_976_648_192),
        # GQA everywhere: Mistral-7B-v0.1 and Llama-3-8B / 70B.
        ModelSpec("mistral-7b", 32, 4096, 32, 8, 128, num_params=7_241_732_096),
        ModelSpec("llama-3-8b", 32, 4096, 32, 8, 128, num_params=8_030_261_248),
        ModelSpec("llama-3-70b", 80, 8192, 64, 8, 128, num_params=70_553_706_496),
        # MQA: Falcon-7B keeps one KV head for its 71 query heads.
        ModelSpec("falcon-7b", 32, 4544, 71, 1, 64, num_params=6_921_720_704),
    ]
}

# DeepSeek's models, for MLA (chapter 11), kept apart from SPECS, whose models all have
# known parameter counts. DeepSeek LLM 67B (arXiv:2401.02954) is GQA-8; DeepSeek-V2
# (arXiv:2405.04434) caches a 512-wide latent and a 64-wide RoPE key per layer. Its 128
# heads of 128 (num_kv_heads = num_heads) are what the latent is expanded into: the MHA
# the same model would otherwise cache (the paper's Table 1 uses d_h = 128 for it).
DEEPSEEK_SPECS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec("deepseek-llm-67b", 95, 8192, 64, 8, 128),
        ModelSpec("deepseek-v2", 60, 5120, 128, 128, 128, kv_lora_rank=512,
                  qk_rope_head_dim=64),
    ]
}


def _dtype_bytes(dtype: str | int) -> int:
    if isinstance(dtype, str):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
        return DTYPE_BYTES[dtype]
    if not isinstance(dtype, int) or isinstance(dtype, bool) or dtype < 1:
        raise ValueError(f"bytes per value must be a positive integer, got {dtype!r}")
    return dtype


def get_spec(model: str | ModelSpec) -> ModelSpec:
    """A spec from its name in :data:`SPECS` or :data:`DEEPSEEK_SPECS` (or the spec itself)."""
    if isinstance(model, ModelSpec):
        return model
    known = SPECS | DEEPSEEK_SPECS
    if model not in known:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(known)}")
    return known[model]


def _check_count(value: int, what: str, minimum: int = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")


def kv_bytes_per_token(spec: ModelSpec) -> int:
    """Bytes of K and V (for MLA: of the latent and the RoPE key) that one token occupies
    across all layers."""
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"expected a ModelSpec, got {type(spec).__name__}")
    if spec.kv_lora_rank:
        return spec.num_layers * (spec.kv_lora_rank + spec.qk_rope_head_dim) * spec.dtype_bytes
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * spec.dtype_bytes


def mha_equivalent(spec: ModelSpec) -> ModelSpec:
    """The same model with one KV head per query head and nothing latent: what it would
    cache as plain multi-head attention."""
    return replace(spec, name=f"{spec.name} as MHA", num_kv_heads=spec.num_heads,
                   kv_lora_rank=0, qk_rope_head_dim=0)


def gqa_groups(spec: ModelSpec) -> float:
    """How many KV heads of ``head_dim`` a GQA model would need to cache as many bytes per
    token as ``spec`` (DeepSeek-V2: 2.25)."""
    return kv_bytes_per_token(spec) / (2 * spec.num_layers * spec.head_dim * spec.dtype_bytes)


def kv_bytes(spec: ModelSpec, num_tokens: int) -> int:
    """Bytes of KV cache that ``num_tokens`` tokens of one sequence occupy."""
    _check_count(num_tokens, "num_tokens")
    return num_tokens * kv_bytes_per_token(spec)


def num_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    _check_count(num_tokens, "num_tokens")
    _check_count(block_size, "block_size", minimum=1)
    return cdiv(num_tokens, block_size)


def weight_bytes(spec: ModelSpec, dtype: str | int = "fp16") -> int:
    """Bytes the model's weights take in ``dtype`` (fp16 by default)."""
    if spec.num_params == 0:
        raise ValueError(f"ModelSpec {spec.name!r} has no num_params, so its weight "
                         f"memory is unknown")
    return spec.num_params * _dtype_bytes(dtype)


def requests_that_fit(spec: ModelSpec, gpu_bytes: int, context_len: int,
                      weight_dtype: str | int = "fp16") -> int:
    """How many ``context_len``-token requests fit in the memory left after the weights.

    An upper bound: activations, the CUDA context and allocator slack also need memory.
    0 when the weights alone do not fit.
    """
    _check_count(gpu_bytes, "gpu_bytes")
    _check_count(context_len, "context_len", minimum=1)
    free = gpu_bytes - weight_bytes(spec, weight_dtype)
    return max(0, free // kv_bytes(spec, context_len))


def format_bytes(n: int | float, binary: bool = True) -> str:
    """``n`` in the largest unit that keeps it >= 1: ``800 KiB``, ``1.56 GiB``, ``1.68 GB``.

    Below 100 of the unit, at most two decimals are shown (rounded), so read the exact
    byte count when it matters.
    """
    base, units = (1024, ["B", "KiB", "MiB", "GiB", "TiB"]) if binary \
        else (1000, ["B", "KB", "MB", "GB", "TB"])
    value, unit = float(n), units[0]
    for unit in units:
        if abs(value) < base or unit == units[-1]:
            break
        value /= base
    if unit == "B":
        return f"{int(value):,} B"
    if value < 100:  # two decimals at most, trailing zeros dropped: 1.56, 2.25, 16
        return f"{value:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{value:,.0f} {unit}"
