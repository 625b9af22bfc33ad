"""Block size: what it costs in memory, in the engine and in the kernel (the paper's §7.2).

A block of ``B`` tokens is the unit of allocation. Small blocks waste little memory (only
the last block of a sequence is part empty: at most ``B - 1`` slots), large blocks give the
kernel and the block manager fewer, bigger pieces. Three measures, each from the code that
really runs:

* **memory**: :func:`memory_sweep` serves a trace with chapter 02's simulator
  (:func:`paged_lib.fragmentation.simulate_timeline`, policy ``"paged"``) on a fixed KV
  budget and reports the time-averaged shares of the pool and how many requests ran at
  once. The engine holds exactly what the simulator predicts (:mod:`paged_lib.engine.trace`);
  :func:`engine_vs_simulator` serves a trace with the real :class:`~paged_lib.engine.LLMEngine`
  and returns both sides.
* **kernel**: :func:`decode_cost` counts, from the decode kernel's launch and loop
  structure (:mod:`paged_lib.kernels.triton_decode`), what one decode step does for given
  sequence lengths; :func:`traced_decode_cost` counts the same things from a real run in
  Triton's interpreter (:func:`paged_lib.instruments.load_trace.trace_loads`).
* **prefix caching** (chapter 10): only full blocks can be shared, so a shared prefix of
  ``L`` tokens is reusable in ``L // B`` blocks (:func:`prefix_reuse`).

:func:`internal_waste` (the empty share of the blocks a set of sequences holds) and
:func:`choose_block_size` (the largest block a kernel accepts within a waste budget) are
chapter 09's exercises.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from paged_lib.fragmentation import simulate_timeline
from paged_lib.studies.wall_clock import fastest_ms
from paged_lib.util import cdiv
from paged_lib.workloads import Request

#: The paper's Fig. 18b sweeps block sizes 1 to 256.
BLOCK_SIZES = tuple(2**k for k in range(9))
#: Further, to pages of thousands of tokens.
LONG_BLOCK_SIZES = tuple(2**k for k in range(13))

#: Block sizes real kernels accept (each checked in its source; chapter 09 cites them).
#: vLLM's CUDA paged-attention kernels compile 8, 16 and 32 only; FlashAttention's paged
#: KV needs a multiple of 256 (nano-vllm's default block is 256); FlashMLA pages are 64.
KERNEL_BLOCK_SIZES: dict[str, tuple[int, ...]] = {
    "vLLM CUDA kernel": (8, 16, 32),
    "FlashAttention paged KV": (256, 512, 1024, 2048, 4096),
    "FlashMLA": (64,),
}


def _check_lengths(lengths: Sequence[int], block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) \
            or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if len(lengths) == 0:
        raise ValueError("no sequence lengths given")
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"length {i} must be a positive integer, got {n!r}")


def internal_waste(lengths: Sequence[int], block_size: int) -> float:
    """Share of the slots held by sequences of ``lengths`` tokens that hold no token.

    Each sequence holds ``ceil(n / block_size)`` whole blocks; the share is over all slots
    of all sequences (a long sequence weighs more than a short one). Example: lengths
    ``[5, 16]`` at block size 8 hold 8 + 16 slots for 21 tokens: ``3 / 24 = 0.125``.
    """
    _check_lengths(lengths, block_size)
    n = np.asarray(lengths, dtype=np.int64)
    held = int((cdiv(n, block_size) * block_size).sum())
    return (held - int(n.sum())) / held


def choose_block_size(lengths: Sequence[int], allowed: Sequence[int],
                      max_waste: float) -> int:
    """The largest block size in ``allowed`` whose :func:`internal_waste` on ``lengths`` is
    at most ``max_waste``; if none is, the allowed size that wastes least (the smaller on a
    tie)."""
    if len(allowed) == 0:
        raise ValueError("allowed holds no block size")
    if not 0 <= max_waste < 1:
        raise ValueError(f"max_waste must be in [0, 1), got {max_waste!r}")
    waste = {int(b): internal_waste(lengths, b) for b in allowed}
    fits = [b for b, w in waste.items() if w <= max_waste]
    if fits:
        return max(fits)
    return min(waste, key=lambda b: (waste[b], b))


def prefix_reuse(prefix_len: int, block_size: int) -> int:
    """Tokens of a shared prefix that prefix caching can reuse: only full blocks are
    cached, so ``prefix_len // block_size`` blocks of ``block_size``."""
    _check_lengths([prefix_len], block_size)
    return prefix_len // block_size * block_size


