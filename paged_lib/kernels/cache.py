"""Slot mapping: where each new token's K/V goes in the paged cache.

``slot = block_tables[seq, pos // block_size] * block_size + pos % block_size``, or
``-1`` for a padding token. The write itself is :func:`paged_lib.kernels.reshape_and_cache`
(Triton kernel in :mod:`~paged_lib.kernels.triton_cache`, PyTorch in
:mod:`~paged_lib.kernels.torch_backend`); its names are re-exported here for chapter 05.
"""

from __future__ import annotations

import torch

from paged_lib.kernels.torch_backend import reshape_and_cache_torch  # noqa: F401
from paged_lib.kernels.triton_cache import (  # noqa: F401
    _reshape_and_cache_kernel,
    reshape_and_cache_triton,
)


def slot_mapping_from_positions(block_tables: torch.Tensor, seq_ids: torch.Tensor,
                                positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """``slot_mapping`` (int64) for tokens at ``positions`` of sequences ``seq_ids``.

    A negative position marks a padding token and maps to slot ``-1``.
    """
    seq_ids = seq_ids.long()
    positions = positions.long()
    keep = positions >= 0
    pos = positions.clamp(min=0)
    blocks = block_tables.long()[seq_ids, pos // block_size]
    slots = blocks * block_size + pos % block_size
    return torch.where(keep, slots, torch.full_like(slots, -1))
