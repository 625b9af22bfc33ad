"""Pictures of the serving engine (chapters 06-07), all drawn from recorded stats.

Every function takes what :class:`~paged_lib.engine.EngineStats` recorded (or numbers
computed from it) and returns a matplotlib ``Figure``; nothing here runs a model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

from paged_lib.engine.sequence import EngineStats

WAIT_COLOR, RUN_COLOR, PREEMPT_COLOR, DONE_COLOR = "#D9D9D9", "#4C72B0", "#C44E52", "#55A868"
SYSTEM_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#8172B3"]

#: The boxes of one engine step: (label, what it does, pure Python or tensors).
FLOW = (
    ("LLMEngine.step()", "one iteration", "python"),
    ("Scheduler.schedule()", "who runs; BlockManager\ngives blocks and Slots", "python"),
    ("ModelRunner.execute()", "build_metadata ->\nTinyLlama over the paged cache", "tensors"),
    ("sample()", "greedy / temperature,\none generator per request", "tensors"),
    ("Scheduler.update()", "append tokens,\nfinish and free", "python"),
)


def draw_request_flow() -> Figure:
    """The one-way flow of an engine step, with which parts touch tensors."""
    fig, ax = plt.subplots(figsize=(11, 2.6))
    colors = {"python": "#E8EEF7", "tensors": "#FCE9D9"}
    width, gap = 1.9, 0.35
    for k, (name, what, kind) in enumerate(FLOW):
        x = k * (width + gap)
        ax.add_patch(FancyBboxPatch((x, 0.1), width, 0.8, boxstyle="round,pad=0.03",
                                    fc=colors[kind], ec="#444444"))
        ax.text(x + width / 2, 0.68, name, ha="center", va="center", fontsize=8.5,
                fontweight="bold", family="monospace")
        ax.text(x + width / 2, 0.34, what, ha="center", va="center", fontsize=7.5)
        if k:
            ax.add_patch(FancyArrowPatch((x - gap, 0.5), (x, 0.5), arrowstyle="-|>",
                                         mutation_scale=12, color="#444444"))
    end = len(FLOW) * (width + gap) - gap
    ax.annotate("", xy=(0.3, 0.95), xytext=(end - 0.3, 0.95),
                arrowprops={"arrowstyle": "-|>", "connectionstyle": "arc3,rad=0.08",
                            "color": "#888888"})
    ax.text(end / 2, 1.5, "next step (until every request is finished)", ha="center",
            fontsize=8, color="#666666")
    ax.legend(handles=[Patch(fc=colors["python"], ec="#444444", label="pure Python"),
                       Patch(fc=colors["tensors"], ec="#444444", label="tensors")],
              loc="lower center", bbox_to_anchor=(0.5, -0.28), ncol=2, fontsize=8,
              frameon=False)
    ax.set_xlim(-0.1, end + 0.1)
    ax.set_ylim(-0.05, 1.75)
    ax.axis("off")
    fig.tight_layout()
    return fig


def plot_batching(runs: Mapping[str, EngineStats], title: str = "") -> Figure:
    """Batch size and GPU blocks in use per step, one line per system, same axes."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    pool = 0
    for (name, stats), color in zip(runs.items(), SYSTEM_COLORS, strict=False):
        steps = range(stats.steps)
        top.plot(steps, stats.batch_sizes, color=color, lw=1.2,
                 label=f"{name}: {stats.steps} steps")
        bottom.plot(steps, stats.blocks_used, color=color, lw=1.2, label=name)
        pool = max(pool, stats.num_blocks)
    bottom.axhline(pool, color="#444444", ls="--", lw=1)
    bottom.text(0, pool, f" pool: {pool} blocks", va="bottom", fontsize=8)
    top.set_ylabel("sequences in the batch")
    bottom.set_ylabel("blocks held")
    bottom.set_xlabel("engine step")
    bottom.set_ylim(0, pool * 1.15)
    top.legend(fontsize=8, frameon=False)
    bottom.legend(fontsize=8, frameon=False, loc="lower right")
    if title:
        top.set_title(title)
    fig.tight_layout()
    return fig


