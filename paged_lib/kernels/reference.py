"""Deliberately naive attention references that the fast paths are tested against.

Slow on purpose: one sequence at a time, gather K/V through the block table token by
token, compute in float64. If a fast kernel disagrees with this, the kernel is wrong.
"""

from __future__ import annotations

import torch


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` token slots of one sequence, in logical order.

    ``cache`` is ``[num_blocks, block_size, num_kv_heads, head_dim]``; returns
    ``[seq_len, num_kv_heads, head_dim]``. Token ``t`` lives in physical block
    ``block_table[t // block_size]`` at offset ``t % block_size``.
    """
    block_size = cache.shape[1]
    tokens = torch.arange(seq_len)
    blocks = block_table.long()[tokens // block_size]
    return cache[blocks, tokens % block_size]


def ref_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float | None = None) -> torch.Tensor:
    """Decode attention (one query token per sequence) through block tables, in float64.

    q ``[num_seqs, num_heads, head_dim]``; returns the same shape in ``q.dtype``.
    Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (GQA).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for s in range(num_seqs):
        n = int(seq_lens[s])
        k = gather_kv(k_cache, block_tables[s], n).double()  # [n, kv_heads, d]
        v = gather_kv(v_cache, block_tables[s], n).double()
        k = k.repeat_interleave(group, dim=1)  # [n, heads, d]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[s].double(), k) * scale
        probs = torch.softmax(scores, dim=-1)
        out[s] = torch.einsum("hn,nhd->hd", probs, v)
    return out.to(q.dtype)


def ref_paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The definition, in float64: new token ``i`` of a sequence with context ``c`` is a
    decode query over the first ``c + i + 1`` tokens of the same block table."""
    out = torch.empty_like(q)
    row = 0
    for s, (n, ql) in enumerate(zip(seq_lens.tolist(), query_lens.tolist(), strict=True)):
        for i in range(ql):
            visible = torch.tensor([n - ql + i + 1], dtype=torch.int32)
            out[row] = ref_paged_attention(q[row:row + 1], k_cache, v_cache,
                                           block_tables[s:s + 1], visible, scale)[0]
            row += 1
    return out
