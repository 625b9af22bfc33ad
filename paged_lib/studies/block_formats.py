"""Two ways a kernel receives a batch of block tables, and converters between them.

A batch is, per sequence, its physical blocks and its length in tokens. Kernels want
flat integer tensors, and two layouts are in common use:

* **vLLM (padded):** ``block_tables`` int32 ``[num_seqs, max_blocks]``, row ``i``
  holding sequence ``i``'s blocks left-aligned and padding after them, plus
  ``seq_lens`` int32 ``[num_seqs]``. One row per sequence: easy to index, wastes the
  padding (the kernel never reads past ``seq_lens``, so the pad value is arbitrary).
* **FlashInfer (CSR):** ``kv_page_indices`` is every sequence's blocks concatenated,
  ``kv_indptr`` ``[num_seqs + 1]`` says where each sequence's run starts and ends, and
  ``kv_last_page_len`` ``[num_seqs]`` how many slots of its last page are filled
  (1..block_size; 0 only for a sequence with no page). No padding at all.

Both say the same thing: token ``t`` of sequence ``i`` sits at offset
``t % block_size`` of block ``block_tables[i, t // block_size]`` ==
``kv_page_indices[kv_indptr[i] + t // block_size]``.
"""

from __future__ import annotations

import torch

from paged_lib.util import cdiv


def to_padded(block_tables: list[list[int]], seq_lens: list[int], block_size: int,
              max_blocks: int | None = None, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Python lists (e.g. ``[t.blocks for t in tables]``) to vLLM's padded tensors.

    ``max_blocks`` fixes the width (vLLM uses max_model_len / block_size so the tensor
    never grows); by default it is the longest table.
    """
    _check_lists(block_tables, seq_lens, block_size)
    width = max((len(b) for b in block_tables), default=0) if max_blocks is None else max_blocks
    out = torch.full((len(block_tables), width), pad, dtype=torch.int32)
    for i, blocks in enumerate(block_tables):
        if len(blocks) > width:
            raise ValueError(f"sequence {i} has {len(blocks)} blocks, more than "
                             f"max_blocks={width}")
        out[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return out, torch.tensor(seq_lens, dtype=torch.int32)


def padded_to_csr(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(block_tables, seq_lens)`` to ``(kv_indptr, kv_page_indices, kv_last_page_len)``."""
    num_pages = cdiv(seq_lens, block_size)
    kv_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(num_pages, 0)
    used = torch.arange(block_tables.shape[1]) < num_pages[:, None]  # [num_seqs, max_blocks]
    kv_page_indices = block_tables[used].to(torch.int32)  # row by row: CSR order
    kv_last_page_len = (seq_lens - (num_pages - 1).clamp(min=0) * block_size).to(torch.int32)
    return kv_indptr, kv_page_indices, kv_last_page_len


def csr_to_padded(kv_indptr: torch.Tensor, kv_page_indices: torch.Tensor,
                  kv_last_page_len: torch.Tensor, block_size: int,
                  max_blocks: int | None = None, pad: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR triple to ``(block_tables, seq_lens)``."""
    num_pages = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int32)
    longest = int(num_pages.max()) if len(num_pages) else 0
    width = longest if max_blocks is None else max_blocks
    if longest > width:
        raise ValueError(f"a sequence has {longest} pages, more than max_blocks={width}")
    block_tables = torch.full((len(num_pages), width), pad, dtype=torch.int32)
    block_tables[torch.arange(width) < num_pages[:, None]] = kv_page_indices.to(torch.int32)
    seq_lens = ((num_pages - 1).clamp(min=0) * block_size + kv_last_page_len).to(torch.int32)
    return block_tables, seq_lens


def _check_lists(block_tables: list[list[int]], seq_lens: list[int], block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    if len(block_tables) != len(seq_lens):
        raise ValueError(f"{len(block_tables)} block tables but {len(seq_lens)} seq_lens")
    for i, (blocks, n) in enumerate(zip(block_tables, seq_lens, strict=True)):
        need = cdiv(n, block_size)
        if n < 0 or len(blocks) != need:
            raise ValueError(f"sequence {i}: {n} tokens in blocks of {block_size} need "
                             f"{need} block(s), its table has {len(blocks)}")
