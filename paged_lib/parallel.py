"""Tensor parallelism's arithmetic: which rank owns which heads, and the KV bytes each holds.

Megatron-style sharding of a Llama over ``tp_size`` ranks (the layout vLLM uses):

* attention is split by heads: rank ``r`` computes a contiguous run of
  ``num_heads / tp_size`` query heads and keeps the K/V of their KV heads, so its KV
  cache holds *its heads' share of every block*; ``o_proj`` takes the rank's slice of
  its input, and the ranks' partial outputs are summed (an all-reduce);
* the MLP's ``gate``/``up`` projections are split by output columns, ``down`` by its
  input rows, followed by the second all-reduce of the layer;
* embeddings, norms and the LM head are replicated here (simpler; Megatron-LM and vLLM
  split the embedding and the LM head by vocabulary: chapter 12 shows that split).

When there are fewer KV heads than ranks (``num_kv_heads < tp_size``), a KV head cannot
be split: each rank keeps one, and each KV head is *replicated* on
``tp_size / num_kv_heads`` ranks, the ones whose query heads read it (vLLM's
``QKVParallelLinear``). Then the ranks together hold more KV than one device would.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from paged_lib.accounting import ModelSpec
from paged_lib.model import TinyLlamaConfig


def tp_size_problem(num_heads: int, num_kv_heads: int, tp_size) -> str | None:
    """Why ``tp_size`` cannot shard these heads, or ``None`` when it can."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        return f"tensor_parallel_size must be an integer >= 1, got {tp_size!r}"
    if num_heads % tp_size:
        return (f"tensor_parallel_size={tp_size} does not divide the {num_heads} query "
                "heads")
    if tp_size <= num_kv_heads and num_kv_heads % tp_size:
        return (f"tensor_parallel_size={tp_size} does not divide the {num_kv_heads} KV "
                "heads")
    if tp_size > num_kv_heads and tp_size % num_kv_heads:
        return (f"tensor_parallel_size={tp_size} is not a multiple of the {num_kv_heads} KV "
                "heads, so they cannot be replicated evenly")
    return None


def check_tp_size(spec: ModelSpec, tp_size: int) -> None:
    """Raise ``ValueError`` naming the problem when ``tp_size`` cannot shard ``spec``."""
    if problem := tp_size_problem(spec.num_heads, spec.num_kv_heads, tp_size):
        raise ValueError(f"{spec.name}: {problem}")


