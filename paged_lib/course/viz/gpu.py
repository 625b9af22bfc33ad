"""Primers for chapter 05: why decode is memory bound (a roofline), and stored GPU numbers.

Decode attention reads every cached K and V once per step and does a few FLOPs with
each: per token and KV head, ``4 * head_dim`` bytes at fp16 (K and V), and per query
head ``4 * head_dim`` FLOPs (``q . k`` and ``p * v``, a multiply and an add each). A GQA
group of ``g`` query heads shares one read, so the arithmetic intensity is about ``g``
FLOPs per byte at fp16, far left of the ridge of any GPU (hundreds of FLOPs per byte):
the kernel waits on HBM, and its figure of merit is GB/s.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

#: Spec-sheet peaks: dense fp16/bf16 tensor-core TFLOP/s and HBM TB/s (SXM parts).
GPUS = {"H100 SXM": (989.0, 3.35), "H200": (989.0, 4.8), "A100 40GB": (312.0, 1.555)}


def decode_intensity(group: int, head_dim: int = 128, dtype_bytes: int = 2) -> float:
    """FLOPs per byte of decode attention for one KV head serving ``group`` query heads."""
    flops = group * 4 * head_dim           # per token: q.k and p*v, 2 FLOPs per element each
    bytes_read = 2 * head_dim * dtype_bytes  # per token: its K and V rows
    return flops / bytes_read


def prefill_intensity(query_len: int, group: int, head_dim: int = 128,
                      dtype_bytes: int = 2) -> float:
    """The same for ``query_len`` new tokens per sequence: each K/V read serves them all."""
    return query_len * decode_intensity(group, head_dim, dtype_bytes)


def plot_roofline(gpu: str = "H100 SXM", groups: tuple[int, ...] = (1, 4, 8),
                  prefill_len: int = 512) -> Figure:
    """Attainable TFLOP/s against arithmetic intensity, with decode and prefill marked."""
    tflops, tbs = GPUS[gpu]
    ridge = tflops / tbs  # FLOPs per byte where the two roofs meet
    xs = [0.25 * 2 ** (i / 4) for i in range(60)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [min(tflops, tbs * x) for x in xs], color="k", lw=2)
    ax.axvline(ridge, ls=":", color="gray")
    ax.text(ridge * 1.1, tflops * 0.05, f"ridge ~{ridge:.0f} FLOP/B", color="gray", fontsize=8)
    for g in groups:
        x = decode_intensity(g)
        ax.plot([x], [tbs * x], "o", color="tab:red")
        ax.annotate(f"decode, group {g}", (x, tbs * x), textcoords="offset points",
                    xytext=(5, -12), fontsize=8, color="tab:red")
    x = prefill_intensity(prefill_len, groups[-1])
    ax.plot([x], [min(tflops, tbs * x)], "s", color="tab:blue")
    ax.annotate(f"prefill, {prefill_len} tokens", (x, min(tflops, tbs * x)),
                textcoords="offset points", xytext=(-60, -15), fontsize=8, color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte of HBM read), fp16")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(f"roofline of an {gpu} (spec peaks: {tflops:g} TFLOP/s, {tbs:g} TB/s)")
    fig.tight_layout()
    return fig


def gpu_reports(root: str | Path) -> list[Path]:
    """Stored GPU check reports (``reports/gpu-check-*.md``), newest name last."""
    return sorted(Path(root).glob("gpu-check-*.md"))
