"""Tensor parallelism beyond attention heads (chapter 12): the vocabulary split of the
embedding and the LM head, and the MLA latent that no head split can shard.

* **Vocabulary-parallel embedding and LM head** (Megatron-LM; vLLM's
  ``VocabParallelEmbedding`` and ``ParallelLMHead`` in
  ``vllm/model_executor/layers/vocab_parallel_embedding.py``): the vocabulary, padded to
  a multiple of ``pad_to`` rows (vLLM: 64), is cut into ``tp_size`` equal ranges and each
  rank keeps its range's rows. The embedding looks up the ids in its range (the others
  give zeros) and an all-reduce sums the ranks' rows: each token's row comes from the one
  rank that has it (:func:`vocab_parallel_embedding`). The LM head gives each rank the
  logits of its range, gathered into the whole vocabulary (vLLM gathers them on one rank)
  and cut back to the real vocabulary (:func:`vocab_parallel_logits`).
* **MLA's latent is replicated** (:func:`kv_bytes_per_rank`): DeepSeek's multi-head
  latent attention caches one latent (``kv_lora_rank`` wide) and one RoPE key per token
  and layer, shared by *all* heads. A split by heads cannot shard it, so every
  tensor-parallel rank caches the whole latent: vLLM treats an MLA model as having one KV
  head (``ModelConfig.get_num_kv_heads`` returns 1 when it uses MLA). The KV per rank does
  not shrink with the number of ranks at all.

The course's own engine replicates the embedding and the LM head on every rank
(:mod:`paged_lib.parallel`): its vocabulary is 264 byte-level tokens.
"""

from __future__ import annotations

import torch

from paged_lib.accounting import ModelSpec, kv_bytes
from paged_lib.parallel import kv_bytes_per_rank as heads_kv_bytes_per_rank
from paged_lib.util import cdiv

#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: the vocabulary is padded to a multiple of it.
VOCAB_PADDING = 64
#: LLaMA-2's vocabulary (its config.json's ``vocab_size``).
LLAMA_2_VOCAB = 32_000


def padded_vocab(vocab_size: int, tp_size: int, pad_to: int = VOCAB_PADDING) -> int:
    """Rows the split vocabulary has: ``vocab_size`` padded to a multiple of ``pad_to``,
    then (if it does not divide) to a multiple of ``pad_to * tp_size``, so that every
    rank gets the same number of rows."""
    if vocab_size < 1 or tp_size < 1 or pad_to < 1:
        raise ValueError("vocab_size, tp_size and pad_to must be at least 1")
    padded = cdiv(vocab_size, pad_to) * pad_to
    if padded % tp_size:
        padded = cdiv(vocab_size, pad_to * tp_size) * pad_to * tp_size
    return padded


def vocab_range(vocab_size: int, tp_size: int, rank: int,
                pad_to: int = VOCAB_PADDING) -> range:
    """The token ids whose rows rank ``rank`` keeps (padding rows included).

    Example: 264 tokens on 2 ranks pad to 320 rows: rank 0 keeps ids 0-159, rank 1
    ids 160-319 (of which 264-319 are padding)."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank must be in 0..{tp_size - 1}, got {rank}")
    per_rank = padded_vocab(vocab_size, tp_size, pad_to) // tp_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def shard_vocab(weight: torch.Tensor, tp_size: int, rank: int,
                pad_to: int = VOCAB_PADDING) -> torch.Tensor:
    """Rank ``rank``'s rows of an embedding or LM head ``[vocab, hidden]``, padded with
    zero rows past the real vocabulary."""
    rows = vocab_range(weight.shape[0], tp_size, rank, pad_to)
    shard = weight.new_zeros(len(rows), weight.shape[1])
    real = weight[rows.start:min(rows.stop, weight.shape[0])]
    shard[:real.shape[0]] = real
    return shard


def vocab_parallel_embedding(ids: torch.Tensor, shards: list[torch.Tensor],
                             vocab_size: int, pad_to: int = VOCAB_PADDING):
    """The embedding of ``ids`` from the ranks' ``shards``: ``(summed, partials)``, each
    rank's partial its own rows for the ids in its range and zeros for the rest, summed
    as the all-reduce would."""
    partials = []
    for rank, shard in enumerate(shards):
        rows = vocab_range(vocab_size, len(shards), rank, pad_to)
        mine = (ids >= rows.start) & (ids < rows.stop)
        local = torch.where(mine, ids - rows.start, torch.zeros_like(ids))
        out = shard[local]
        out[~mine] = 0
        partials.append(out)
    return torch.stack(partials).sum(0), partials


def vocab_parallel_logits(hidden: torch.Tensor, shards: list[torch.Tensor],
                          vocab_size: int) -> torch.Tensor:
    """Logits over the whole vocabulary from the ranks' LM-head ``shards``: each rank's
    ``hidden @ shard.T`` (its range of the vocabulary), gathered side by side and cut
    back to ``vocab_size`` (the padding rows dropped)."""
    return torch.cat([hidden @ s.T for s in shards], dim=-1)[..., :vocab_size]


def vocab_bytes_per_rank(vocab_size: int, hidden_size: int, dtype_bytes: int,
                         tp_size: int, tied: bool = False, split: bool = True) -> int:
    """Bytes of the embedding and the LM head one rank holds (one matrix when ``tied``):
    split by vocabulary (``split``) or replicated."""
    rows = padded_vocab(vocab_size, tp_size) // tp_size if split else vocab_size
    return (1 if tied else 2) * rows * hidden_size * dtype_bytes


def kv_bytes_per_rank(spec: ModelSpec, tp_size: int, num_tokens: int) -> int:
    """Bytes of KV one tensor-parallel rank caches for ``num_tokens`` tokens: its KV
    heads (:func:`paged_lib.parallel.kv_bytes_per_rank`), or, for an MLA model, the
    whole latent and RoPE key, which every rank holds (vLLM: one KV head)."""
    if spec.kv_lora_rank:
        if tp_size < 1 or spec.num_heads % tp_size:
            raise ValueError(f"{spec.name}: tensor_parallel_size={tp_size} does not divide "
                             f"the {spec.num_heads} query heads")
        return kv_bytes(spec, num_tokens)
    return heads_kv_bytes_per_rank(spec, tp_size, num_tokens)


def times_from_increase(percent: float) -> float:
    """A throughput that rises by ``percent`` % is ``1 + percent / 100`` times the
    original: "a 525% increase" is 6.25x, not 5.25x."""
    return 1 + percent / 100