def plot_timeline(stats: EngineStats, title: str = "") -> Figure:
    """One row per request: waiting (grey), running (blue), preempted (red tick),
    finished (green dot)."""
    n = len(stats.requests)
    fig, ax = plt.subplots(figsize=(9, max(2.5, 0.12 * n + 1.2)))
    for row, tl in enumerate(stats.requests):
        # a request never admitted (refused) waited until the end
        waits = tl.waiting_intervals() if tl.admitted_steps else [(tl.arrival_step,
                                                                   stats.steps)]
        for a, b in waits:
            ax.barh(row, b - a, left=a, height=0.8, color=WAIT_COLOR)
        for a, b in tl.running_intervals():
            ax.barh(row, b - a, left=a, height=0.8, color=RUN_COLOR)
        for p in tl.preempted_steps:
            ax.plot([p, p], [row - 0.45, row + 0.45], color=PREEMPT_COLOR, lw=1.5)
        if tl.finished_step is not None:
            ax.plot(tl.finished_step + 1, row, "o", color=DONE_COLOR, ms=3)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(0, stats.steps + 1)
    ax.set_xlabel("engine step")
    ax.set_ylabel("request")
    ax.legend(handles=[Patch(color=WAIT_COLOR, label="waiting"),
                       Patch(color=RUN_COLOR, label="running"),
                       Patch(color=PREEMPT_COLOR, label="preempted"),
                       Patch(color=DONE_COLOR, label="finished")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def plot_engine_vs_simulator(engine_blocks: Sequence[int], simulator_blocks: Sequence[int],
                             num_blocks: int) -> Figure:
    """The engine's blocks in use per step over chapter 02's simulator's prediction."""
    fig, ax = plt.subplots(figsize=(9, 2.8))
    ax.plot(range(len(simulator_blocks)), simulator_blocks, color="#DD8452", lw=4,
            alpha=0.5, label="chapter 02 simulator (paged)")
    ax.plot(range(len(engine_blocks)), engine_blocks, color="#4C72B0", lw=1,
            label="engine (stats.blocks_used)")
    ax.axhline(num_blocks, color="#444444", ls="--", lw=1)
    ax.set_xlabel("engine step")
    ax.set_ylabel("blocks held")
    ax.set_ylim(0, num_blocks * 1.15)
    ax.legend(fontsize=8, frameon=False, loc="lower right")
    fig.tight_layout()
    return fig


def plot_preemption_tradeoff(rows: Sequence[Mapping[str, float]]) -> Figure:
    """Per block size: KB a swap moved (left) and tokens a recompute ran again (right).

    ``rows`` hold ``block_size``, ``swapped_bytes``, ``swapped_blocks`` and
    ``recomputed_tokens`` (see :func:`paged_lib.course.demos.engine_compare.preemption_cost`).
    """
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    labels = [str(int(r["block_size"])) for r in rows]
    kb = [r["swapped_bytes"] / 1024 for r in rows]
    bars = left.bar(labels, kb, color="#4C72B0")
    for bar, r in zip(bars, rows, strict=True):
        left.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                  f"{int(r['swapped_blocks'])} copies", ha="center", va="bottom", fontsize=7)
    left.set_title("swap: KV moved GPU <-> CPU", fontsize=10)
    left.set_xlabel("block size (tokens)")
    left.set_ylabel("KB copied")
    right.bar(labels, [r["recomputed_tokens"] for r in rows], color="#DD8452")
    right.set_title("recompute: tokens prefilled again", fontsize=10)
    right.set_xlabel("block size (tokens)")
    right.set_ylabel("tokens")
    fig.tight_layout()
    return fig


#: How chapter 06 names chapter 02's policies on its step chart.
POLICY_LABELS = {"static-max": "static, max-length", "orca-max": "Orca (Max)",
                 "orca-pow2": "Orca (Pow2)", "orca-oracle": "Orca (Oracle)",
                 "paged": "paged (simulator)"}


def plot_policy_steps(steps: Mapping[str, int], engine_steps: int, title: str = "") -> Figure:
    """Steps each of chapter 02's policies needs for one trace (``steps``, from
    :func:`paged_lib.course.demos.engine_compare.policy_steps`) beside the engine's own,
    each labelled with its ratio to the engine's."""
    names = [POLICY_LABELS.get(p, p) for p in steps] + ["paged engine"]
    values = list(steps.values()) + [engine_steps]
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(values) + 1.0))
    colors = ["#BBBBBB"] + ["#DD8452"] * (len(values) - 3) + ["#8172B3", "#4C72B0"]
    bars = ax.barh(range(len(values)), values, color=colors[:len(values)])
    for bar, v in zip(bars, values, strict=True):
        ax.text(v, bar.get_y() + bar.get_height() / 2, f" {v} steps ({v / engine_steps:.1f}x)",
                va="center", fontsize=8)
    ax.set_yticks(range(len(values)), names, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values) * 1.3)
    ax.set_xlabel("steps to serve the whole trace (ratio to the paged engine)")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
