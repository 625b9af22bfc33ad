"""Test batches for the paged kernels: one builder for tests, graders, benchmark and notebook.

A kernel test is only as strict as its input. The builder makes a batch in which every
mistake a paged kernel can make shows up in its output:

* every cache slot that no sequence may read is **NaN** (slots past a sequence's end in
  its last block, blocks no table uses): a kernel that reads one returns NaN;
* block-table entries past a sequence's last block are **padding** that points at no
  allocated block (``-1`` by default, as the engine pads): a kernel that follows one
  reads out of bounds or crashes;
* with ``shared=True`` physical blocks repeat, within and across sequences (sequence 1
  shares sequence 0's first block, like a shared prefix), so a kernel that assumes
  "block ``i`` of sequence ``s`` is block ``s * max_blocks + i``" is wrong.

Example::

    >>> import paged_lib
    >>> from paged_lib.kernels import paged_attention
    >>> from paged_lib.kernels.cases import make_decode_case
    >>> case = make_decode_case([1, 17, 40], num_heads=4, num_kv_heads=2, head_dim=64,
    ...                         block_size=16)
    >>> paged_attention(*case).shape            # q, k_cache, ..., seq_lens, scale
    torch.Size([3, 4, 64])
    >>> case.block_tables[0].tolist()[1:]       # sequence 0 uses one block; the rest is padding
    [-1, -1, -1]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from paged_lib.util import cdiv

#: ``pad=NAN_BLOCK``: padding entries point at a real, all-NaN block that no sequence
#: uses, so a kernel that follows them reads NaN instead of crashing (graders use it:
#: a learner's out-of-bounds read should be a message, not a dead kernel).
NAN_BLOCK = "nan_block"


class DecodeCase(NamedTuple):
    """A decode batch; unpacks into ``paged_attention(*case)`` and ``ref_paged_attention``."""

    q: torch.Tensor             # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor       # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor      # int32 [num_seqs]
    scale: float

    def to(self, device: str | torch.device) -> DecodeCase:
        """The same case with every tensor on ``device`` (the reference runs on the CPU)."""
        return DecodeCase(*(t.to(device) for t in self[:5]), self.scale)


class PrefillCase(NamedTuple):
    """A packed prefill batch; unpacks into ``paged_prefill(*case)``."""

    q: torch.Tensor             # [sum(query_lens), num_heads, head_dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor      # int32 [num_seqs], context + new tokens
    query_lens: torch.Tensor    # int32 [num_seqs]
    scale: float

    def to(self, device: str | torch.device) -> PrefillCase:
        return PrefillCase(*(t.to(device) for t in self[:6]), self.scale)


def make_block_tables(seq_lens: Sequence[int], block_size: int, num_blocks: int | None = None,
                      *, shared: bool = True, pad: int | str = -1,
                      seed: int = 0) -> tuple[torch.Tensor, int]:
    """Random int32 block tables for ``seq_lens`` and the cache size they need.

    ``shared=True`` draws blocks with replacement (repeats within and across sequences);
    ``shared=False`` hands out distinct blocks from a shuffled free list. Tables have one
    padding column more than the longest sequence needs. Returns ``(tables, num_blocks)``.
    """
    lens = [int(n) for n in seq_lens]
    if any(n < 0 for n in lens):
        raise ValueError(f"seq_lens must be >= 0, got {lens}")
    used = torch.tensor([cdiv(n, block_size) for n in lens], dtype=torch.long)
    num_seqs, needed = len(lens), int(used.sum())
    first = 1 if pad == NAN_BLOCK else 0  # block 0 is the NaN padding block
    if num_blocks is None:
        num_blocks = first + needed + 2  # two blocks nobody reads
    if not isinstance(pad, int) and pad != NAN_BLOCK:
        raise ValueError(f"pad must be an int or {NAN_BLOCK!r}, got {pad!r}")
    if not shared and num_blocks - first < needed:
        raise ValueError(f"{needed} distinct blocks needed but num_blocks is {num_blocks}")
    g = torch.Generator().manual_seed(seed)
    max_blocks = int(used.max()) + 1 if num_seqs else 1
    if shared:
        tables = torch.randint(first, num_blocks, (num_seqs, max_blocks), generator=g)
        if num_seqs > 1 and used[0] > 0 and used[1] > 0:
            tables[1, 0] = tables[0, 0]  # a shared prefix block
    else:
        free = torch.randperm(num_blocks - first, generator=g)[:needed] + first
        tables = torch.zeros(num_seqs, max_blocks, dtype=torch.long)
        cols = torch.arange(max_blocks)[None, :] < used[:, None]
        tables[cols] = free  # row-major: each sequence takes the next used[s] blocks
    padding = torch.arange(max_blocks)[None, :] >= used[:, None]
    tables[padding] = 0 if pad == NAN_BLOCK else int(pad)
    return tables.to(torch.int32), num_blocks


def read_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int,
               block_size: int) -> torch.Tensor:
    """Bool ``[num_blocks, block_size]``: the slots some sequence's first tokens occupy."""
    lens = seq_lens.long().cpu()
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(int(lens.sum())) - starts[seq]
    blocks = block_tables.cpu().long()[seq, pos // block_size]
    read = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    read[blocks * block_size + pos % block_size] = True
    return read.view(num_blocks, block_size)


def make_decode_case(seq_lens: Sequence[int], num_heads: int = 4, num_kv_heads: int = 2,
                     head_dim: int = 64, block_size: int = 16,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     seed: int = 0, *, shared: bool = True, poison: bool = True,
                     pad: int | str = -1, num_blocks: int | None = None) -> DecodeCase:
    """A seeded decode batch on a NaN-poisoned paged cache (see the module docstring).

    ``seq_lens`` may hold 0 (an empty, padding sequence). ``num_blocks`` makes the cache
    larger than the batch needs (e.g. more than 2**31 elements, to test 64-bit offsets;
    then use ``shared=False`` so blocks spread over the whole cache). ``poison=False``
    leaves unread slots random (for implementations that compute on every slot and mask
    afterwards, like eager FlexAttention). Random values are drawn on ``device``.
    """
    tables, num_blocks = make_block_tables(seq_lens, block_size, num_blocks, shared=shared,
                                           pad=pad, seed=seed)
    lens = torch.tensor([int(n) for n in seq_lens], dtype=torch.int32)
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, dtype=dtype, device=device)
    v_cache = torch.randn(shape, generator=gen, dtype=dtype, device=device)
    if poison:
        unread = ~read_slots(tables, lens, num_blocks, block_size).to(device)[..., None, None]
        k_cache.masked_fill_(unread, float("nan"))
        v_cache.masked_fill_(unread, float("nan"))
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen, dtype=dtype, device=device)
    return DecodeCase(q, k_cache, v_cache, tables.to(device), lens.to(device), head_dim ** -0.5)


def make_prefill_case(contexts: Sequence[int], query_lens: Sequence[int], num_heads: int = 4,
                      num_kv_heads: int = 2, head_dim: int = 64, block_size: int = 16,
                      dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                      seed: int = 0, **kwargs) -> PrefillCase:
    """Sequences with ``contexts[s]`` cached tokens and ``query_lens[s]`` new ones.

    The new tokens' K/V are already in the cache (as after ``reshape_and_cache``);
    ``q`` packs every sequence's new tokens back to back. ``kwargs`` go to
    :func:`make_decode_case` (``shared``, ``poison``, ``pad``, ``num_blocks``).
    """
    if len(contexts) != len(query_lens):
        raise ValueError(f"{len(contexts)} contexts but {len(query_lens)} query_lens")
    seq_lens = [int(c) + int(n) for c, n in zip(contexts, query_lens, strict=True)]
    case = make_decode_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                            device, seed, **kwargs)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen, dtype=dtype,
                    device=device)
    ql = torch.tensor([int(n) for n in query_lens], dtype=torch.int32, device=device)
    return PrefillCase(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, ql,
                       case.scale)
