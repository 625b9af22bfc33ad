"""Swap against recompute, timed on this machine with the engine's own code (chapter 07).

The paper's §7.3 (Fig. 19) times both preemption modes on a GPU: swapping is costly at
small block sizes (each block is its own small CPU-GPU transfer over PCIe), recompute
costs the same at every block size, so recompute wins at small blocks and swap at large
ones, and recompute's overhead is never more than 20% above swap's. This module measures
the same two things here, with the code the engine really runs:

* :func:`preemption_times` (the paper's Fig. 19a, a microbenchmark): for one preempted
  request of ``num_tokens`` tokens at each block size, the wall time of

  - **swap, as the engine issues it**: its blocks out to the CPU pool and back in with
    :func:`paged_lib.kernels.cache_ops.swap_blocks` (one indexed copy per layer for K
    and for V), on caches shaped by
    :func:`paged_lib.engine.model_runner.allocate_kv_caches`;
  - **swap, one copy per block**: the same blocks moved as vLLM v0 issues a swap (one
    copy per block, per layer, for K and for V);
  - **recompute**: the engine's model prefilling the ``num_tokens`` tokens again into a
    paged cache of that block size (:func:`paged_lib.bench.swap.prefill_tokens_per_s`).

  Every copy is checked (the blocks come back equal, at other block ids) before it is
  timed.
* :func:`serve_times` (Fig. 19b, end to end): a set of requests served on a pool held
  at ``pool_tokens`` slots, once per mode and block size, wall clock (median of
  ``repeats``), with what each run moved or computed again, and its tokens checked
  against the requests served alone.

A CPU has no PCIe between the two pools: both are in the same memory, so a swap is a
``memcpy`` at memory bandwidth, and the cost of one copy is a PyTorch call, not a DMA
transfer. The chapter sets these figures beside the GPU model of
:mod:`paged_lib.studies.swap_cost`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_lib.bench.swap import prefill_tokens_per_s
from paged_lib.engine.model_runner import allocate_kv_caches
from paged_lib.kernels.cache_ops import swap_blocks
from paged_lib.studies.wall_clock import fastest_ms
from paged_lib.util import cdiv

#: The paper's Fig. 19 sweeps block sizes 1 to 256.
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class PreemptionTiming:
    """One block size: seconds to swap one request out and back in, two ways, and to
    recompute it."""

    block_size: int
    num_tokens: int
    num_blocks: int        # blocks the request holds: cdiv(num_tokens, block_size)
    num_copies: int        # copies the per-block way issues, out and in
    nbytes: int            # K/V bytes moved, out and in (whole blocks)
    swap_s: float          # the engine's swap_blocks: one indexed copy per layer and K/V
    swap_per_block_s: float  # one copy per block per layer and K/V (vLLM v0)
    recompute_s: float     # prefill of the num_tokens tokens again


def _random_caches(model, num_blocks: int, block_size: int, seed: int):
    caches = allocate_kv_caches(model, num_blocks, block_size, "cpu")
    g = torch.Generator().manual_seed(seed)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=g).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))
    return caches


def _per_block(src, dst, pairs) -> None:
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        for s, d in pairs:
            dk[d].copy_(sk[s])
            dv[d].copy_(sv[s])


def _round_trip(swap, gpu, cpu, out_pairs, in_pairs):
    def run():
        swap(gpu, cpu, out_pairs)
        swap(cpu, gpu, in_pairs)
    return run


def _check_round_trip(name: str, run, gpu, before, in_pairs, out_pairs) -> None:
    """After one round trip, block ``out[s] -> cpu -> in`` must hold what ``s`` held."""
    run()
    where = {cpu_block: gpu_block for cpu_block, gpu_block in in_pairs}
    for (k, v), (k0, v0) in zip(gpu, before, strict=True):
        for s, c in out_pairs:
            if not (torch.equal(k[where[c]], k0[s]) and torch.equal(v[where[c]], v0[s])):
                raise RuntimeError(f"{name}: block {s} did not come back equal")


def preemption_times(model, num_tokens: int = 256,
                     block_sizes: Sequence[int] = BLOCK_SIZES, repeats: int = 7,
                     recompute_repeats: int = 3, seed: int = 0) -> list[PreemptionTiming]:
    """Seconds to swap a request of ``num_tokens`` tokens out and back in, as the engine
    does and one copy per block (the fastest of ``repeats``:
    :func:`~paged_lib.studies.wall_clock.fastest_ms`), and to recompute it (the median
    of ``recompute_repeats``, as :func:`~paged_lib.bench.swap.prefill_tokens_per_s`
    measures), at each block size (see the module docstring). ``model`` is a
    ``TinyLlama``."""
    if num_tokens < 1 or repeats < 1 or recompute_repeats < 1:
        raise ValueError("num_tokens and the repeats must be at least 1")
    rows = []
    for b in block_sizes:
        n = cdiv(num_tokens, b)
        # A pool of 2n blocks: the request holds the first n and comes back to the others.
        gpu = _random_caches(model, 2 * n, b, seed)
        cpu = allocate_kv_caches(model, n, b, "cpu")
        before = [(k.clone(), v.clone()) for k, v in gpu]
        out_pairs = [(i, n - 1 - i) for i in range(n)]
        in_pairs = [(n - 1 - i, n + i) for i in range(n)]
        times = {}
        for name, swap in (("engine", swap_blocks), ("per block", _per_block)):
            run = _round_trip(swap, gpu, cpu, out_pairs, in_pairs)
            _check_round_trip(name, run, gpu, before, in_pairs, out_pairs)
            times[name] = fastest_ms(run, repeats) / 1e3
        rate = prefill_tokens_per_s(model, num_tokens=num_tokens, block_size=b,
                                    repeats=recompute_repeats, seed=seed)
        layers = len(gpu)
        nbytes = 2 * sum(k[:n].numel() * k.element_size() * 2 for k, _ in gpu)
        rows.append(PreemptionTiming(b, num_tokens, n, 2 * n * 2 * layers, nbytes,
                                     times["engine"], times["per block"],
                                     num_tokens / rate))
    return rows


@dataclass(frozen=True)
class ServeTiming:
    """One block size served in both modes: wall seconds and what was moved or redone."""

    block_size: int
    num_blocks: int
    seconds: dict           # mode -> median wall seconds of the whole run
    preemptions: dict       # mode -> preemptions
    swapped_blocks: int     # swap mode: block copies, out and in
    recomputed_tokens: int  # recompute mode: tokens prefilled again


def serve_times(model, prompts: Sequence[Sequence[int]], params, expected,
                block_sizes: Sequence[int], pool_tokens: int, num_cpu_blocks: int = 64,
                repeats: int = 3) -> list[ServeTiming]:
    """Serve ``prompts`` on ``pool_tokens // b`` blocks of ``b`` tokens in each mode,
    ``repeats`` times; the tokens must equal ``expected`` (each request's outputs served
    alone, a list of lists of token ids per request)."""
    from paged_lib.engine import LLMEngine

    rows = []
    for b in block_sizes:
        secs, preempted, stats = {}, {}, {}
        for mode in ("swap", "recompute"):
            times = []
            for _ in range(repeats):
                engine = LLMEngine(model, pool_tokens // b, b, num_cpu_blocks=num_cpu_blocks,
                                   preemption=mode, watermark=0.0)
                start = time.perf_counter()
                outs = engine.generate([list(p) for p in prompts], params)
                times.append(time.perf_counter() - start)
                got = [[c.token_ids for c in o.outputs] for o in outs]
                if got != list(expected):
                    raise RuntimeError(f"{mode}, block size {b}: tokens differ from the "
                                       "requests served alone")
            secs[mode] = statistics.median(times)
            preempted[mode] = engine.stats.preemptions
            stats[mode] = engine.stats
        rows.append(ServeTiming(b, pool_tokens // b, secs, preempted,
                                stats["swap"].swapped_blocks,
                                stats["recompute"].recomputed_tokens))
    return rows


def verdicts(rows: Sequence[PreemptionTiming]) -> dict[str, float]:
    """The paper's three statements, as numbers from :func:`preemption_times`:

    * ``per_block_small_over_large``: the per-block swap at the smallest block size over
      the largest (the paper: far above 1, many small transfers);
    * ``engine_small_over_large``: the same for the engine's indexed swap;
    * ``recompute_spread``: slowest recompute over fastest across block sizes (the
      paper: about 1, the block size does not enter);
    * ``recompute_over_swap_min`` / ``_max``: recompute's time over the engine's swap
      time, the smallest and largest across block sizes (the paper: recompute's
      overhead within 20% of swap's, i.e. comparable)."""
    if not rows:
        raise ValueError("no rows")
    by_size = sorted(rows, key=lambda r: r.block_size)
    small, large = by_size[0], by_size[-1]
    rec = [r.recompute_s for r in rows]
    ratio = [r.recompute_s / r.swap_s for r in rows]
    return {"per_block_small_over_large": small.swap_per_block_s / large.swap_per_block_s,
            "engine_small_over_large": small.swap_s / large.swap_s,
            "recompute_spread": max(rec) / min(rec),
            "recompute_over_swap_min": min(ratio),
            "recompute_over_swap_max": max(ratio)}
