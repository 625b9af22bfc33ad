"""Pictures of what chapters 06, 07 and 09 time on this machine.

* :func:`plot_systems_timed` (chapter 06): steps and tokens per second of static
  batching, Orca's reservations and paging (:mod:`paged_lib.studies.batching_time`);
* :func:`plot_preemption_times` (chapter 07): swap against recompute per block size,
  measured here beside the paper's GPU setting modelled
  (:mod:`paged_lib.studies.preemption_time`, :mod:`paged_lib.studies.swap_cost`);
* :func:`plot_decode_times` (chapter 09): the paged decode kernels' time per block size
  (:func:`paged_lib.studies.block_size.cpu_decode_times`).

Each takes measured rows and returns a matplotlib ``Figure``; nothing here measures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from paged_lib.studies.preemption_time import PreemptionTiming
from paged_lib.studies.swap_cost import Link, recompute_seconds, swap_seconds

LABELS = {"static": "static, max-length", "orca-max": "Orca (Max)",
          "orca-pow2": "Orca (Pow2)", "orca-oracle": "Orca (Oracle)", "paged": "paged"}
COLORS = {"static": "#BBBBBB", "orca-max": "#DD8452", "orca-pow2": "#DD8452",
          "orca-oracle": "#8172B3", "paged": "#4C72B0"}
SWAP, PER_BLOCK, RECOMPUTE = "#4C72B0", "#DD8452", "#C44E52"


def plot_systems_timed(runs: Mapping, title: str = "") -> Figure:
    """Two bar charts over the same systems: steps to serve the requests (left) and
    generated tokens per second of wall clock on this machine (right), each labelled
    with its ratio to the paged engine. ``runs``: system -> ``TimedRun``."""
    names = list(runs)
    paged = runs["paged"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.42 * len(names) + 1.4),
                                      sharey=True)
    for ax, values, ref, fmt, label in (
            (left, [runs[n].steps for n in names], paged.steps, "{:.0f} steps ({:.1f}x)",
             "steps to serve every request (fewer is better)"),
            (right, [runs[n].tokens_per_s for n in names], paged.tokens_per_s,
             "{:.0f} tokens/s ({:.2f}x)", "generated tokens per second, this machine")):
        bars = ax.barh(range(len(names)), values, color=[COLORS.get(n, "#999999")
                                                          for n in names])
        for bar, v in zip(bars, values, strict=True):
            ax.text(v, bar.get_y() + bar.get_height() / 2, " " + fmt.format(v, v / ref),
                    va="center", fontsize=8)
        ax.set_xlim(0, max(values) * 1.45)
        ax.set_xlabel(label, fontsize=9)
    left.set_yticks(range(len(names)), [LABELS.get(n, n) for n in names], fontsize=9)
    left.invert_yaxis()
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_preemption_times(rows: Sequence[PreemptionTiming], spec, link: Link,
                          tokens_per_s: float, num_tokens: int, how: str) -> Figure:
    """Left: measured here, seconds to swap one request out and back in (as the engine
    issues it, and one copy per block) and to recompute it, against the block size.
    Right: the same three for ``spec`` modelled on a GPU (``link``: the per-copy
    overhead and the bandwidth of PCIe; recompute at ``tokens_per_s``, ``how``)."""
    rows = sorted(rows, key=lambda r: r.block_size)
    sizes = [r.block_size for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    left.plot(sizes, [1e3 * r.swap_per_block_s for r in rows], "o-", color=PER_BLOCK,
              label="swap, one copy per block per layer per K/V (vLLM v0)")
    left.plot(sizes, [1e3 * r.swap_s for r in rows], "s-", color=SWAP,
              label="swap, the engine's indexed copy per layer per K/V")
    left.plot(sizes, [1e3 * r.recompute_s for r in rows], "^-", color=RECOMPUTE,
              label="recompute: the engine's prefill again")
    left.set_title(f"measured here (CPU memory, no PCIe): {rows[0].num_tokens} tokens",
                   fontsize=10)
    swap = [1e3 * swap_seconds(num_tokens, b, spec, link) for b in sizes]
    swap_once = [1e3 * swap_seconds(num_tokens, b, spec, link, copies_per_blk=0) for b in sizes]
    rec = 1e3 * recompute_seconds(num_tokens, tokens_per_s)
    right.plot(sizes, swap, "o-", color=PER_BLOCK, label="swap, one copy per block (model)")
    right.plot(sizes, swap_once, "s--", color=SWAP, label="swap, bytes over the link only")
    right.plot(sizes, [rec] * len(sizes), "^-", color=RECOMPUTE, label=f"recompute ({how})")
    right.set_title(f"modelled: {spec.name} on a GPU, {num_tokens} tokens, "
                    f"{link.bandwidth / 1e9:.0f} GB/s + {1e6 * link.overhead_s:.1f} µs/copy",
                    fontsize=10)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("ms to preempt and bring back one request")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7.5)
    fig.tight_layout()
    return fig


def plot_decode_times(rows: Sequence[Mapping], smallest: Mapping[str, int],
                      paper_block: int = 16, tolerance: float = 0.10,
                      title: str = "") -> Figure:
    """Decode time per block size of each kernel in ``rows`` (from ``cpu_decode_times``),
    relative to that kernel's fastest; a dotted line at each kernel's smallest efficient
    block (``smallest``) and a grey one at the paper's GPU choice (``paper_block``)."""
    sizes = [r["block_size"] for r in rows]
    backends = [k for k in rows[0] if k != "block_size"]
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    colors = {"cpu": "#4C72B0", "torch": "#DD8452", "triton": "#55A868"}
    for backend in backends:
        times = [r[backend] for r in rows]
        fastest = min(times)
        color = colors.get(backend, "#555555")
        ax.plot(sizes, [t / fastest for t in times], "o-", color=color,
                label=f"{backend} kernel (fastest {fastest / 1e3:.2f} ms)")
        if backend in smallest:
            ax.axvline(smallest[backend], color=color, ls=":",
                       label=f"{backend}: smallest within {tolerance:.0%} of its fastest, "
                             f"{smallest[backend]}")
    ax.axvline(paper_block, color="#999999", lw=3, alpha=0.4,
               label=f"the paper's choice on a GPU: {paper_block}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("decode time / the kernel's fastest")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