# ------------------------------------------------------------------------------- memory


class MemoryRow(NamedTuple):
    """One block size served by the simulator: shares of the KV memory held (as in
    chapter 02), steps to drain the trace, and requests running per step."""

    block_size: int
    token_states: float
    reserved: float
    internal: float
    external: float
    steps: int
    peak_running: int
    mean_running: float
    preemptions: int


def running_per_step(timeline) -> np.ndarray:
    """Requests running at each step of a ``record=True``
    :class:`~paged_lib.fragmentation.Timeline`."""
    delta = np.zeros(timeline.num_steps + 1, dtype=np.int64)
    for run in timeline.runs:
        delta[run.start] += 1
        delta[run.end] -= 1
    return np.cumsum(delta)[:-1]


def memory_sweep(requests: Sequence[Request], capacity_tokens: int,
                 block_sizes: Sequence[int] = BLOCK_SIZES,
                 max_len: int = 2048) -> list[MemoryRow]:
    """Serve ``requests`` from a pool of ``capacity_tokens`` slots at each block size."""
    rows = []
    for b in block_sizes:
        tl = simulate_timeline(requests, "paged", capacity_tokens, b, max_len, record=True)
        running = running_per_step(tl)
        busy = running[running > 0]
        rows.append(MemoryRow(b, *tl.breakdown, tl.num_steps, int(running.max()),
                              float(busy.mean()), tl.preemptions))
    return rows


def best_range(rows: Sequence[MemoryRow], tolerance: float = 0.10,
               smallest_tile: int = 16) -> tuple[int, int]:
    """(smallest, largest) block size that drains the trace within ``tolerance`` of the
    fewest steps and holds at least ``smallest_tile`` tokens, so the smallest tile a GPU
    kernel may use (``tl.dot`` needs 16 on NVIDIA) reads from one block, not several."""
    if not rows:
        raise ValueError("no rows")
    fewest = min(r.steps for r in rows)
    good = [r.block_size for r in rows
            if r.steps <= (1 + tolerance) * fewest and r.block_size >= smallest_tile]
    if not good:
        raise ValueError(f"no block size of at least {smallest_tile} tokens is within "
                         f"{tolerance:.0%} of the fewest steps")
    return min(good), max(good)


def engine_vs_simulator(model, requests: Sequence[Request], block_size: int,
                        num_blocks: int) -> dict[str, tuple]:
    """Serve ``requests`` with the real engine and with the simulator; ``(engine, simulator)``
    pairs of steps, peak running sequences, preemptions, and whether the blocks in use and
    the sequences running agree at every step.

    The engine admits like the simulator (recompute, no watermark, no per-step limits);
    the simulator sees every prompt one token shorter (:mod:`paged_lib.engine.trace`)."""
    from paged_lib.engine import LLMEngine
    from paged_lib.engine.trace import simulated_blocks, trace_requests

    prompts, params = trace_requests(requests, model.config.vocab_size)
    engine = LLMEngine(model, num_blocks=num_blocks, block_size=block_size, watermark=0.0,
                       max_num_seqs=10**6, max_num_batched_tokens=10**6)
    engine.generate(prompts, params)
    st = engine.stats
    blocks, preemptions = simulated_blocks(requests, num_blocks, block_size)
    shifted = [Request(r.prompt_len - 1, r.output_len, 0.0) for r in requests]
    tl = simulate_timeline(shifted, "paged", num_blocks * block_size, block_size,
                           max_len=max(r.final_len for r in requests), record=True)
    running = running_per_step(tl).tolist()
    return {"steps": (st.steps, tl.num_steps),
            "peak_running": (max(st.batch_sizes), max(running)),
            "preemptions": (st.preemptions, preemptions),
            "same_blocks_every_step": (st.blocks_used == blocks,) * 2,
            "same_running_every_step": (st.batch_sizes == running,) * 2}


