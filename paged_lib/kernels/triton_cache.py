"""The KV write path in Triton: put each new token's key and value into its cache slot.

Before attention can read a token through the block table, its K/V must sit in the
paged cache. The engine gives every new token a *slot*::

    slot = block_tables[seq, pos // block_size] * block_size + pos % block_size

(``slot_mapping``, vLLM's name; :func:`paged_lib.kernels.slot_mapping_from_positions`),
or ``-1`` for a padding token that must not be written. The kernel scatters ``key``/``value``
``[num_tokens, num_kv_heads, head_dim]`` into ``k_cache``/``v_cache``
``[num_blocks, block_size, num_kv_heads, head_dim]``. Call it through
:func:`paged_lib.kernels.reshape_and_cache`, which validates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_lib.kernels.triton_decode import head_pad, on_device


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kct, stride_kch, stride_kcd,
    stride_vcb, stride_vct, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One program per token: copy its [num_kv_heads, head_dim] key and value."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + tok * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kct + h * stride_kch
             + d * stride_kcd, k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vct + h * stride_vch
             + d * stride_vcd, v, mask=mask)


def reshape_and_cache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Launch the write kernel on validated inputs (in place)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    with on_device(key.device):
        _reshape_and_cache_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping,
            *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
            NUM_KV_HEADS=num_kv_heads, HEADS_PAD=max(2, triton.next_power_of_2(num_kv_heads)),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad(head_dim), BLOCK_SIZE=k_cache.shape[1],
        )
