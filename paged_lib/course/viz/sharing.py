"""Pictures of sharing: the beam tree, each beam's blocks by ref count, and the savings.

All drawing works on recorded :class:`~paged_lib.studies.sharing.BeamFrame` snapshots (see
:func:`paged_lib.studies.sharing.record_beam_search`), so the stepper widget only replays what
a test can check directly.
"""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib.pyplot as plt
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from paged_lib.course.viz.widgets import frame_player
from paged_lib.studies.sharing import MODES, PAPER_SAVINGS, BeamFrame, Savings, Usage

REF_COLORS = ["#FFF3C4", "#FDC46B", "#F08A3A", "#D1462F", "#9E1F2C", "#5E0F1E"]
COPY_COLOR, DEAD_COLOR, EDGE_COLOR = "#1F77B4", "#888888", "#444444"


def ref_colormap(max_ref: int) -> tuple[ListedColormap, BoundaryNorm]:
    """One colour per ref count 1..max_ref (light: private, dark: shared by many)."""
    max_ref = max(2, max_ref)
    colors = [REF_COLORS[min(i, len(REF_COLORS) - 1)] for i in range(max_ref)]
    return ListedColormap(colors), BoundaryNorm([k + 0.5 for k in range(max_ref + 1)],
                                                max_ref)


def describe_step(frame: BeamFrame) -> str:
    """The step in words: who forked, who died, which blocks were copied and freed."""
    if frame.step == 0:
        return (f"step 0: the prompt ({frame.num_tokens[0]} tokens) in blocks "
                f"{frame.blocks[0]}")
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(frame.parents):
        kids.setdefault(p, []).append(i)
    forks = [f"{p}->{','.join(map(str, c))}" for p, c in sorted(kids.items()) if len(c) > 1]
    parts = [f"step {frame.step}:",
             f"forked {'; '.join(forks)}" if forks else "no fork",
             f"died {frame.freed_beams}" if frame.freed_beams else "none died",
             "copied " + ", ".join(f"{s}->{d}" for s, d in frame.copies)
             if frame.copies else "no copy",
             f"freed blocks {frame.freed_blocks}" if frame.freed_blocks else "no block freed"]
    return parts[0] + " " + " | ".join(parts[1:])


def draw_beam_tree(frames: list[BeamFrame], upto: int | None = None) -> Figure:
    """The beam tree up to step ``upto`` (left) and that step's block tables (right).

    Left: one column per step, one dot per live beam, a line from each beam to its
    parent; an x marks a beam that died, a blue ring a beam whose write copied a block.
    Right: each beam's blocks, coloured by ref count (how many beams share the block),
    filled as far as tokens are written; a blue edge marks a freshly copied block.
    """
    if not frames:
        raise ValueError("draw_beam_tree needs at least one recorded frame")
    upto = len(frames) - 1 if upto is None else upto
    if not 0 <= upto < len(frames):
        raise ValueError(f"upto must be in 0..{len(frames) - 1}, got {upto}")
    width = max(len(f.parents) for f in frames)
    fig, (tree, blocks) = plt.subplots(1, 2, figsize=(12, 0.55 * width + 2.4),
                                       gridspec_kw={"width_ratios": [3, 2]})
    _draw_tree(tree, frames, upto, width)
    _draw_blocks(blocks, frames[upto], width, fig)
    fig.suptitle(describe_step(frames[upto]), fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    return fig


def _draw_tree(ax, frames: list[BeamFrame], upto: int, width: int) -> None:
    for t in range(1, upto + 1):
        frame = frames[t]
        copied = {d for _, d in frame.copies}
        for i, p in enumerate(frame.parents):
            ax.plot([t - 1, t], [p, i], color=EDGE_COLOR, lw=1.2, zorder=1)
            ring = frame.blocks[i][-1] in copied
            ax.scatter([t], [i], s=46, color="white" if ring else EDGE_COLOR,
                       edgecolors=COPY_COLOR if ring else EDGE_COLOR,
                       linewidths=2 if ring else 1, zorder=2)
        for d in frame.freed_beams:
            ax.scatter([t - 0.55], [d], marker="x", s=40, color=DEAD_COLOR, zorder=2)
            ax.plot([t - 1, t - 0.55], [d, d], color=DEAD_COLOR, lw=1, ls=":", zorder=1)
    ax.scatter([0], [0], s=80, marker="s", color=EDGE_COLOR, zorder=2)
    ax.text(0, -0.45, "prompt", ha="center", va="top", fontsize=8)
    for f in frames[upto + 1:]:  # the future, faint
        for i, p in enumerate(f.parents):
            ax.plot([f.step - 1, f.step], [p, i], color=EDGE_COLOR, lw=0.8, alpha=0.12)
    ax.axvline(upto, color=COPY_COLOR, lw=0.8, alpha=0.4)
    ax.set_xlim(-0.6, len(frames) - 0.4)
    ax.set_ylim(width - 0.4, -0.9)
    ax.set_xlabel("step (tokens generated)")
    ax.set_ylabel("beam (best first)")
    ax.set_yticks(range(width))
    ax.set_title("beam tree: o kept, x died, blue ring: its write copied a block",
                 fontsize=9, loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _draw_blocks(ax, frame: BeamFrame, width: int, fig: Figure) -> None:
    cmap, norm = ref_colormap(width)
    bs = frame.block_size
    copied = {d for _, d in frame.copies}
    most = max(len(b) for b in frame.blocks)
    for i, (blocks, n) in enumerate(zip(frame.blocks, frame.num_tokens, strict=True)):
        for j, b in enumerate(blocks):
            filled = min(bs, n - j * bs) / bs
            color = cmap(norm(frame.ref_counts[b]))
            ax.add_patch(Rectangle((j, i - 0.35), 0.9, 0.7, facecolor="#EEEEEE",
                                   edgecolor="none"))
            ax.add_patch(Rectangle((j, i - 0.35), 0.9 * filled, 0.7, facecolor=color,
                                   edgecolor="none"))
            new = b in copied and j == len(blocks) - 1
            ax.add_patch(Rectangle((j, i - 0.35), 0.9, 0.7, fill=False,
                                   edgecolor=COPY_COLOR if new else "black",
                                   lw=2.2 if new else 0.8))
            ax.text(j + 0.45, i, f"#{b}", ha="center", va="center", fontsize=7)
    ax.set_xlim(-0.2, max(most, 1) + 0.1)
    ax.set_ylim(width - 0.4, -0.9)
    ax.set_yticks(range(width))
    ax.set_xticks([])
    ax.set_xlabel(f"logical blocks (block size {bs})")
    ax.set_title(f"step {frame.step}: each beam's blocks, colour = ref count", fontsize=9,
                 loc="left")
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=norm)
    bar = fig.colorbar(sm, ax=ax, ticks=range(1, max(2, width) + 1), fraction=0.05)
    bar.set_label("ref count", fontsize=8)


def stepper(frames: list[BeamFrame]):
    """An ipywidgets player over a recorded beam search (draws :func:`draw_beam_tree`)."""
    return frame_player(len(frames), lambda i: draw_beam_tree(frames, i), interval=700,
                        description="step")


def plot_savings(table: dict[tuple[str, str, int], Savings],
                 paper_trace: Mapping[str, str] | None = None) -> Figure:
    """Measured savings (bars: time-averaged; dots: peak) beside the paper's ranges.

    ``table`` is :func:`paged_lib.studies.sharing.savings_table`'s result, possibly with
    runs of a real model added (:func:`paged_lib.studies.sharing_engine.engine_savings`),
    one panel per trace in the table's order. The paper's section 6.3 range for each trace
    and mode is the shaded band behind its bars; ``paper_trace`` names the paper's trace
    to shade behind a trace of another name (``{"SmolLM2 chat": "alpaca"}``).
    """
    traces = list(dict.fromkeys(k[0] for k in table))
    paper_trace = dict(paper_trace or {})
    widths = sorted({k[2] for k in table})
    fig, axes = plt.subplots(1, len(traces), figsize=(5.2 * len(traces), 3.6), sharey=True,
                             squeeze=False)
    colors = {"parallel": "#4C72B0", "beam": "#C44E52"}
    bar = 0.8 / len(widths)
    for ax, trace in zip(axes[0], traces, strict=True):
        for m, mode in enumerate(MODES):
            if (paper_trace.get(trace, trace), mode) in PAPER_SAVINGS:
                lo, hi = PAPER_SAVINGS[paper_trace.get(trace, trace), mode]
                ax.axhspan(lo, hi, xmin=m / len(MODES) + 0.02, xmax=(m + 1) / len(MODES) - 0.02,
                           color=colors[mode], alpha=0.15, lw=0)
            for k, w in enumerate(widths):
                s = table.get((trace, mode, w))
                if s is None:
                    continue
                x = m + (k - (len(widths) - 1) / 2) * bar
                ax.bar(x, s.mean_saving, bar * 0.9, color=colors[mode], alpha=0.85)
                ax.scatter([x], [s.peak_saving], color="black", s=14, zorder=3)
                ax.text(x, -0.01, f"{w}", ha="center", va="top", fontsize=8)
        ax.set_xticks(range(len(MODES)))
        present = sorted({k[2] for k in table if k[0] == trace})
        ax.set_xticklabels([f"\n{m} (width {', '.join(map(str, present))})" for m in MODES],
                           fontsize=9)
        ax.tick_params(axis="x", length=0)
        ax.set_xlim(-0.5, len(MODES) - 0.5)
        ax.set_ylim(0, 1)
        ax.set_title(f"{trace}-like trace (synthetic)" if trace not in paper_trace else
                     f"{trace} (measured; shaded: {paper_trace[trace]})", fontsize=10)
        ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
    axes[0, 0].set_ylabel("KV blocks saved by sharing")
    axes[0, -1].text(1.0, 0.98, "bars: time-averaged   dots: peak\nshaded: paper §6.3 range",
                     transform=axes[0, -1].transAxes, ha="right", va="top", fontsize=8)
    fig.tight_layout()
    return fig


def plot_beam_blocks(runs: Mapping[str, Usage], title: str = "") -> Figure:
    """Blocks one beam search holds per step, with sharing (solid, one line per run: real
    beams of a model, the synthetic process) and without (dashed; one line for runs
    whose beams have the same lengths)."""
    fig, ax = plt.subplots(figsize=(9, 3.2))
    colors = ["#4C72B0", "#DD8452", "#55A868", "#8172B3"]
    drawn: list[list[int]] = []
    for k, (name, usage) in enumerate(runs.items()):
        c = colors[k % len(colors)]
        ax.plot(range(len(usage.shared)), usage.shared, color=c, lw=2,
                label=f"{name}: shared")
        if usage.unshared in drawn:  # the same lengths: one line says it
            continue
        same = [n for n, u in runs.items() if u.unshared == usage.unshared]
        ax.plot(range(len(usage.unshared)), usage.unshared, color=c if len(same) == 1
                else "#777777", lw=1, ls="--",
                label=f"{' and '.join(same)}: each beam its own copy")
        drawn.append(usage.unshared)
    ax.set_xlabel("step (0: the prompt)")
    ax.set_ylabel("blocks held")
    ax.set_ylim(0, None)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