# ------------------------------------------------------------------------------- kernel


class KernelCost(NamedTuple):
    """What one decode launch does (no split-KV), summed over its programs.

    ``programs``: one per (sequence, KV head); ``iterations``: trips of the tile loop
    (``TILE_N`` tokens each); ``table_reads``: block-table elements loaded (masked lanes
    not counted); ``table_entries``: distinct block-table entries a program reads
    (``ceil(L / B)``: also the trips of a kernel that walks one *block* per iteration, as
    vLLM's CUDA kernel does with one warp per block); ``block_visits``: distinct blocks
    each tile gathers from, summed over tiles; ``kv_bytes``: K and V bytes loaded."""

    programs: int
    iterations: int
    table_reads: int
    table_entries: int
    block_visits: int
    kv_bytes: int


def _tile_visits(length: int, block_size: int, tile_n: int) -> int:
    starts = np.arange(0, length, tile_n)
    ends = np.minimum(starts + tile_n, length)
    return int(((ends - 1) // block_size - starts // block_size + 1).sum())


def decode_cost(seq_lens: Sequence[int], block_size: int, *, num_kv_heads: int = 1,
                head_dim: int = 128, itemsize: int = 2, tile_n: int = 32) -> KernelCost:
    """:class:`KernelCost` of the decode kernel from its loop structure: a program per
    (sequence, KV head) walks the sequence ``tile_n`` tokens at a time, looks up the
    blocks of the tile's tokens (:func:`paged_lib.kernels.triton_tile.tile_blocks`: each
    entry once per block when blocks and tiles divide each other, else once per tile that
    touches it) and loads their K and V rows (``head_dim`` elements each). One head
    chunk per KV head (GQA groups of at most 16 query heads: a larger group repeats every
    count per chunk of 16)."""
    _check_lengths(seq_lens, block_size)
    lens = [int(n) for n in seq_lens]
    entries = sum(cdiv(n, block_size) for n in lens)
    visits = sum(_tile_visits(n, block_size, tile_n) for n in lens)
    aligned = tile_n % block_size == 0 or block_size % tile_n == 0
    per_head = KernelCost(
        programs=len(lens),
        iterations=sum(cdiv(n, tile_n) for n in lens),
        table_reads=entries if aligned else visits,
        table_entries=entries,
        block_visits=visits,
        kv_bytes=2 * sum(lens) * head_dim * itemsize)
    return KernelCost(*(num_kv_heads * v for v in per_head))


def traced_decode_cost(seq_lens: Sequence[int], block_size: int, *, num_heads: int = 2,
                       num_kv_heads: int = 1, head_dim: int = 16,
                       tile_n: int = 16) -> KernelCost:
    """:class:`KernelCost` counted from a real run of the Triton decode kernel in the
    interpreter: every load it makes is logged and mapped back to the block table and the
    K and V caches. Keep it tiny: the interpreter runs each tile loop trip in Python."""
    import torch

    from paged_lib.device import interpreter_on
    from paged_lib.instruments.load_trace import trace_loads
    from paged_lib.kernels.cases import make_decode_case
    from paged_lib.kernels.reference import ref_paged_attention
    from paged_lib.kernels.triton_decode import paged_attention_triton

    if not interpreter_on():
        raise RuntimeError("traced_decode_cost needs Triton's interpreter (TRITON_INTERPRET=1)")
    _check_lengths(seq_lens, block_size)
    case = make_decode_case(list(seq_lens), num_heads, num_kv_heads, head_dim, block_size,
                            shared=False)
    with trace_loads() as trace:
        out = paged_attention_triton(*case[:5], case.scale, num_splits=1, tile_n=tile_n)
    if not torch.allclose(out, ref_paged_attention(*case).to(out.dtype), atol=1e-4):
        raise RuntimeError("the traced kernel's output differs from the reference")
    # Enabled lanes only: a masked lane past the block table's end may point into K.
    k_loads = trace.reads_of(case.k_cache, enabled_only=True)
    v_loads = trace.reads_of(case.v_cache, enabled_only=True)
    table = trace.reads_of(case.block_tables, enabled_only=True)
    entries: dict[tuple, set] = {}
    for r in table:
        entries.setdefault(r.program, set()).update(map(tuple, r.index[r.mask]))
    item = case.k_cache.element_size()
    return KernelCost(
        programs=len(trace.programs()),
        iterations=len(k_loads),
        table_reads=int(sum(r.mask.sum() for r in table)),
        table_entries=sum(len(s) for s in entries.values()),
        block_visits=sum(len(set(r.index[r.mask, 0].tolist())) for r in k_loads),
        kv_bytes=item * int(sum(r.mask.sum() for r in k_loads + v_loads)))


def gpu_decode_times(block_sizes: Sequence[int], seq_lens: Sequence[int], *,
                     num_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128
                     ) -> list[dict]:
    """Decode time (µs, CUDA graphs, median) of the Triton kernel per block size on a GPU,
    each output checked against the float64 reference before it is timed."""
    import torch

    from paged_lib.bench.checks import measure
    from paged_lib.bench.timing import gpu_timer
    from paged_lib.device import interpreter_on
    from paged_lib.kernels import paged_attention
    from paged_lib.kernels.cases import make_decode_case
    from paged_lib.kernels.reference import ref_paged_attention

    if not torch.cuda.is_available() or interpreter_on():
        raise RuntimeError("gpu_decode_times needs a CUDA GPU that compiles kernels")
    rows = []
    for b in block_sizes:
        case = make_decode_case(list(seq_lens), num_heads, num_kv_heads, head_dim, b,
                                torch.float16, "cuda", shared=False, poison=False)
        expected = ref_paged_attention(*case)
        ms = measure(f"block size {b}", lambda case=case: paged_attention(
            *case, validate=False, max_seq_len=max(seq_lens)), expected, gpu_timer)
        rows.append({"block_size": b, "us": 1e3 * ms})
    return rows


def cpu_decode_times(block_sizes: Sequence[int] = BLOCK_SIZES,
                     seq_lens: Sequence[int] = (1024,) * 8, *, num_heads: int = 32,
                     num_kv_heads: int = 8, head_dim: int = 128,
                     backends: Sequence[str] = ("cpu", "torch"), repeats: int = 5
                     ) -> list[dict]:
    """Decode time (µs, wall clock, the fastest of ``repeats``:
    :func:`paged_lib.studies.wall_clock.fastest_ms`) of the paged attention kernels
    that run on a CPU, per block size: ``"cpu"`` (chapter 04's C kernel, streaming K/V
    block by block; skipped where no C compiler builds it) and ``"torch"`` (gathers the
    blocks, then attends). fp32, each output checked against the float64 reference before
    it is timed. One row per block size: ``{"block_size": b, backend: µs, ...}``."""
    import torch

    from paged_lib.bench.checks import measure
    from paged_lib.kernels import cpu_decode, paged_attention
    from paged_lib.kernels.cases import make_decode_case
    from paged_lib.kernels.reference import ref_paged_attention

    usable = [b for b in backends if b != "cpu" or cpu_decode.available()]
    rows = []
    for b in block_sizes:
        case = make_decode_case(list(seq_lens), num_heads, num_kv_heads, head_dim, b,
                                torch.float32, "cpu", shared=False, poison=False)
        expected = ref_paged_attention(*case)
        row = {"block_size": b}
        for backend in usable:
            ms = measure(f"{backend}, block size {b}", lambda case=case, backend=backend:
                         paged_attention(*case, backend=backend, validate=False,
                                         max_seq_len=max(seq_lens)),
                         expected, lambda fn: fastest_ms(fn, repeats))
            row[backend] = 1e3 * ms
        rows.append(row)
    return rows


def smallest_efficient(rows: Sequence[dict], backend: str, tolerance: float = 0.10) -> int:
    """The smallest block size whose time (``rows`` from :func:`cpu_decode_times` or
    :func:`gpu_decode_times`, key ``backend``) is within ``tolerance`` of the fastest:
    the smallest block that keeps that kernel efficient on this machine."""
    times = {r["block_size"]: r[backend] for r in rows if backend in r}
    if not times:
        raise ValueError(f"no time measured for {backend!r}")
    fastest = min(times.values())
    return min(b for b, t in times.items() if t <= (1 + tolerance) * fastest)
