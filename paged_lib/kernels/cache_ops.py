"""The engine's block moves on whole KV caches: copy-on-write inside a pool, swaps between
pools (vLLM's ``copy_blocks`` and ``swap_blocks`` cache ops).

Both take the engine's caches as they are, a list with one ``(k_cache, v_cache)`` pair
per layer, plain tensors or chapter 11's quantised blocks (their scales travel with
them), and unwrap the quantised ones once, here. The third cache op, writing new tokens'
K/V into their slots, is :func:`paged_lib.kernels.reshape_and_cache` (called per layer by
the model).
"""

from __future__ import annotations

import torch

from paged_lib.kernels.copy_blocks import copy_blocks
from paged_lib.kernels.kv_quant import copy_quantized_kv, is_quantized

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def copy_blocks_in_pool(kv_caches: KVCaches, pairs: list[tuple[int, int]],
                        backend: str = "torch") -> None:
    """Copy-on-write: block ``src`` into the fresh block ``dst``, every layer, K and V
    (with chapter 08's :func:`~paged_lib.kernels.copy_blocks.copy_blocks`, checked)."""
    if not pairs:
        return
    if is_quantized(kv_caches[0][0]):
        return copy_quantized_kv(kv_caches, kv_caches, pairs)
    copy_blocks([k for k, _ in kv_caches], [v for _, v in kv_caches], pairs, backend=backend)


def swap_blocks(src_caches: KVCaches, dst_caches: KVCaches,
                pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks ``src -> dst`` from one pool to the other, every layer (swap
    out: GPU to CPU; swap in: CPU to GPU)."""
    if not pairs:
        return
    if is_quantized(src_caches[0][0]):
        return copy_quantized_kv(src_caches, dst_caches, pairs)
    device = src_caches[0][0].device
    src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64,
                       device=dst_caches[0][0].device)
    for (sk, sv), (dk, dv) in zip(src_caches, dst_caches, strict=True):
        dk[dst] = sk[src].to(dk.device)
        dv[dst] = sv[src].to(dv.device)
