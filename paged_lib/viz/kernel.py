"""Pictures for chapter 05: which blocks each kernel program reads, split-KV, benchmarks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from paged_lib.kernels.triton_split import split_len


def _programs_per_block(seq_lens: Sequence[int], block_size: int, num_splits: int,
                        tile_n: int) -> dict[tuple[int, int], int]:
    """(sequence, logical block) -> split index of the program that reads it."""
    max_len = max(seq_lens)
    tokens = split_len(max_len, num_splits, tile_n) if num_splits > 1 else max_len
    owner = {}
    for s, n in enumerate(seq_lens):
        for b in range(math.ceil(n / block_size)):
            owner[(s, b)] = min(b * block_size // tokens, num_splits - 1)
    return owner


def plot_program_reads(block_tables: torch.Tensor, seq_lens: Sequence[int] | torch.Tensor,
                       block_size: int, num_blocks: int | None = None, num_kv_heads: int = 1,
                       num_splits: int = 1, tile_n: int = 16) -> Figure:
    """The launch grid laid over the block table, and the physical blocks it touches.

    Left: the block table (a row per sequence, a column per logical block), each entry
    coloured by the program that reads it and labelled with its physical block id; the
    last block shows how many of its slots are valid; grey entries are never read.
    Right: the physical cache, each block coloured by its reader(s); a block read by
    two sequences (shared prefix) is hatched. With ``num_splits > 1`` each sequence's
    blocks are divided among its segment programs (split-KV).
    """
    seq_lens = [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor)
                                 else seq_lens)]
    table = block_tables.tolist()
    num_seqs, max_blocks = len(table), len(table[0])
    if num_blocks is None:
        num_blocks = 1 + max(table[s][b] for s, n in enumerate(seq_lens)
                             for b in range(math.ceil(n / block_size)))
    owner = _programs_per_block(seq_lens, block_size, num_splits, tile_n)
    programs = sorted({(s, j) for (s, _), j in owner.items()})
    cmap = plt.get_cmap("tab10" if len(programs) <= 10 else "tab20")
    color = {p: cmap(i % cmap.N) for i, p in enumerate(programs)}

    cols = max(8, min(16, num_blocks))
    rows_phys = math.ceil(num_blocks / cols)
    fig, (ax_t, ax_c) = plt.subplots(
        1, 2, figsize=(4 + 0.7 * max_blocks + 0.45 * cols, 1.2 + 0.6 * max(num_seqs, rows_phys)),
        gridspec_kw={"width_ratios": [max_blocks, 0.65 * cols]})

    readers: dict[int, list[tuple[int, int]]] = {}
    for s in range(num_seqs):
        for b in range(max_blocks):
            y = num_seqs - 1 - s
            if (s, b) in owner:
                prog = (s, owner[(s, b)])
                phys = table[s][b]
                readers.setdefault(phys, []).append(prog)
                valid = min(block_size, seq_lens[s] - b * block_size)
                ax_t.add_patch(Rectangle((b, y), 1, 1, facecolor=color[prog], alpha=0.75,
                                         edgecolor="black"))
                label = str(phys) if valid == block_size else f"{phys}\n{valid}/{block_size}"
                ax_t.text(b + 0.5, y + 0.5, label, ha="center", va="center", fontsize=8)
            else:
                ax_t.add_patch(Rectangle((b, y), 1, 1, facecolor="0.92", edgecolor="0.7"))
                ax_t.text(b + 0.5, y + 0.5, "·", ha="center", va="center", color="0.5")
    ax_t.set_xlim(0, max_blocks)
    ax_t.set_ylim(0, num_seqs)
    ax_t.set_xticks([b + 0.5 for b in range(max_blocks)], [str(b) for b in range(max_blocks)])
    ax_t.set_yticks([num_seqs - 1 - s + 0.5 for s in range(num_seqs)],
                    [f"seq {s} (len {seq_lens[s]})" for s in range(num_seqs)])
    ax_t.set_xlabel("logical block")
    grid = f"({num_seqs}, {num_kv_heads}" + (f", {num_splits})" if num_splits > 1 else ")")
    ax_t.set_title(f"block_tables; grid {grid}: colour = program", fontsize=10)
    ax_t.tick_params(length=0)
    for spine in ax_t.spines.values():
        spine.set_visible(False)

    for blk in range(num_blocks):
        x, y = blk % cols, rows_phys - 1 - blk // cols
        progs = readers.get(blk, [])
        seqs = {p[0] for p in progs}
        face = color[progs[0]] if progs else "white"
        ax_c.add_patch(Rectangle((x, y), 1, 1, facecolor=face, alpha=0.75 if progs else 1,
                                 edgecolor="black", hatch="///" if len(seqs) > 1 else None))
        ax_c.text(x + 0.5, y + 0.5, str(blk), ha="center", va="center", fontsize=8)
    ax_c.set_xlim(0, cols)
    ax_c.set_ylim(0, rows_phys)
    ax_c.set_aspect("equal")
    ax_c.axis("off")
    ax_c.set_title("physical blocks (hatched: shared, white: not read)", fontsize=10)
    note = (f"each of the {num_kv_heads} KV-head programs of a sequence reads these blocks "
            "(its own head's slice)" if num_kv_heads > 1 else "")
    if note:
        fig.text(0.5, 0.01, note, ha="center", fontsize=8)
    fig.tight_layout()
    return fig


def plot_split_kv(seq_len: int, block_size: int, num_splits: int, tile_n: int = 16) -> Figure:
    """Flash-decoding for one sequence: segments, their partial results, one merge."""
    tokens = split_len(seq_len, num_splits, tile_n)
    bounds = [(j * tokens, min(seq_len, (j + 1) * tokens)) for j in range(num_splits)]
    bounds = [(a, b) for a, b in bounds if a < b]
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for j, (a, b) in enumerate(bounds):
        ax.add_patch(Rectangle((a, 2), b - a, 0.6, facecolor=cmap(j), alpha=0.75,
                               edgecolor="black"))
        ax.text((a + b) / 2, 2.3, f"program {j}\ntokens {a}-{b - 1}", ha="center",
                va="center", fontsize=8)
        ax.add_patch(FancyArrowPatch(((a + b) / 2, 2), ((a + b) / 2, 1.3),
                                     arrowstyle="-|>", mutation_scale=10))
        ax.text((a + b) / 2, 1.1, f"$o_{j}$, lse$_{j}$", ha="center", va="center", fontsize=9)
        ax.add_patch(FancyArrowPatch(((a + b) / 2, 0.95), (seq_len / 2, 0.45),
                                     arrowstyle="-|>", mutation_scale=10, color="0.4"))
    for b in range(0, seq_len + 1, block_size):
        ax.plot([b, b], [2, 2.6], color="black", lw=0.4, alpha=0.5)
    ax.text(seq_len / 2, 0.25, r"merge: $o = \sum_j 2^{lse_j - M} o_j \,/\, \sum_j 2^{lse_j - M}$",
            ha="center", va="center", fontsize=10,
            bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "0.4"})
    ax.set_xlim(-0.02 * seq_len, 1.02 * seq_len)
    ax.set_ylim(0, 2.8)
    ax.set_yticks([])
    ax.set_xlabel(f"token position (thin lines: block boundaries, block_size {block_size})")
    ax.set_title(f"split-KV: one sequence of {seq_len} tokens, {len(bounds)} segments of "
                 f"<= {tokens} tokens, each its own program", fontsize=10)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def plot_bench(rows: list[dict], peak_gbs: float | None = None) -> Figure:
    """Benchmark rows from :mod:`paged_lib.bench` as a figure.

    GPU sweep rows (with ``context``): achieved GB/s against context length, one line
    per batch size, the peak as a dashed line. CPU rows (with ``impl``): time per
    implementation relative to contiguous SDPA.
    """
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    if rows and "context" in rows[0]:
        for batch in sorted({r["batch"] for r in rows}):
            rs = [r for r in rows if r["batch"] == batch]
            ax.plot([r["context"] for r in rs], [r["GB/s"] for r in rs], marker="o",
                    label=f"batch {batch}")
        if peak_gbs:
            ax.axhline(peak_gbs, ls="--", color="black", label=f"peak {peak_gbs:.0f} GB/s")
            ax.axhline(0.7 * peak_gbs, ls=":", color="0.4", label="70% of peak")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("GB/s (K/V bytes read / time)")
        ax.set_title("paged decode kernel, fp16", fontsize=10)
        ax.legend(fontsize=8)
    else:
        names = [r["impl"] for r in rows]
        ratios = [r["vs_sdpa"] for r in rows]
        ax.barh(names, ratios, color=["0.6"] + ["tab:blue"] * (len(rows) - 1))
        ax.axvline(1.0, color="black", lw=0.8)
        for i, x in enumerate(ratios):
            ax.text(x, i, f" {x:.3g}x", va="center", fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("time relative to contiguous SDPA (log scale)")
        ax.set_title("CPU, 16 sequences, fp32", fontsize=10)
        ax.invert_yaxis()
    fig.tight_layout()
    return fig
