"""What moving blocks between two KV pools costs: one copy per block, or one indexed copy.

A swap moves whole blocks of every layer's K and V cache (``[num_blocks, block_size,
num_kv_heads, head_dim]`` each) from one pool to the other. Two ways to issue it:

* **separate**: one copy per block, per layer, for K and for V (``num_blocks * 2 *
  num_layers`` copies), as vLLM v0's ``swap_blocks`` does with one ``cudaMemcpyAsync``
  per block;
* **batched**: one indexed copy per layer for K and for V (``dst[idx_dst] =
  src[idx_src]``), as this course's engine does (``paged_lib.engine.model_runner``).

:func:`block_copy_times` times both for several block sizes and block counts (medians)
on the model's cache shape, after checking that each one copied the right blocks;
:func:`paged_lib.studies.swap_cost.fit_link` then fits the per-copy overhead to the separate
copies. Wall-clock numbers depend on the machine (and here on the CPU, not PCIe).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_lib.bench.checks import measure
from paged_lib.bench.timing import median_ms


@dataclass(frozen=True)
class CopyTiming:
    """One measurement: ``num_blocks`` blocks of ``block_size`` tokens, every layer."""

    block_size: int
    num_blocks: int
    num_copies: int        # separate copies issued (blocks x layers x 2)
    nbytes: int            # bytes moved
    separate_s: float      # median seconds, one copy per block per layer per K/V
    batched_s: float       # median seconds, one indexed copy per layer per K/V


def _pools(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
           head_dim: int, dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    src = [torch.randn(shape, generator=g, dtype=torch.float32).to(dtype).to(device)
           for _ in range(2 * num_layers)]
    dst = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * num_layers)]
    return src, dst


def block_copy_times(num_layers: int, num_kv_heads: int, head_dim: int,
                     block_sizes: Sequence[int] = (1, 4, 16, 64, 256),
                     block_counts: Sequence[int] = (1, 8, 32),
                     dtype: torch.dtype = torch.float32, device: str = "cpu",
                     repeats: int = 5, seed: int = 0) -> list[CopyTiming]:
    """Median times of moving ``n`` blocks as separate copies and as indexed copies.

    Blocks go to the destination pool in reverse order (a mapping, not a plain slice);
    before it is timed, each way's result is checked against ``src[reversed]``.
    """
    out = []
    for block_size in block_sizes:
        for n in block_counts:
            src, dst = _pools(num_layers, n, block_size, num_kv_heads, head_dim, dtype,
                              device, seed)
            pairs = [(i, n - 1 - i) for i in range(n)]
            src_idx = torch.tensor([s for s, _ in pairs], device=device)
            dst_idx = torch.tensor([d for _, d in pairs], device=device)
            want = src[-1].flip(0)

            def separate(src=src, dst=dst, pairs=pairs):
                for s, d in zip(src, dst, strict=True):
                    for i, j in pairs:
                        d[j].copy_(s[i])
                return dst[-1]

            def batched(src=src, dst=dst, src_idx=src_idx, dst_idx=dst_idx):
                for s, d in zip(src, dst, strict=True):
                    d[dst_idx] = s[src_idx]
                return dst[-1]

            def timer(fn):
                if device != "cpu":
                    def fn_sync(fn=fn):
                        fn()
                        torch.cuda.synchronize()
                    return median_ms(fn_sync, repeats) / 1e3
                return median_ms(fn, repeats) / 1e3

            t_sep = measure(f"separate copies, block {block_size} x {n}", separate, want,
                            timer)
            for d in dst:
                d.zero_()
            t_bat = measure(f"indexed copy, block {block_size} x {n}", batched, want, timer)
            nbytes = sum(t.numel() * t.element_size() for t in src)
            out.append(CopyTiming(block_size, n, n * 2 * num_layers, nbytes, t_sep, t_bat))
    return out


def prefill_tokens_per_s(model, num_tokens: int = 256, block_size: int = 16,
                         repeats: int = 3, seed: int = 0) -> float:
    """Measured prefill rate of ``model`` (a ``TinyLlama``): one sequence of
    ``num_tokens`` random tokens through every layer into a fresh paged cache, median
    of ``repeats``. This is what a recompute preemption runs again."""
    from paged_lib.engine.model_runner import allocate_kv_caches, build_metadata
    from paged_lib.util import cdiv

    blocks = cdiv(num_tokens, block_size)
    caches = allocate_kv_caches(model, blocks, block_size, model.device)
    meta = build_metadata([list(range(blocks))], [num_tokens], [num_tokens], block_size)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), generator=g)

    def prefill():
        with torch.no_grad():
            return model.compute_logits(model.forward(ids, caches, meta)[-1:])

    return num_tokens / (median_ms(prefill, repeats) / 1e3)
