"""Every paged operation in plain PyTorch: the engine's CPU backend.

* :func:`paged_attention_torch` - decode, vectorised (below);
* :func:`merge_segments` - each sequence's segments merged by
  :func:`paged_lib.attention.merge_partials`, the log-sum-exp merge both backends use
  (the Triton backend's merge kernel is its fused GPU form, tested equal);
* :func:`paged_prefill_torch` - prefill, per sequence with causal SDPA;
* :func:`reshape_and_cache_torch` - the cache write, one indexed assignment.

Decode:

No Python loop over tokens, blocks or sequences: a fixed number of tensor ops, whatever
the batch. It is flash-decoding written with PyTorch ops:

1. **Segments.** Cut every sequence's logical blocks into segments of ``blocks_per_segment``
   blocks (a sequence of 1,000 tokens and block size 16 is 63 blocks: 8 segments of 8
   blocks, the last one 7 blocks long).
2. **Gather.** Copy each segment's physical blocks out of the cache with *one*
   ``index_select`` per cache (whole blocks: a memcpy per block) into a buffer that is
   reused from call to call. Only a sequence's last segment holds slots past its end;
   those are the only ones cleaned (set to 0), so a never-written slot (NaN) cannot
   reach the output.
3. **Attend per segment.** Every (segment, query head) gets its partial result: the
   softmax-weighted sum of its values and the log of its softmax denominator (``lse``).
   On CPU one fused kernel does this (``_scaled_dot_product_flash_attention_for_cpu``,
   the op behind ``F.scaled_dot_product_attention``, which also returns ``lse``); on other
   devices the same math is written out with ``einsum``.
4. **Merge.** Combine each sequence's segments with
   :func:`~paged_lib.attention.merge_partials`, the online-softmax merge of chapter 04
   in its log-sum-exp form.

Padding is at most one segment per sequence, not "up to the longest sequence", and the
query heads that share a KV head read it once (GQA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_lib.attention import merge_partials
from paged_lib.kernels.reference import gather_kv
from paged_lib.util import cdiv

#: Tokens per segment the backend aims for: long enough that the fused kernel runs
#: efficiently, short enough that padding the last segment costs little.
SEGMENT_TOKENS = 128


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                          *, blocks_per_segment: int | None = None,
                          fused: bool | None = None) -> torch.Tensor:
    """Decode attention through block tables; inputs already validated by the dispatcher.

    q ``[num_seqs, num_heads, head_dim]``; caches ``[num_blocks, block_size, num_kv_heads,
    head_dim]``; ``block_tables`` int ``[num_seqs, max_blocks]`` (entries past a sequence's
    last block are never read); ``seq_lens`` int ``[num_seqs]``. Returns
    ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``; computes in float32 (float64 if
    the inputs are float64). A sequence of length 0 gets zeros.

    ``blocks_per_segment`` and ``fused`` (use the fused CPU kernel) exist for tests and
    experiments; the defaults are what the engine uses.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    device = q.device
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if fused is None:  # the fused op is private to PyTorch: fall back if it ever goes
        fused = device.type == "cpu" and hasattr(
            torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    c = blocks_per_segment or max(1, SEGMENT_TOKENS // block_size)
    seg_tokens = c * block_size

    # 1. Segments: which sequence each belongs to and which physical blocks it reads.
    # Every sequence's last segment goes to the end of the list (the merge does not care
    # about order), so the only segments with slots past a sequence's end form one slice.
    seq_lens = seq_lens.to(device=device, dtype=torch.long)
    n_blocks = cdiv(seq_lens, block_size)               # [num_seqs]
    n_segs = (n_blocks + c - 1) // c
    seqs = torch.arange(num_seqs, device=device)
    has_last = n_segs > 0
    inner_seq = torch.repeat_interleave(seqs, (n_segs - 1).clamp(min=0))
    inner_start = torch.cumsum((n_segs - 1).clamp(min=0), 0) - (n_segs - 1).clamp(min=0)
    inner_idx = torch.arange(inner_seq.numel(), device=device) - inner_start[inner_seq]
    seg_seq = torch.cat([inner_seq, seqs[has_last]])
    seg_idx = torch.cat([inner_idx, (n_segs - 1)[has_last]])         # index in its sequence
    num_segs, num_last = seg_seq.numel(), int(has_last.sum())
    if num_segs == 0:                                    # no sequences, or all empty
        return torch.zeros_like(q)
    logical = seg_idx[:, None] * c + torch.arange(c, device=device)       # [num_segs, c]
    used = logical < n_blocks[seg_seq, None]
    table = block_tables.to(device=device, dtype=torch.long)
    physical = table[seg_seq[:, None], logical.clamp(max=table.shape[1] - 1)]
    # Blocks past a sequence's end: garbage ids. Read the segment's first block instead
    # (always a real block); the positions are masked below.
    physical = torch.where(used, physical, physical[:, :1])

    # 2. Gather whole blocks into [num_segs, seg_tokens, num_kv_heads, head_dim] buffers.
    flat = physical.reshape(-1)
    shape = (num_segs, seg_tokens, num_kv_heads, head_dim)
    k = _gather(k_cache, flat, shape, compute_dtype, "k")
    v = _gather(v_cache, flat, shape, compute_dtype, "v")
    pos = logical[:, :, None] * block_size + torch.arange(block_size, device=device)
    valid = pos.reshape(num_segs, seg_tokens) < seq_lens[seg_seq, None]
    # Zero the slots past each sequence's end, in place, in the last-segment slice only:
    # masking their scores is not enough, because NaN * 0 is NaN. By row index: a
    # broadcast masked_fill_ over the slice costs ~20x more on a CPU (it visits every value).
    first = num_segs - num_last
    pad = (~valid[first:]).reshape(-1).nonzero().squeeze(1) + first * seg_tokens
    k.view(num_segs * seg_tokens, -1).index_fill_(0, pad, 0.0)
    v.view(num_segs * seg_tokens, -1).index_fill_(0, pad, 0.0)

    # 3. Partial attention per segment: out [num_segs, heads, d], lse [num_segs, heads].
    bias = torch.zeros(num_segs, 1, 1, seg_tokens, dtype=compute_dtype, device=device)
    bias.masked_fill_(~valid[:, None, None, :], float("-inf"))
    qs = q.to(compute_dtype)[seg_seq]                                    # [num_segs, H, d]
    out, lse = _segment_attention(qs, k, v, bias, scale, fused)

    # 4. Merge each sequence's segments.
    return merge_segments(out, lse, seg_seq, seg_idx, num_seqs).to(q.dtype)


#: Reused gather buffers, by (name, device, dtype). A fresh 100 MB tensor per call costs
#: more than the copy itself: the OS has to map and zero its pages every time.
_WORKSPACE: dict[tuple[str, str, torch.dtype], torch.Tensor] = {}


def _buffer(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (name, str(device), dtype)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _WORKSPACE[key] = buf
    return buf[:numel]


def _gather(cache: torch.Tensor, blocks: torch.Tensor, shape: tuple[int, ...],
            dtype: torch.dtype, name: str) -> torch.Tensor:
    """``cache[blocks]`` as one memcpy per block, into a reused buffer, in ``dtype``."""
    numel = blocks.numel() * cache[0].numel()
    rows = cache.reshape(cache.shape[0], -1)
    out = _buffer(name, numel, cache.dtype, cache.device).view(blocks.numel(), -1)
    torch.index_select(rows, 0, blocks, out=out)
    if cache.dtype != dtype:
        wide = _buffer(name + "_wide", numel, dtype, cache.device)
        out = wide.view_as(out).copy_(out)
    return out.view(shape)


def _segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                       scale: float, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [n, H, d]`` over ``k, v [n, T, KVH, d]`` with additive ``bias``.

    Returns the normalised output ``[n, H, d]`` and ``lse [n, H]``, the log of each
    softmax denominator, which is what merging partial results needs.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    # GQA without copies: the `group` query heads that share a KV head become `group`
    # query rows of that head, so each KV head is read once.
    qg = q.view(n, num_kv_heads, group, head_dim)
    if fused:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qg, k.transpose(1, 2), v.transpose(1, 2), 0.0, False, attn_mask=bias,
            scale=scale)
        return out.reshape(n, num_heads, head_dim), lse.reshape(n, num_heads)
    scores = torch.einsum("nkgd,ntkd->nkgt", qg, k) * scale + bias.view(n, 1, 1, -1)
    lse = torch.logsumexp(scores, dim=-1)                      # [n, KVH, g]
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("nkgt,ntkd->nkgd", probs, v)
    return out.reshape(n, num_heads, head_dim), lse.reshape(n, num_heads)


def merge_segments(out: torch.Tensor, lse: torch.Tensor, seg_seq: torch.Tensor,
                   seg_idx: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Merge each sequence's segments: :func:`~paged_lib.attention.merge_partials` over
    a ``[max_segments, num_seqs, ...]`` stack, where segment ``i`` (of sequence
    ``seg_seq[i]``, its ``seg_idx[i]``-th) sits; missing segments are empty (``lse = -inf``),
    and a sequence with none gets zeros."""
    depth = int(seg_idx.max()) + 1 if seg_idx.numel() else 1
    parts = out.new_zeros(depth, num_seqs, *out.shape[1:])
    parts[seg_idx, seg_seq] = out
    lses = torch.full((depth, num_seqs, *lse.shape[1:]), float("-inf"), dtype=out.dtype,
                      device=out.device)
    lses[seg_idx, seg_seq] = lse.to(out.dtype)
    return merge_partials(parts, lses)


def paged_prefill_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Prefill in PyTorch: per sequence, gather its K/V and run causal SDPA (fp32)."""
    out = torch.empty_like(q)
    num_heads = q.shape[1]
    start = 0
    for s, (n, ql) in enumerate(zip(seq_lens.tolist(), query_lens.tolist(), strict=True)):
        k = gather_kv(k_cache, block_tables[s], n).float().transpose(0, 1)  # [kv_heads, n, d]
        v = gather_kv(v_cache, block_tables[s], n).float().transpose(0, 1)
        qs = q[start:start + ql].float().transpose(0, 1)  # [heads, ql, d]
        rows = torch.arange(n - ql, n, device=q.device)[:, None]  # positions of new tokens
        mask = torch.arange(n, device=q.device)[None, :] <= rows  # [ql, n]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=num_heads != k.shape[0])
        out[start:start + ql] = o.transpose(0, 1).to(q.dtype)
        start += ql
    return out


def reshape_and_cache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The cache write in PyTorch: an indexed assignment, skipping slot -1 (in place)."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep]
    v_cache[blocks, offsets] = value[keep]
