"""Chapter 00's picture: the course as a path through four parts."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from paged_lib.course.chapters import CHAPTERS

PART_COLOURS = {"memory": "#4C72B0", "kernel": "#DD8452", "engine": "#55A868",
                "beyond": "#8172B3"}
PART_NAMES = {"memory": "KV memory", "kernel": "kernels", "engine": "serving engine",
              "beyond": "beyond"}


def chapter_map(root: Path | None = None) -> Figure:
    """Every chapter as a box, coloured by part; chapters not written yet are faded."""
    fig, ax = plt.subplots(figsize=(11, 4.2))
    cols = 5
    for i, ch in enumerate(CHAPTERS):
        row, col = divmod(i, cols)
        x, y = col * 2.2, -row * 1.35
        ready = ch.available(root)
        colour = PART_COLOURS[ch.part]
        ax.add_patch(FancyBboxPatch((x, y), 2.0, 1.1, boxstyle="round,pad=0.02,rounding_size=0.1",
                                    facecolor=colour, alpha=0.9 if ready else 0.25,
                                    edgecolor=colour, linewidth=1.5))
        ax.text(x + 0.1, y + 0.85, ch.number, fontsize=12, weight="bold",
                color="white" if ready else colour)
        ax.text(x + 0.1, y + 0.45, ch.title, fontsize=9.5, weight="bold",
                color="white" if ready else "black", wrap=True)
        ax.text(x + 0.1, y + 0.12, "ready" if ready else "planned", fontsize=8,
                color="white" if ready else "grey", style="italic")
    for part, colour in PART_COLOURS.items():
        ax.plot([], [], "s", color=colour, markersize=10, label=PART_NAMES[part])
    ax.legend(loc="lower right", ncol=4, frameon=False, bbox_to_anchor=(1.0, -0.12))
    ax.set_xlim(-0.1, cols * 2.2)
    ax.set_ylim(-1.35 * ((len(CHAPTERS) - 1) // cols) - 0.3, 1.2)
    ax.set_axis_off()
    ax.set_title("The course: solid chapters are in this repository, faded ones are planned",
                 fontsize=11)
    fig.tight_layout()
    return fig
