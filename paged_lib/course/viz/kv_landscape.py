"""Pictures for chapter 11 (the KV landscape). Every plot returns a Figure.

* :func:`bytes_per_token_bars`: each model's KV bytes per token as built, beside what the
  same model would cache as plain multi-head attention (one KV head per query head);
* :func:`levels_bars`: a deployment's KV memory after each level of saving, stacked up;
* :func:`block_grid`: a sequence's blocks, each kept (a sink, the window) or freed;
  :func:`window_block_states` says which, for the engine's window with sinks;
* :func:`memory_curves`: blocks (or bytes) held against tokens, one line per setting;
* :func:`grouped_bars`: one group of bars per setting (errors of quantisation schemes);
* :func:`claims_table`: the claims checked in the chapter, as a Markdown table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from paged_lib.accounting import KiB, ModelSpec, get_spec, kv_bytes_per_token, mha_equivalent
from paged_lib.course.viz.accounting import KIND_COLORS as _KINDS
from paged_lib.engine.window import kept_tokens
from paged_lib.util import cdiv

KIND_COLORS = {**_KINDS, "MLA": "#8172b3"}
MHA_COLOR = "#d9d9d9"
BLOCK_COLORS = {"sink": "#c44e52", "window": "#4c72b0", "freed": "#eeeeee",
                "empty": "#ffffff"}


def bytes_per_token_bars(models: Sequence[str | ModelSpec], dtype: str | int = "fp16",
                         per_token: Callable[[ModelSpec], int] = kv_bytes_per_token) -> Figure:
    """Grouped bars, log scale: KiB per token as the model is built (coloured by MHA /
    GQA / MQA / MLA) and as the same model with one KV head per query head (grey).

    ``per_token`` computes the bytes (a learner's own function can draw the chart)."""
    specs = [get_spec(m).with_dtype(dtype) for m in models]
    if not specs:
        raise ValueError("no models to draw")
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.4
    for i, s in enumerate(specs):
        built, mha = per_token(s) / KiB, per_token(mha_equivalent(s)) / KiB
        ax.bar(i - width / 2, mha, width, color=MHA_COLOR, edgecolor="#999999")
        ax.bar(i + width / 2, built, width, color=KIND_COLORS[s.attention])
        ax.annotate(f"{built:,.3g}", (i + width / 2, built), ha="center", va="bottom",
                    fontsize=7)
        if mha != built:
            ax.annotate(f"{mha / built:.3g}x", (i - width / 2, mha), ha="center",
                        va="bottom", fontsize=7, color="#555555")
    ax.set_yscale("log")
    ax.set_xticks(range(len(specs)), [s.name for s in specs], rotation=30, ha="right",
                  fontsize=8)
    ax.set_ylabel("KV cache per token (KiB, log scale)")
    kinds = sorted({s.attention for s in specs}, key=list(KIND_COLORS).index)
    ax.legend(handles=[Patch(color=MHA_COLOR, label="same model as MHA")]
              + [Patch(color=KIND_COLORS[k], label=f"as built: {k}") for k in kinds],
              fontsize=8, loc="upper left", ncols=2)
    ax.set_ylim(top=ax.get_ylim()[1] * 8)  # room for the legend above the tallest bar
    ax.set_title(f"KV bytes per token ({dtype if isinstance(dtype, str) else f'{dtype} B'} "
                 "per value); grey label: what the attention design saves")
    fig.tight_layout()
    return fig


def levels_bars(levels: Mapping[str, int], title: str = "") -> Figure:
    """One bar per level of saving, in order (the first is the baseline), in GiB on a log
    scale, each labelled with how many times smaller than the baseline it is."""
    if not levels:
        raise ValueError("no levels to draw")
    names, values = list(levels), [v / 2**30 for v in levels.values()]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    colors = ["#9a9a9a", "#dd8452", "#55a868", "#4c72b0", "#8172b3", "#c44e52"]
    bars = ax.bar(range(len(names)), values, color=colors[:len(names)] * 2)
    for bar, v in zip(bars, values, strict=True):
        label = f"{v:,.3g} GiB" + (f"\n{values[0] / v:,.3g}x less" if v and v != values[0]
                                   else "")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, v), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("KV memory (GiB, log scale)")
    positive = [v for v in values if v > 0] or [1.0]
    ax.set_ylim(min(positive) / 3, max(positive) * 6)
    ax.set_title(title or "KV memory after each level of saving", fontsize=10)
    fig.tight_layout()
    return fig


