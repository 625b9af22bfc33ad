"""Chapter 09's pictures: one sequence's blocks at three block sizes, and the three
measures of :mod:`paged_lib.studies.block_size` against block size (the paper's Fig. 18b)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from paged_lib.studies.block_size import KernelCost, MemoryRow
from paged_lib.util import cdiv

COLORS = {"sharegpt": "#4C72B0", "alpaca": "#DD8452"}
FILLED, EMPTY = "#55A868", "#F2C7C7"


def sequence_blocks(num_tokens: int, block_sizes: Sequence[int] = (4, 16, 64)) -> Figure:
    """One sequence of ``num_tokens`` tokens in blocks of each size: filled slots green,
    the last block's empty slots red, one row per block size."""
    if num_tokens < 1 or not block_sizes:
        raise ValueError("need a sequence of at least one token and a block size")
    width = max(cdiv(num_tokens, b) * b for b in block_sizes)
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.8 * len(block_sizes)))
    for row, b in enumerate(block_sizes):
        y = len(block_sizes) - 1 - row
        blocks = cdiv(num_tokens, b)
        for k in range(blocks):
            used = min(b, num_tokens - k * b)
            ax.add_patch(Rectangle((k * b, y + 0.1), used, 0.8, color=FILLED))
            if used < b:
                ax.add_patch(Rectangle((k * b + used, y + 0.1), b - used, 0.8, color=EMPTY,
                                       hatch="//", ec="#C44E52", lw=0))
            ax.add_patch(Rectangle((k * b, y + 0.1), b, 0.8, fill=False, ec="black", lw=1))
        empty = blocks * b - num_tokens
        ax.text(width + 1, y + 0.5, f"B={b}: {blocks} block{'s' if blocks > 1 else ''}, "
                f"{empty} empty slots",
                va="center", fontsize=9)
    ax.set_xlim(0, width * 1.45)
    ax.set_ylim(0, len(block_sizes))
    ax.set_yticks([])
    ax.set_xlabel("token slot")
    ax.set_title(f"One sequence of {num_tokens} tokens: only its last block is part empty")
    fig.tight_layout()
    return fig


def _log2_axis(ax, sizes: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sizes))
    ax.set_xticklabels([str(s) for s in sizes], fontsize=8)
    ax.set_xlabel("block size (tokens)")
    ax.grid(alpha=0.3)


def _shade(ax, best: Mapping[str, tuple[int, int]] | None) -> None:
    for k, (name, (lo, hi)) in enumerate((best or {}).items()):
        ax.axvspan(lo / 1.2, hi * 1.2, ymin=0.5 * k, ymax=0.5 * (k + 1),
                   color=COLORS.get(name, "grey"), alpha=0.12)


def three_curves(memory: Mapping[str, Sequence[MemoryRow]],
                 kernel: Mapping[str, Sequence[KernelCost]], tokens: Mapping[str, int],
                 best: Mapping[str, tuple[int, int]] | None = None) -> Figure:
    """Waste (left), steps and peak concurrency (middle), decode-kernel work per cached
    token (right: ``tokens[name]`` tokens per decode step) against block size, one colour
    per trace; ``best`` shades each trace's range (the first trace in the lower half of
    each panel, the second in the upper)."""
    fig, (waste, steps, cost) = plt.subplots(1, 3, figsize=(15, 4.6))
    for name, rows in memory.items():
        sizes = [r.block_size for r in rows]
        c = COLORS.get(name, "grey")
        waste.plot(sizes, [100 * (1 - r.token_states) for r in rows], "o-", color=c,
                   label=f"{name}: not token states")
        waste.plot(sizes, [100 * r.internal for r in rows], "s:", color=c,
                   label=f"{name}: never filled (internal)")
        fewest = min(r.steps for r in rows)
        steps.plot(sizes, [r.steps / fewest for r in rows], "o-", color=c,
                   label=f"{name}: steps / fewest")
    peak = steps.twinx()
    for name, rows in memory.items():
        peak.plot([r.block_size for r in rows], [r.peak_running for r in rows], "^--",
                  color=COLORS.get(name, "grey"), alpha=0.6, label=f"{name}: peak running")
    peak.set_ylabel("peak requests running at once (dashed)")
    for name, costs in kernel.items():
        sizes = [r.block_size for r in memory[name]]
        c = COLORS.get(name, "grey")
        n = float(tokens[name])
        cost.plot(sizes, [k.table_reads / n for k in costs], "o-", color=c,
                  label=f"{name}: block-table reads")
        cost.plot(sizes, [k.block_visits / n for k in costs], "s:", color=c,
                  label=f"{name}: blocks gathered, summed over tiles")
        cost.plot(sizes, [k.iterations / n for k in costs], "x--", color=c, alpha=0.6,
                  label=f"{name}: tile-loop trips")
    waste.set_ylabel("% of the KV memory held")
    waste.set_title("(1) memory: what the blocks do not hold")
    steps.set_ylabel("steps to serve the trace / the fewest")
    steps.set_title("(2) engine on a fixed KV budget")
    cost.set_yscale("log", base=2)
    cost.set_ylabel("per cached token, one decode step")
    cost.set_title("(3) decode kernel's work")
    for ax in (waste, steps, cost):
        _log2_axis(ax, [r.block_size for r in next(iter(memory.values()))])
        _shade(ax, best)
        ax.legend(fontsize=7, loc="lower left" if ax is cost else "upper left")
    peak.legend(fontsize=7, loc="center left")
    fig.tight_layout()
    return fig


def prefix_loss(prefix_len: int, block_sizes: Sequence[int],
                reusable: Sequence[int]) -> Figure:
    """Share of a shared prefix that prefix caching cannot reuse, against block size."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    lost = [100 * (prefix_len - r) / prefix_len for r in reusable]
    ax.bar(range(len(block_sizes)), lost, color="#8172B3")
    ax.set_xticks(range(len(block_sizes)))
    ax.set_xticklabels([str(b) for b in block_sizes], fontsize=8)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("% of the prefix computed again")
    ax.set_title(f"A shared prefix of {prefix_len} tokens: only full blocks are reused")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig
