"""Every definition the fast paths are tested against, and the outside baselines.

The definitions are slow on purpose: one sequence at a time, K/V gathered through the
block table token by token, float64. If a fast kernel disagrees with one of these, the
kernel is wrong. The baselines (:func:`flex_paged_attention`, contiguous SDPA) are
somebody else's code computing the same thing: they check the definitions themselves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from paged_lib.util import cdiv


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` token slots of one sequence, in logical order.

    ``cache`` is ``[num_blocks, block_size, num_kv_heads, head_dim]``; returns
    ``[seq_len, num_kv_heads, head_dim]``. Token ``t`` lives in physical block
    ``block_table[t // block_size]`` at offset ``t % block_size``.
    """
    block_size = cache.shape[1]
    tokens = torch.arange(seq_len, device=block_table.device)
    blocks = block_table.long()[tokens // block_size]
    return cache[blocks, tokens % block_size]


def ref_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float | None = None) -> torch.Tensor:
    """Decode attention (one query token per sequence) through block tables, in float64.

    q ``[num_seqs, num_heads, head_dim]``; returns the same shape in ``q.dtype``.
    Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (GQA). A sequence
    of length 0 (a padding row of a batch) attends to nothing: its output is zeros.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for s in range(num_seqs):
        n = int(seq_lens[s])
        if n == 0:
            out[s] = 0.0
            continue
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


# ------------------------------------------------------------------ outside baselines


def contiguous_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each sequence's K/V as contiguous ``[num_kv_heads, seq_len, head_dim]`` tensors."""
    out = []
    for s, n in enumerate(seq_lens.tolist()):
        k = gather_kv(k_cache, block_tables[s], n).transpose(0, 1).contiguous()
        v = gather_kv(v_cache, block_tables[s], n).transpose(0, 1).contiguous()
        out.append((k, v))
    return out


def sdpa_per_sequence(q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]],
                      scale: float) -> torch.Tensor:
    """Contiguous attention, one SDPA call per sequence (lengths differ).

    For one query token, the ``group`` query heads that share a KV head are just
    ``group`` query rows against that head's K/V, so q is viewed as
    ``[num_kv_heads, group, head_dim]``: GQA with no copies of K/V (the fastest
    contiguous form on a CPU; ``enable_gqa=True`` is several times slower there).
    """
    outs = []
    for s, (k, v) in enumerate(kv):
        qs = q[s].view(k.shape[0], -1, q.shape[-1])
        outs.append(F.scaled_dot_product_attention(qs, k, v, scale=scale).reshape(q.shape[1:]))
    return torch.stack(outs)


def sdpa_per_sequence_gqa(q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]],
                          scale: float) -> torch.Tensor:
    """Contiguous attention the straightforward way: one SDPA call per sequence with
    ``enable_gqa=True`` (one query token of every head against the KV heads)."""
    outs = []
    for s, (k, v) in enumerate(kv):
        outs.append(F.scaled_dot_product_attention(q[s].unsqueeze(1), k, v, scale=scale,
                                                   enable_gqa=True).squeeze(1))
    return torch.stack(outs)


def matmul_per_sequence(q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]],
                        scale: float) -> torch.Tensor:
    """Contiguous attention as plain grouped matmuls, one sequence at a time.

    The leanest contiguous form on a CPU: the query heads of a KV head are rows of one
    ``[group, head_dim] @ [head_dim, seq_len]`` product per KV head (a batched matmul),
    a softmax over the row, and one more product with V. No copies of K/V, no masks.
    """
    outs = []
    for s, (k, v) in enumerate(kv):
        qs = q[s].view(k.shape[0], -1, q.shape[-1])
        p = torch.softmax(torch.bmm(qs, k.transpose(1, 2)) * scale, dim=-1)
        outs.append(torch.bmm(p, v).reshape(q.shape[1:]))
    return torch.stack(outs)


def padded_kv(kv: list[tuple[torch.Tensor, torch.Tensor]]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous K/V of every sequence in one zero-padded ``[num_seqs, num_kv_heads,
    max_len, head_dim]`` tensor each, and the key mask ``[num_seqs, 1, 1, max_len]``."""
    max_len = max(k.shape[1] for k, _ in kv)
    k0 = kv[0][0]
    k = k0.new_zeros(len(kv), k0.shape[0], max_len, k0.shape[2])
    v = torch.zeros_like(k)
    mask = torch.zeros(len(kv), 1, 1, max_len, dtype=torch.bool)
    for s, (ks, vs) in enumerate(kv):
        k[s, :, : ks.shape[1]] = ks
        v[s, :, : vs.shape[1]] = vs
        mask[s, ..., : ks.shape[1]] = True
    return k, v, mask


def sdpa_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Contiguous attention as one batched SDPA call over padded K/V (:func:`padded_kv`):
    no Python loop, but every sequence pays for the longest one."""
    num_seqs, num_kv_heads = k.shape[:2]
    qs = q.view(num_seqs, num_kv_heads, -1, q.shape[-1])
    out = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
    return out.reshape(q.shape)


def flex_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         compiled: bool = False) -> Callable[[], torch.Tensor]:
    """Prepare PyTorch FlexAttention's ``PagedAttention`` on our cache; returns a callable.

    An independent implementation of the same computation: its page table is our block
    table, its cache a ``[1, num_kv_heads, num_blocks * block_size, head_dim]`` view of ours,
    and its mask hides positions past each sequence's length. (It cannot express one
    sequence using the same physical block twice; sharing between sequences is fine.)
    """
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask

    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    device = str(q.device)
    pa = PagedAttention(num_blocks, block_size, num_seqs, device=device)
    for s, n in enumerate(seq_lens.tolist()):
        used = block_tables[s, :cdiv(n, block_size)].long()
        pa.page_table[s, :len(used)] = used
        pa.physical_to_logical[s, used] = torch.arange(len(used), device=q.device)
    kc = k_cache.permute(2, 0, 1, 3).reshape(1, num_kv_heads, num_blocks * block_size, head_dim)
    vc = v_cache.permute(2, 0, 1, 3).reshape(1, num_kv_heads, num_blocks * block_size, head_dim)
    # Eager FlexAttention (what the tests compare with) is right with any query block.
    # Compiled, on an H200 with torch 2.11 (reports/gpu-check-nvidia-h200.md), a query block
    # of 1 finds no kernel configuration (NoValidChoicesError) and 128 reads out of bounds;
    # 16 is right at batch 1 with 512 tokens, wrong at 4096 and 32768 (the bench checks
    # before it times, and says WRONG), and fails to lower at batch 8.
    logical = create_block_mask(noop_mask, num_seqs, None, 1, block_tables.shape[1] * block_size,
                                device=device, BLOCK_SIZE=(16, block_size))
    mask = pa.convert_logical_block_mask(logical, kv_len=seq_lens.long())
    fn = torch.compile(flex_attention) if compiled else flex_attention
    q4 = q.unsqueeze(2)

    def run() -> torch.Tensor:
        return fn(q4, kc, vc, block_mask=mask, scale=scale,
                  enable_gqa=num_heads != num_kv_heads).squeeze(2)

    return run
