"""Pictures for chapter 4: the online softmax across blocks; the gather through a block table."""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from paged_lib.attention import Trace
from paged_lib.util import cdiv


def running_softmax(trace: Trace, index: tuple[int, ...] = (), block_size: int | None = None
                    ) -> Figure:
    """The running max ``m`` and sum ``l`` after each block, for one query (``index``).

    Left: each block's own max score (dots) and the running max (steps), which only ever
    goes up. Right: the running sum ``l`` as stored (it drops whenever ``m`` rises: the
    old terms are rescaled by ``exp(m_old - m_new)``) and the same sums rescaled to the
    final max, which grow to the full softmax denominator.
    """
    block_max = [float(t[index]) for t in trace.block_max]
    run_max = [float(t[index]) for t in trace.running_max]
    run_sum = [float(t[index]) for t in trace.running_sum]
    steps = list(range(len(run_max)))  # block j, numbered from 0 like everything else
    m_final = run_max[-1]
    rescaled = [s * math.exp(m - m_final) for s, m in zip(run_sum, run_max, strict=True)]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    finite = [(x, b) for x, b in zip(steps, block_max, strict=True) if math.isfinite(b)]
    if finite:
        ax1.plot(*zip(*finite, strict=True), "o", color="tab:gray", label="max score in block")
    ax1.step(steps, run_max, where="post", color="tab:red", lw=2, label="running max m")
    ax1.axhline(m_final, ls="--", color="tab:red", alpha=0.4)
    ax1.set_xlabel("after block j" + (f" ({block_size} keys each)" if block_size else ""))
    ax1.set_ylabel("score")
    ax1.set_title("running max")
    ax1.legend(fontsize=8, loc="upper left")

    ax2.plot(steps, run_sum, "o-", color="tab:blue", label="l (relative to current m)")
    ax2.plot(steps, rescaled, "s--", color="tab:green", label="l rescaled to final m")
    ax2.axhline(rescaled[-1], ls=":", color="k", alpha=0.5, label="full softmax denominator")
    ax2.set_xlabel("after block j")
    ax2.set_ylabel("sum of exp(score - m)")
    ax2.set_title("running sum")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xticks(steps)
    fig.tight_layout()
    return fig


def block_gather(block_table: Sequence[int], seq_len: int, block_size: int,
                 num_blocks: int) -> Figure:
    """Which physical block each logical block of one sequence reads.

    Top row: the sequence's logical blocks, shaded by how many of their slots hold
    tokens. Bottom row: the pool of physical blocks; arrows show the block table. Slots
    past ``seq_len`` in the last block are hatched: the kernel must never read them.
    """
    used = cdiv(seq_len, block_size)
    table = [int(b) for b in block_table[:used]]
    width = max(num_blocks, used)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * width + 1.5), 3.0))
    y_log, y_phys, h = 2.0, 0.0, 0.7

    def draw_block(x: float, y: float, fill: int, label: str, color: str) -> None:
        ax.add_patch(Rectangle((x, y), 0.9, h, fill=False, lw=1.2))
        ax.add_patch(Rectangle((x, y), 0.9 * fill / block_size, h, color=color, alpha=0.6))
        if fill < block_size:
            ax.add_patch(Rectangle((x + 0.9 * fill / block_size, y),
                                   0.9 * (block_size - fill) / block_size, h, fill=False,
                                   hatch="///", lw=0, color="tab:red"))
        ax.text(x + 0.45, y + h / 2, label, ha="center", va="center", fontsize=8)

    fills = [min(block_size, seq_len - j * block_size) for j in range(used)]
    for j, fill in enumerate(fills):
        draw_block(j, y_log, fill, f"L{j}", "tab:blue")
    phys_fill = {b: f for b, f in zip(table, fills, strict=True)}
    for b in range(num_blocks):
        if b in phys_fill:
            draw_block(b, y_phys, phys_fill[b], f"P{b}", "tab:orange")
        else:
            ax.add_patch(Rectangle((b, y_phys), 0.9, h, color="lightgray"))
            ax.text(b + 0.45, y_phys + h / 2, f"P{b}", ha="center", va="center",
                    fontsize=8, color="gray")
    for j, b in enumerate(table):
        ax.add_patch(FancyArrowPatch((j + 0.45, y_log), (b + 0.45, y_phys + h),
                                     arrowstyle="-|>", mutation_scale=10, color="k",
                                     alpha=0.7))
    ax.text(-0.2, y_log + h / 2, "logical", ha="right", va="center")
    ax.text(-0.2, y_phys + h / 2, "physical", ha="right", va="center")
    ax.set_xlim(-1.6, width + 0.2)
    ax.set_ylim(-0.3, y_log + h + 0.5)
    ax.set_title(f"seq_len={seq_len}, block_size={block_size}: block table {table}")
    ax.axis("off")
    fig.tight_layout()
    return fig


def block_reads(runs: dict[str, Sequence], block_table: Sequence[int]) -> Figure:
    """The cache reads of several ways to compute the same attention, in time order.

    ``runs`` maps a label to its reads (``ReadLog.reads`` of
    :mod:`paged_lib.instruments.block_reads`: kind "K"/"V", a physical block id or a tuple of
    ids for a gather). Each read is a box as wide as the blocks it brings in; a row's
    right edge says how many blocks' keys/values one read holds at once.
    """
    colors = {"K": "tab:blue", "V": "tab:orange"}
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.8 * len(runs)))
    for row, (label, reads) in enumerate(runs.items()):
        y = len(runs) - 1 - row
        x, widest = 0.0, 1
        for r in reads:
            ids = r.block if isinstance(r.block, tuple) else (r.block,)
            logical = [block_table.index(b) if b in block_table else b for b in ids]
            w = len(ids)
            widest = max(widest, w)
            ax.add_patch(Rectangle((x, y), 0.9 * w, 0.7, color=colors[r.kind], alpha=0.75))
            names = ",".join(f"P{b}" for b in ids)
            ax.text(x + 0.45 * w, y + 0.35, f"{r.kind} {names}\n(L{logical[0]}"
                    + (f"-L{logical[-1]})" if w > 1 else ")"),
                    ha="center", va="center", fontsize=7)
            x += w
        ax.text(-0.3, y + 0.35, label, ha="right", va="center", fontsize=9)
        ax.text(x + 0.2, y + 0.35, f"{len(reads)} reads, up to {widest} block(s) per read",
                va="center", fontsize=8, color="dimgray")
    ax.set_xlim(-4.5, max(len(block_table) * 2 + 5, 12))
    ax.set_ylim(-0.3, len(runs))
    ax.set_title("cache reads in time order (K blue, V orange; Pn = physical, Ln = logical "
                 "block)", fontsize=9)
    ax.axis("off")
    fig.tight_layout()
    return fig
