"""Pictures for chapter 02: where the KV memory goes (the paper's Fig. 2 and a memory map).

Every function returns a matplotlib ``Figure``; :func:`breakdown_explorer` is a thin
ipywidgets wrapper over :func:`explorer_view`, which the tests call directly.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from paged_lib.fragmentation import (
    CATEGORIES,
    PAPER_FIG2,
    POLICIES,
    Breakdown,
    Timeline,
    simulate,
)
from paged_lib.workloads import TRACES, Request

COLORS = {"token_states": "#4c9a2a", "reserved": "#f2b134", "internal": "#d1495b",
          "external": "#7d7d9c", "unreported": "#dddddd"}
LABELS = {"token_states": "token states", "reserved": "reserved",
          "internal": "internal fragmentation", "external": "external fragmentation (& others)",
          "unreported": "not broken down in the paper"}


def state_map(timeline: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """(owner, state), both ``[capacity, num_steps]``: the request holding each slot at
    each step (-1: free) and its category: 0 idle, 1 token state, 2 reserved, 3 internal,
    4 external (free while a request waits). Needs a timeline simulated with
    ``record=True``; the image data of :func:`plot_memory_maps`."""
    cells = timeline.capacity * timeline.num_steps
    if cells > 20_000_000:
        raise ValueError(f"state_map is for small traces: {timeline.capacity} slots x "
                         f"{timeline.num_steps} steps is too big")
    owner = np.full((timeline.capacity, timeline.num_steps), -1, dtype=np.int32)
    state = np.zeros((timeline.capacity, timeline.num_steps), dtype=np.int8)
    for t0, t1 in timeline.waiting:
        state[:, t0:t1] = 4
    tokens = {}  # request -> tokens stored at each step (-1: not running)
    for r in timeline.runs:
        row = tokens.setdefault(r.request, np.full(timeline.num_steps, -1, dtype=np.int64))
        row[r.start:r.end] = r.tokens0 + np.arange(r.end - r.start)
    final = {r.request: r.final_len for r in timeline.runs}
    for a in timeline.allocations:
        tok = tokens[a.request][a.start:a.end][None, :]
        pos = (a.logical + np.arange(a.size))[:, None]
        code = np.where(pos < tok, 1, np.where(pos < final[a.request], 2, 3))
        code = np.where(tok < 0, 3, code)  # finished but still held (static batch)
        owner[a.slot:a.slot + a.size, a.start:a.end] = a.request
        state[a.slot:a.slot + a.size, a.start:a.end] = code
    return owner, state


def plot_breakdown(results: Mapping[str, Breakdown],
                   paper: Mapping[str, Mapping[str, float | None]] | None = PAPER_FIG2,
                   title: str = "Where the KV memory goes") -> Figure:
    """Stacked bars of the four shares per policy; beside each, the paper's Fig. 2 bar when
    ``paper`` has one (pass ``paper=None`` for ours only)."""
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(results) + 2), 4.2))
    x, ticks, names = 0.0, [], []
    for name, b in results.items():
        bars = [("ours", dict(zip(CATEGORIES, b, strict=True)), 1.0)]
        if paper is not None and name in paper:
            bars.append(("paper", dict(paper[name]), 0.55))
        for label, shares, alpha in bars:
            bottom = 0.0
            for cat in CATEGORIES:
                v = shares.get(cat) or 0.0
                ax.bar(x, v, bottom=bottom, color=COLORS[cat], alpha=alpha, width=0.8,
                       edgecolor="white")
                bottom += v
            if bottom < 0.99:  # the paper gives only part of this bar
                ax.bar(x, 1 - bottom, bottom=bottom, color=COLORS["unreported"], width=0.8,
                       edgecolor="white")
            ts = shares["token_states"]
            ax.text(x, ts / 2, f"{ts:.0%}", ha="center", va="center", fontsize=8,
                    color="white", fontweight="bold")
            ticks.append(x)
            names.append(name if label == "ours" else "paper")
            x += 1.0
        x += 0.4
    ax.set_xticks(ticks, names, fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of KV memory")
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
    cats = list(CATEGORIES) + (["unreported"] if paper is not None else [])
    ax.legend(handles=[Patch(color=COLORS[c], label=LABELS[c]) for c in cats],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def plot_trace_lengths(traces: Mapping[str, Sequence[Request]]) -> Figure:
    """Histograms (log x) of prompt and output lengths of each trace, means marked."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=False)
    bins = np.logspace(0, np.log10(2048), 40)
    for k, (what, attr) in enumerate((("prompt", "prompt_len"), ("output", "output_len"))):
        ax = axes[k]
        for name, reqs in traces.items():
            vals = np.array([getattr(r, attr) for r in reqs])
            (line,) = ax.plot([], [])
            ax.hist(vals, bins=bins, alpha=0.5, color=line.get_color(),
                    label=f"{name} (mean {vals.mean():.0f})")
            ax.axvline(vals.mean(), color=line.get_color(), ls="--", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel(f"{what} length (tokens)")
        ax.set_ylabel("requests")
        ax.legend(fontsize=8, frameon=False)
    fig.suptitle("Synthetic traces (lognormal, clipped)")
    fig.tight_layout()
    return fig


def memory_map_image(timeline: Timeline) -> np.ndarray:
    """RGB image ``[slots, steps, 3]`` of a recorded timeline: colour = owner request; full
    colour = token states, light tint = reserved, stripes = internal fragmentation, pale
    violet = external (free while a request waits), white = idle."""
    owner, state = state_map(timeline)
    cmap = plt.get_cmap("tab10")
    colour = np.array([cmap(i % 10)[:3] for i in range(max(int(owner.max()) + 1, 1))])
    rgb = np.ones(owner.shape + (3,))
    own = np.clip(owner, 0, None)
    base = colour[own]
    rgb[state == 1] = base[state == 1]
    rgb[state == 2] = 0.35 * base[state == 2] + 0.65
    slots, steps = np.indices(owner.shape)
    u, v = slots / owner.shape[0], steps / max(owner.shape[1], 1)
    stripe = np.floor((u + v) * 40).astype(np.int64) % 2 == 0  # diagonal in the picture
    internal = state == 3
    rgb[internal & stripe] = 0.8 * base[internal & stripe] + 0.2 * 0.3
    rgb[internal & ~stripe] = 0.9
    rgb[state == 4] = np.array([0.86, 0.84, 0.95])
    return rgb


def plot_memory_maps(timelines: Mapping[str, Timeline]) -> Figure:
    """Side-by-side memory maps (x = step, y = slot address) of recorded timelines."""
    fig, axes = plt.subplots(1, len(timelines), figsize=(5.2 * len(timelines), 4.2),
                             squeeze=False)
    for ax, (name, timeline) in zip(axes[0], timelines.items(), strict=True):
        ax.imshow(memory_map_image(timeline), aspect="auto", interpolation="nearest",
                  origin="lower", extent=(0, timeline.num_steps, 0, timeline.capacity))
        b = timeline.breakdown
        ax.set_title(f"{name}: {b.token_states:.0%} token states", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("slot address")
    handles = [Patch(facecolor="#4c72b0", label="token states"),
               Patch(facecolor=0.35 * np.array([0.30, 0.45, 0.69]) + 0.65, label="reserved"),
               Patch(facecolor="0.9", edgecolor="#4c72b0", hatch="///",
                     label="internal fragmentation"),
               Patch(facecolor=(0.86, 0.84, 0.95), label="external (free, request waiting)"),
               Patch(facecolor="white", edgecolor="0.7", label="idle")]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


@functools.lru_cache(maxsize=8)
def _trace(name: str, num_requests: int, seed: int) -> tuple[Request, ...]:
    return tuple(TRACES[name](num_requests, seed=seed))


def explorer_view(policy: str = "paged", block_size: int = 16, capacity_tokens: int = 21_048,
                  trace: str = "sharegpt", num_requests: int = 600, seed: int = 0) -> Figure:
    """One policy's breakdown on a synthetic trace, beside the paper's bar when it has one."""
    if trace not in TRACES:
        raise ValueError(f"unknown trace {trace!r}; choose one of {tuple(TRACES)}")
    b = simulate(_trace(trace, num_requests, seed), policy, capacity_tokens, block_size)
    shares = ", ".join(f"{LABELS[c].split(' (')[0]} {v:.1%}"
                       for c, v in zip(CATEGORIES, b, strict=True))
    return plot_breakdown({policy: b}, PAPER_FIG2 if trace == "sharegpt" else None,
                          title=f"{trace}, {capacity_tokens:,} slots, block {block_size}:\n"
                                f"{shares}")


def breakdown_explorer():  # pragma: no cover - interactive; explorer_view is tested
    """Widget: pick policy, block size, capacity and trace; see the breakdown."""
    import ipywidgets as w
    from IPython.display import display

    def show(policy, block_size, capacity_tokens, trace):
        try:  # show the figure inside the widget, then close it so it is not shown twice
            fig = explorer_view(policy, block_size, capacity_tokens, trace)
            display(fig)
            plt.close(fig)
        except ValueError as err:
            print(f"cannot simulate: {err}")

    return w.interactive(
        show,
        policy=w.Dropdown(options=POLICIES, value="paged"),
        block_size=w.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128, 256], value=16),
        # 21,048 slots: OPT-13B on a 40 GB A100, the paper's setting (chapter 02)
        capacity_tokens=w.IntSlider(value=21_048, min=1_048, max=101_048, step=2_000,
                                    continuous_update=False),
        trace=w.Dropdown(options=tuple(TRACES), value="sharegpt"),
    )