def block_grid(rows: Mapping[str, Sequence[str]], block_size: int,
               title: str = "") -> Figure:
    """One row of boxes per sequence: each box a block, coloured by its state
    (``"sink"``, ``"window"``, ``"freed"``, or ``"empty"`` for no block), numbered by its
    logical index; the caption counts kept and freed blocks."""
    if not rows:
        raise ValueError("no rows to draw")
    for name, states in rows.items():
        bad = [s for s in states if s not in BLOCK_COLORS]
        if bad:
            raise ValueError(f"row {name!r}: unknown block state {bad[0]!r}; known: "
                             f"{', '.join(BLOCK_COLORS)}")
    width = max(len(s) for s in rows.values())
    fig, ax = plt.subplots(figsize=(min(14, 1.2 + 0.42 * width), 0.55 * len(rows) + 1.1))
    for y, states in enumerate(rows.values()):
        for x, state in enumerate(states):
            ax.add_patch(Rectangle((x, -y), 0.92, 0.8, facecolor=BLOCK_COLORS[state],
                                   edgecolor="#666666", linewidth=0.6))
            if state != "empty":
                ax.text(x + 0.46, -y + 0.4, str(x), ha="center", va="center", fontsize=6,
                        color="white" if state in ("sink", "window") else "#777777")
        kept = sum(s in ("sink", "window") for s in states)
        ax.text(width + 0.3, -y + 0.4, f"{kept} kept, {states.count('freed')} freed",
                va="center", fontsize=8)
    ax.set_yticks([-y + 0.4 for y in range(len(rows))], list(rows), fontsize=8)
    ax.set_xlim(-0.2, width + 4.5)
    ax.set_ylim(-len(rows) + 0.7, 1.0)
    ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.legend(handles=[Patch(facecolor=BLOCK_COLORS[s], edgecolor="#666666", label=s)
                       for s in ("sink", "window", "freed")], fontsize=8,
              loc="upper right", ncols=3, bbox_to_anchor=(1, 1.35 + 0.15 / len(rows)))
    ax.set_title(title or f"blocks of {block_size} tokens", fontsize=10, loc="left")
    fig.tight_layout()
    return fig


def window_block_states(num_tokens: int, window: int, num_sink_tokens: int,
                        block_size: int) -> list[str]:
    """The stream's first ``num_tokens`` tokens cut into blocks of ``block_size``, each
    ``"sink"`` (it holds a kept sink), ``"window"`` (it holds kept recent tokens) or
    ``"freed"`` (none of its tokens is in the cache), for
    :func:`paged_lib.engine.window.kept_tokens`."""
    kept = set(kept_tokens(num_tokens, window, num_sink_tokens, block_size))
    states = []
    for b in range(cdiv(num_tokens, block_size)):
        ids = range(b * block_size, min(num_tokens, (b + 1) * block_size))
        if any(t in kept and t < num_sink_tokens for t in ids):
            states.append("sink")
        else:
            states.append("window" if any(t in kept for t in ids) else "freed")
    return states


def memory_curves(curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
                  xlabel: str = "tokens in the sequence", ylabel: str = "blocks held",
                  title: str = "") -> Figure:
    """One line per setting: ``curves[name] = (xs, ys)``."""
    if not curves:
        raise ValueError("no curves to draw")
    fig, ax = plt.subplots(figsize=(7, 3.6))
    styles = ["-", "--", ":", "-."]
    for i, (name, (xs, ys)) in enumerate(curves.items()):
        if len(xs) != len(ys):
            raise ValueError(f"curve {name!r}: {len(xs)} x values but {len(ys)} y values")
        ax.plot(xs, ys, styles[i % len(styles)], label=name, linewidth=1.6)
    if all(float(y).is_integer() for _, ys in curves.values() for y in ys):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts: whole ticks
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def grouped_bars(groups: Mapping[str, Mapping[str, float]], ylabel: str, title: str = "",
                 log: bool = True) -> Figure:
    """``groups[group][series] = value``: one group of bars per ``group``, one colour per
    ``series`` (every group must have the same series, in the same order)."""
    if not groups:
        raise ValueError("no groups to draw")
    series = list(next(iter(groups.values())))
    for name, values in groups.items():
        if list(values) != series:
            raise ValueError(f"group {name!r} has series {list(values)}, expected {series}")
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(series)
    colors = ["#4c72b0", "#a1c9f4", "#dd8452", "#ffb482", "#55a868", "#8de5a1"]
    for j, name in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, [g[name] for g in groups.values()], width, label=name,
               color=colors[j % len(colors)])
    ax.set_xticks(range(len(groups)), list(groups), fontsize=9)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, ncols=2)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def claims_table(rows: Sequence[tuple[str, str, str]]) -> str:
    """A Markdown table: the claim (quoted), what the course measured or derived, where."""
    if not rows:
        raise ValueError("no claims")
    out = ["| the article says | what the course finds | shown in |", "|---|---|---|"]
    for claim, finding, where in rows:
        cells = [c.replace("|", "\\|").replace("\n", " ") for c in (claim, finding, where)]
        out.append(f"| \"{cells[0]}\" | {cells[1]} | {cells[2]} |")
    return "\n".join(out)
