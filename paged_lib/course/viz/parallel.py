"""Pictures of tensor parallelism (chapter 12): which rank owns which heads, what each
rank keeps of the same physical blocks, and the KV bytes per rank.

Every function returns a matplotlib ``Figure``; the tests call them directly. ``owners``
is a function ``(num_heads, num_kv_heads, tp_size, rank) -> (query heads, KV heads)``:
the library's :func:`paged_lib.parallel.rank_heads` or a learner's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from paged_lib.parallel import rank_heads

RANK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860",
               "#DA8BC3", "#8C8C8C")
EMPTY = "#F2F2F2"

Owners = Callable[[int, int, int, int], tuple[list[int], list[int]]]


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def _grid(ax, rows: Sequence[set[int]], width: int, label: str) -> None:
    """One row per rank, one cell per head; a cell is filled in the rank's colour when
    the rank owns that head (a KV head owned by several ranks is replicated)."""
    for r, owned in enumerate(rows):
        y = len(rows) - 1 - r
        for h in range(width):
            ax.add_patch(Rectangle((h, y), 0.92, 0.85, edgecolor="#555555",
                                   facecolor=rank_color(r) if h in owned else EMPTY))
            if h in owned:
                ax.text(h + 0.46, y + 0.42, str(h), ha="center", va="center", fontsize=9,
                        color="white")
        ax.text(-0.2, y + 0.42, f"rank {r}", ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.6, width + 0.1)
    ax.set_ylim(-0.2, len(rows))
    ax.set_title(label, fontsize=10, loc="left")
    ax.axis("off")


def heads_by_rank(num_heads: int, num_kv_heads: int, tp_size: int,
                  owners: Owners = rank_heads) -> Figure:
    """Query heads (left) and KV heads (right), one row per rank, coloured by the rank
    that owns them; a KV head filled in several rows is replicated on those ranks."""
    shares = [owners(num_heads, num_kv_heads, tp_size, r) for r in range(tp_size)]
    fig, (aq, ak) = plt.subplots(1, 2, figsize=(2.2 + 0.45 * (num_heads + num_kv_heads),
                                                0.45 * tp_size + 0.9),
                                 gridspec_kw={"width_ratios": [num_heads + 1.6,
                                                               num_kv_heads + 1.6]})
    _grid(aq, [set(q) for q, _ in shares], num_heads, f"{num_heads} query heads")
    copies = [sum(h in k for _, k in shares) for h in range(num_kv_heads)]
    note = "" if max(copies, default=1) <= 1 else f", each on {max(copies)} ranks"
    _grid(ak, [set(k) for _, k in shares], num_kv_heads, f"{num_kv_heads} KV heads{note}")
    fig.suptitle(f"tensor_parallel_size={tp_size}", fontsize=11)
    fig.tight_layout()
    return fig


def blocks_by_rank(blocks: Sequence[int], num_heads: int, num_kv_heads: int, tp_size: int,
                   owners: Owners = rank_heads) -> Figure:
    """A block table's physical blocks as every rank holds them: the same block ids on
    each rank, drawn as one strip per KV head; a rank fills only its KV heads' strips."""
    if not blocks:
        raise ValueError("blocks_by_rank needs at least one block")
    fig, axes = plt.subplots(tp_size, 1, figsize=(1.1 * len(blocks) + 1.6,
                                                  (0.28 * num_kv_heads + 0.45) * tp_size + 0.4),
                             squeeze=False)
    for r, ax in enumerate(axes[:, 0]):
        kv = set(owners(num_heads, num_kv_heads, tp_size, r)[1])
        for i, b in enumerate(blocks):
            for h in range(num_kv_heads):
                y = num_kv_heads - 1 - h
                ax.add_patch(Rectangle((i, y * 0.3), 0.9, 0.27, edgecolor="#555555",
                                       facecolor=rank_color(r) if h in kv else EMPTY))
            ax.text(i + 0.45, num_kv_heads * 0.3 + 0.05, f"block {b}", ha="center",
                    va="bottom", fontsize=8)
        ax.text(-0.15, num_kv_heads * 0.15, f"rank {r}\nKV heads {sorted(kv)}", ha="right",
                va="center", fontsize=8)
        ax.set_xlim(-1.5, len(blocks))
        ax.set_ylim(-0.05, num_kv_heads * 0.3 + 0.35)
        ax.axis("off")
    fig.suptitle("one block table, every rank: same block ids, its KV heads' share",
                 fontsize=10)
    fig.tight_layout()
    return fig


def kv_bytes_bars(per_rank: Mapping[str, Sequence[int]], unit: int = 2**20,
                  unit_name: str = "MiB") -> Figure:
    """Bars of the KV bytes each rank holds, one group per configuration (label ->
    bytes of rank 0, rank 1, ...)."""
    if not per_rank:
        raise ValueError("kv_bytes_bars needs at least one configuration")
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(per_rank), 3.0))
    x = 0.0
    ticks, labels = [], []
    for label, values in per_rank.items():
        width = 0.8 / max(1, len(values))
        for r, v in enumerate(values):
            ax.bar(x + r * width, v / unit, width * 0.9, color=rank_color(r))
        ticks.append(x + 0.4 - width / 2)
        labels.append(label)
        x += 1.2
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylabel(f"KV cache per rank ({unit_name})")
    handles = [Rectangle((0, 0), 1, 1, color=rank_color(r))
               for r in range(max(len(v) for v in per_rank.values()))]
    ax.legend(handles, [f"rank {r}" for r in range(len(handles))], fontsize=7, ncol=2,
              frameon=False)
    fig.tight_layout()
    return fig