def kv_head_replicas(num_kv_heads: int, tp_size: int) -> int:
    """On how many ranks each KV head lives: 1, or ``tp_size / num_kv_heads`` when
    there are fewer KV heads than ranks."""
    return max(1, tp_size // num_kv_heads)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank caches: ``num_kv_heads / tp_size``, at least 1."""
    return max(1, num_kv_heads // tp_size)


def rank_heads(num_heads: int, num_kv_heads: int, tp_size: int,
               rank: int) -> tuple[list[int], list[int]]:
    """The query heads and the KV heads rank ``rank`` of ``tp_size`` owns (global ids).

    Example: 8 query heads, 2 KV heads, 4 ranks: rank 1 owns query heads ``[2, 3]`` and
    KV head ``[0]`` (a replica: rank 0 keeps it too), rank 2 owns ``[4, 5]`` and ``[1]``.
    """
    if problem := tp_size_problem(num_heads, num_kv_heads, tp_size):
        raise ValueError(problem)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp_size:
        raise ValueError(f"rank must be an integer in 0..{tp_size - 1}, got {rank!r}")
    per_rank = num_heads // tp_size
    kv_per_rank = kv_heads_per_rank(num_kv_heads, tp_size)
    first_kv = rank // kv_head_replicas(num_kv_heads, tp_size) * kv_per_rank
    return (list(range(rank * per_rank, (rank + 1) * per_rank)),
            list(range(first_kv, first_kv + kv_per_rank)))


def kv_bytes_per_rank(spec: ModelSpec, tp_size: int, num_tokens: int) -> int:
    """Bytes of K and V one rank caches for ``num_tokens`` tokens (every rank holds the
    same amount): its KV heads, all layers.

    Example: LLaMA-2-70B (8 KV heads, 80 layers, head_dim 128, fp16) at ``tp_size=8``
    holds 1 KV head per rank, 2 x 80 x 128 x 2 = 40 KiB per token; at ``tp_size=16``
    still 40 KiB (each KV head lives on two ranks).
    """
    check_tp_size(spec, tp_size)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
    heads = kv_heads_per_rank(spec.num_kv_heads, tp_size)
    return 2 * spec.num_layers * heads * spec.head_dim * spec.dtype_bytes * num_tokens


def shard_config(cfg: TinyLlamaConfig, tp_size: int) -> TinyLlamaConfig:
    """The shape of one rank's part of the model: its query heads, its KV heads, its
    slice of the MLP; hidden size and vocabulary unchanged."""
    check_tp_size(cfg, tp_size)
    if cfg.intermediate_size % tp_size:
        raise ValueError(f"{cfg.name}: tensor_parallel_size={tp_size} does not divide the "
                         f"MLP's intermediate_size {cfg.intermediate_size}")
    return replace(cfg, num_heads=cfg.num_heads // tp_size,
                   num_kv_heads=kv_heads_per_rank(cfg.num_kv_heads, tp_size),
                   intermediate_size=cfg.intermediate_size // tp_size)


def shard_state_dict(state: dict[str, torch.Tensor], cfg: TinyLlamaConfig, tp_size: int,
                     rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s weights (copies) from a full :class:`~paged_lib.model.TinyLlama`
    state dict; they load into ``TinyLlama(shard_config(cfg, tp_size))``."""
    shard_config(cfg, tp_size)
    q_heads, kv_heads = rank_heads(cfg.num_heads, cfg.num_kv_heads, tp_size, rank)
    d, inter = cfg.head_dim, cfg.intermediate_size // tp_size
    q_rows = slice(q_heads[0] * d, (q_heads[-1] + 1) * d)
    kv_rows = slice(kv_heads[0] * d, (kv_heads[-1] + 1) * d)
    mlp_rows = slice(rank * inter, (rank + 1) * inter)
    by_rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows,
               "gate_proj": mlp_rows, "up_proj": mlp_rows}  # column-parallel: output
    by_cols = {"o_proj": q_rows, "down_proj": mlp_rows}     # row-parallel: input
    out = {}
    for name, w in state.items():
        proj = name.split(".")[-2] if name.count(".") >= 2 else ""
        if proj in by_rows:
            w = w[by_rows[proj]]
        elif proj in by_cols:
            w = w[:, by_cols[proj]]
        out[name] = w.detach().to("cpu", copy=True).contiguous()
    return out


# ------------------------------------------------------------------ one rank's attention


@dataclass(frozen=True)
class AttentionWeights:
    """One attention layer's weights, whole (every head), as one device would hold them.

    ``q`` ``[num_heads * head_dim, hidden]``, ``k`` and ``v`` ``[num_kv_heads * head_dim,
    hidden]``, ``o`` ``[hidden, num_heads * head_dim]`` (``nn.Linear`` layout: ``y = x @ W.T
    + b``); biases ``None`` (Llama) or vectors of the matching output size (Qwen2 has
    them on ``q``, ``k``, ``v``; some models on ``o``).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None

    @classmethod
    def of(cls, attn) -> AttentionWeights:
        """The weights of a :class:`paged_lib.model.Attention` (no biases: Llama)."""
        cfg = attn.cfg
        return cls(attn.q_proj.weight.detach(), attn.k_proj.weight.detach(),
                   attn.v_proj.weight.detach(), attn.o_proj.weight.detach(), cfg.num_heads,
                   cfg.num_kv_heads, cfg.head_dim)


def rank_attention(x: torch.Tensor, w: AttentionWeights, cos: torch.Tensor,
                   sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta,
                   rank: int, tp_size: int, all_reduce) -> torch.Tensor:
    """Rank ``rank``'s share of one attention layer, summed over the ranks: ``[num_tokens,
    hidden]``, the same on every rank (Megatron's split, as vLLM's ``QKVParallelLinear`` and
    ``RowParallelLinear``).

    The rank projects ``x`` on its query heads' and KV heads' rows of ``q``/``k``/``v`` (and
    their biases), rotates, writes its KV heads into its own cache ``kv_cache`` (``[blocks,
    block_size, its KV heads, head_dim]``) at ``meta.slot_mapping``, attends over its blocks
    (:func:`paged_lib.kernels.paged_prefill`, which serves decode rows too), multiplies by
    its heads' columns of ``o``, and ``all_reduce`` (an in-place sum over the ranks) adds
    the partial outputs. ``o``'s bias is added once, after the sum.
    """
    q_heads, kv_heads = rank_heads(w.num_heads, w.num_kv_heads, tp_size, rank)
    return heads_attention(x, w, cos, sin, kv_cache, meta, q_heads, kv_heads, all_reduce)


def heads_attention(x: torch.Tensor, w: AttentionWeights, cos: torch.Tensor,
                    sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta,
                    q_heads: list[int], kv_heads: list[int], all_reduce) -> torch.Tensor:
    """:func:`rank_attention` for given contiguous runs of query and KV heads."""
    from paged_lib.kernels import paged_prefill, reshape_and_cache
    from paged_lib.model import apply_rope

    d, n = w.head_dim, x.shape[0]
    qs = slice(q_heads[0] * d, (q_heads[-1] + 1) * d)
    ks = slice(kv_heads[0] * d, (kv_heads[-1] + 1) * d)

    def project(weight, bias, rows, heads):
        y = x @ weight[rows].T
        return (y if bias is None else y + bias[rows]).view(n, heads, d)

    q = apply_rope(project(w.q, w.q_bias, qs, len(q_heads)), cos, sin)
    k = apply_rope(project(w.k, w.k_bias, ks, len(kv_heads)), cos, sin)
    v = project(w.v, w.v_bias, ks, len(kv_heads))
    k_cache, v_cache = kv_cache
    reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, backend="torch")
    out = paged_prefill(q.contiguous(), k_cache, v_cache, meta.block_tables, meta.seq_lens,
                        meta.query_lens, backend="torch")
    partial = out.reshape(n, len(q_heads) * d) @ w.o[:, qs].T
    all_reduce(partial)
    return partial if w.o_bias is None else partial + w.o_bias
