"""Chapter 07's picture of swap vs recompute in time (the paper's §7.3, Fig. 19).

Left: measured times of moving blocks, one copy per block against one indexed copy, per
block moved. Right: the cost model of :mod:`paged_lib.studies.swap_cost` against block size, for
a fixed number of tokens, with every assumption written on the plot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from paged_lib.accounting import ModelSpec
from paged_lib.bench.swap import CopyTiming
from paged_lib.studies.swap_cost import Link, crossing_block_size, recompute_seconds, swap_seconds

COLORS = ["#4C72B0", "#DD8452", "#55A868", "#8172B3"]


@dataclass(frozen=True)
class Setting:
    """One line pair of the right panel: a model, a link, a recompute rate, and where
    the recompute rate comes from (``how``, written in the legend)."""

    label: str
    spec: ModelSpec
    link: Link
    tokens_per_s: float
    how: str


def swap_recompute_curves(setting: Setting, num_tokens: int,
                          block_sizes: Sequence[int]) -> tuple[list[float], list[float]]:
    """Seconds to swap (out and back in, one copy per block per layer per K/V) and to
    recompute ``num_tokens`` tokens, at each block size."""
    swap = [swap_seconds(num_tokens, b, setting.spec, setting.link) for b in block_sizes]
    rec = [recompute_seconds(num_tokens, setting.tokens_per_s)] * len(block_sizes)
    return swap, rec


def plot_swap_cost(rows: Sequence[CopyTiming], settings: Sequence[Setting],
                   num_tokens: int = 1024, fitted: Link | None = None) -> Figure:
    """Measured copy times (left) and swap vs recompute time against block size (right)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    counts = sorted({r.num_blocks for r in rows})
    biggest = counts[-1]
    sel = sorted((r for r in rows if r.num_blocks == biggest), key=lambda r: r.block_size)
    bs = [r.block_size for r in sel]
    left.plot(bs, [1e6 * r.separate_s / r.num_blocks for r in sel], "o-", color=COLORS[1],
              label=f"{biggest} blocks, one copy per block per layer per K/V")
    left.plot(bs, [1e6 * r.batched_s / r.num_blocks for r in sel], "s-", color=COLORS[0],
              label=f"{biggest} blocks, one indexed copy per layer per K/V")
    if fitted is not None:
        model = [1e6 * fitted.seconds(r.num_copies, r.nbytes) / r.num_blocks for r in sel]
        left.plot(bs, model, ":", color="black",
                  label=f"fit: {1e6 * fitted.overhead_s:.1f} µs per copy + bytes / "
                        f"{fitted.bandwidth / 1e9:.1f} GB/s")
    left.set(xscale="log", yscale="log", xlabel="block size (tokens)",
             ylabel="µs per block moved (median)",
             title="measured on this machine (CPU memory to CPU memory)")
    left.set_xticks(bs, [str(b) for b in bs])
    left.legend(fontsize=7.5, loc="upper left")

    grid = [int(b) for b in np.unique(np.geomspace(1, 256, 33).round())]
    for k, s in enumerate(settings):
        swap, rec = swap_recompute_curves(s, num_tokens, grid)
        c = COLORS[(2 * k) % len(COLORS)]
        right.plot(grid, swap, "-", color=c, label=f"{s.label}: swap out + in")
        right.plot(grid, rec, "--", color=c, label=f"{s.label}: recompute ({s.how})")
        cross = crossing_block_size(s.spec, s.link, s.tokens_per_s)
        if cross is not None and 1 <= cross <= 256:
            right.plot([cross], [recompute_seconds(num_tokens, s.tokens_per_s)], "o",
                       color=c, ms=7)
            right.annotate(f"crossing ≈ {cross:.0f}", (cross, rec[0]), xytext=(6, 6),
                           textcoords="offset points", fontsize=8, color=c)
    links = {(s.link.overhead_s, s.link.bandwidth) for s in settings}
    notes = [f"swap: {1e6 * o:.1f} µs per copy (fitted, left) + bytes / {w / 1e9:.0f} GB/s "
             "(assumed PCIe 4.0 x16)" for o, w in sorted(links)]
    notes.append("one copy per block per layer, K and V apart (as vLLM v0 swaps)")
    right.text(0.02, 0.02, "\n".join(notes), transform=right.transAxes, fontsize=7,
               va="bottom", color="#333333")
    right.set(xscale="log", yscale="log", xlabel="block size (tokens)",
              ylabel=f"seconds to preempt and restore {num_tokens} tokens",
              title="cost model: swap vs recompute")
    right.set_xticks([1, 4, 16, 64, 256], ["1", "4", "16", "64", "256"])
    right.axvspan(16, 64, color="#EEEEEE", zorder=0)
    right.text(32, 0.985, "paper: comparable\nat 16-64", ha="center", va="top", fontsize=6.5,
               color="#777777", transform=right.get_xaxis_transform())
    right.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 0.12))
    fig.tight_layout()
    return fig
