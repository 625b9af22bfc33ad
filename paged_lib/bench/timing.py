"""Timers: wall-clock medians on the CPU, CUDA-graph replays on a GPU, and what a plain
read of GPU memory reaches (the ceiling a decode kernel is held to)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], repeats: int, warmup: int | None = None) -> float:
    """Median wall time in ms (by default one untimed warm-up run first when repeats > 1)."""
    for _ in range((1 if repeats > 1 else 0) if warmup is None else warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def gpu_timer(fn: Callable[[], object]) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph; plain ``do_bench`` (launch
    overhead included, and said so) if it cannot be captured."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as err:  # noqa: BLE001 - not capturable: time it without a graph
        print(f"note: not capturable in a CUDA graph ({type(err).__name__}); timed with "
              "do_bench, launch overhead included")
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, rep=100, return_mode="median")


def read_bandwidth(device: str = "cuda", nbytes: int = 4 * 2**30) -> dict:
    """What this machine's memory really delivers: a large plain read (a sum over
    ``nbytes`` of fp16) and a large copy, in GB/s (medians). Decode is a read: this is
    the ceiling a paged kernel can be held to, typically 85-90% of the spec peak."""
    import triton.testing

    x = torch.ones(nbytes // 2, dtype=torch.float16, device=device)
    read_ms = triton.testing.do_bench(lambda: x.sum(dtype=torch.float32), return_mode="median")
    y = torch.empty_like(x)
    copy_ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    return {"read_GB/s": nbytes / (read_ms * 1e-3) / 1e9,
            "copy_GB/s": 2 * nbytes / (copy_ms * 1e-3) / 1e9, "bytes": nbytes}
