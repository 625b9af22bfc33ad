"""Pictures of prefix caching (chapter 10): the hash chain over prompts' blocks, the LRU
free queue through vLLM's worked example, a radix tree, hit rates per workload, and a
decode-stall timeline with and without chunked prefill.

Every function takes recorded data (the demos in :mod:`paged_lib.course.demos.prefix_cache`,
a :class:`~paged_lib.studies.radix_tree.RadixTree`, numbers a comparison computed) and returns a
matplotlib ``Figure``; the tests call them directly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from paged_lib.course.demos.prefix_cache import ChainBlock, Frame

HIT_COLOR, COMPUTED_COLOR, PARTIAL_COLOR = "#55A868", "#4C72B0", "#DDDDDD"
CACHED_COLOR, FREE_COLOR, EVICT_COLOR = "#F0B35A", "#EEEEEE", "#C44E52"
PREFILL_COLOR, DECODE_COLOR = "#DD8452", "#4C72B0"


def _label(tokens: Sequence[int], decode: Callable[[Sequence[int]], str] | None) -> str:
    if decode is not None:
        return repr(decode(tokens))[1:-1]
    return " ".join(map(str, tokens))


def draw_hash_chain(rows: Mapping[str, Sequence[ChainBlock]],
                    decode: Callable[[Sequence[int]], str] | None = None,
                    title: str = "") -> Figure:
    """Each prompt's blocks left to right, chained by their hashes, with the physical
    block each maps to: green blocks were read from the cache (the same physical block
    as an earlier prompt's), blue ones computed, grey part-filled ones never hashed."""
    if not rows:
        raise ValueError("draw_hash_chain needs at least one prompt")
    width = max(len(r) for r in rows.values())
    fig, ax = plt.subplots(figsize=(2.3 * width + 1.5, 1.25 * len(rows) + 0.8))
    for r, (name, blocks) in enumerate(rows.items()):
        y = len(rows) - 1 - r
        ax.text(-0.15, y + 0.35, name, ha="right", va="center", fontsize=10)
        for i, b in enumerate(blocks):
            color = PARTIAL_COLOR if b.hash_value is None else \
                HIT_COLOR if b.hit else COMPUTED_COLOR
            ax.add_patch(Rectangle((i * 2.3, y), 1.9, 0.7, facecolor=color,
                                   edgecolor="#333333", alpha=0.85,
                                   linestyle="--" if b.hash_value is None else "-"))
            ax.text(i * 2.3 + 0.95, y + 0.5, _label(b.tokens, decode), ha="center",
                    va="center", fontsize=7, family="monospace")
            tag = "no hash (partial)" if b.hash_value is None else f"#{b.hash_value:016x}"[:7]
            ax.text(i * 2.3 + 0.95, y + 0.18, f"{tag}  -> block {b.physical}", ha="center",
                    va="center", fontsize=7, color="white" if b.hash_value else "#333333")
            if i:
                ax.add_patch(FancyArrowPatch((i * 2.3 - 0.4, y + 0.35), (i * 2.3, y + 0.35),
                                             arrowstyle="->", mutation_scale=10))
    handles = [Rectangle((0, 0), 1, 1, facecolor=c, alpha=0.85) for c in
               (HIT_COLOR, COMPUTED_COLOR, PARTIAL_COLOR)]
    ax.legend(handles, ["cache hit (shared block)", "computed, then cached",
                        "part-filled: never hashed"], loc="upper center",
              bbox_to_anchor=(0.5, -0.02), ncol=3, fontsize=8, frameon=False)
    ax.set_xlim(-2.2, width * 2.3)
    ax.set_ylim(-0.4, len(rows))
    ax.axis("off")
    ax.set_title(title or "each block's hash chains on its parent's: equal prefixes, "
                 "equal hashes, one physical block", fontsize=10)
    fig.tight_layout()
    return fig


def draw_free_queue(frames: Sequence[Frame]) -> Figure:
    """The free queue head (left, evicted first) to tail at each step of the worked
    example: orange blocks still hold a hash (a later hit can take them back), grey ones
    hold nothing; on the right, the live requests' tables, the step's hits and evictions."""
    if not frames:
        raise ValueError("draw_free_queue needs at least one frame")
    n = max(len(f.free_queue) for f in frames) or 1
    fig, ax = plt.subplots(figsize=(13, 0.95 * len(frames) + 0.6))
    for r, f in enumerate(frames):
        y = len(frames) - 1 - r
        ax.text(0, y + 0.72, f.title, fontsize=8.5, va="bottom")
        ax.text(-0.2, y + 0.3, "head", ha="right", va="center", fontsize=7, color="#666666")
        for i, block in enumerate(f.free_queue):
            cached = block in f.cached
            ax.add_patch(Rectangle((i * 0.62, y), 0.55, 0.6, edgecolor="#333333",
                                   facecolor=CACHED_COLOR if cached else FREE_COLOR))
            ax.text(i * 0.62 + 0.275, y + 0.3, str(block), ha="center", va="center",
                    fontsize=9)
        ax.text(len(f.free_queue) * 0.62 + 0.05, y + 0.3, "tail", va="center", fontsize=7,
                color="#666666")
        notes = [f"{name}: {blocks}" for name, blocks in f.tables.items()]
        notes += [f"hit {blocks}" for blocks in f.hits.values() if blocks]
        if f.evicted:
            notes.append(f"evicted {f.evicted}")
        ax.text(n * 0.62 + 0.8, y + 0.3, "   ".join(notes) or "no live request",
                va="center", fontsize=8,
                color=EVICT_COLOR if f.evicted else "#222222")
    handles = [Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="#333333")
               for c in (CACHED_COLOR, FREE_COLOR)]
    ax.legend(handles, ["free, still cached (its hash kept)", "free, empty"],
              loc="upper center", bbox_to_anchor=(0.3, -0.0), ncol=2, fontsize=8,
              frameon=False)
    ax.set_xlim(-0.8, n * 0.62 + 8.5)
    ax.set_ylim(-0.3, len(frames))
    ax.axis("off")
    fig.tight_layout()
    return fig


def _tree_layout(tree) -> tuple[dict[int, tuple[float, float]], list]:
    """x = depth, y = leaf order (a parent sits at the middle of its children)."""
    pos: dict[int, tuple[float, float]] = {}
    nodes = []
    next_leaf = [0.0]

    def place(node, depth: int) -> float:
        nodes.append(node)
        kids = sorted(node.children.values(), key=lambda c: c.key)
        if not kids:
            y = next_leaf[0]
            next_leaf[0] += 1
        else:
            ys = [place(c, depth + 1) for c in kids]
            y = (min(ys) + max(ys)) / 2
        pos[node.id] = (depth, y)
        return y

    place(tree.root, 0)
    return pos, nodes


def draw_radix_tree(tree, decode: Callable[[Sequence[int]], str] | None = None,
                    title: str = "") -> Figure:
    """A :class:`~paged_lib.studies.radix_tree.RadixTree`: each node is the run of tokens on the
    edge into it (decoded by ``decode`` if given) with its lock count; locked nodes (a
    running request holds them) are orange, evictable ones grey."""
    pos, nodes = _tree_layout(tree)
    depth = max(x for x, _ in pos.values())
    leaves = max(y for _, y in pos.values()) + 1
    fig, ax = plt.subplots(figsize=(3.0 * depth + 2.5, 0.8 * leaves + 1.0))
    for node in nodes:
        x, y = pos[node.id]
        if node.parent is not None:
            px, py = pos[node.parent.id]
            ax.plot([px * 3 + 1.1, x * 3], [py, y], color="#888888", lw=1, zorder=1)
        if node is tree.root:
            ax.text(x * 3 + 0.55, y, "root", ha="center", va="center", fontsize=9,
                    bbox=dict(boxstyle="round", facecolor="white"))
            continue
        text = _label(node.key, decode)
        text = text if len(text) <= 22 else text[:20] + "..."
        ax.text(x * 3 + 0.05, y, f"{text}\n{len(node.key)} tok, lock {node.lock_ref}",
                ha="left", va="center", fontsize=7.5, family="monospace", zorder=2,
                bbox=dict(boxstyle="round", edgecolor="#333333",
                          facecolor=CACHED_COLOR if node.lock_ref else FREE_COLOR))
    ax.set_xlim(-0.3, 3 * depth + 2.6)
    ax.set_ylim(-0.7, leaves - 0.3)
    ax.invert_yaxis()
    ax.axis("off")
    ax.set_title(title or "radix tree: shared prefixes are shared nodes", fontsize=10)
    fig.tight_layout()
    return fig


def plot_prefix_savings(hit_rate: Mapping[str, Mapping[str, float]],
                        prefill_saved: Mapping[str, Mapping[str, float]],
                        title: str = "") -> Figure:
    """Two bar charts per workload: the share of prompt tokens served from the cache,
    and the prefill tokens that were not computed, one bar per cache design."""
    workloads = list(hit_rate)
    if not workloads:
        raise ValueError("plot_prefix_savings needs at least one workload")
    methods = list(next(iter(hit_rate.values())))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    w = 0.8 / max(len(methods), 1)
    colors = [COMPUTED_COLOR, HIT_COLOR, CACHED_COLOR, EVICT_COLOR]
    for ax, data, label in ((axes[0], hit_rate, "prompt tokens from the cache"),
                            (axes[1], prefill_saved, "prefill tokens saved")):
        for k, m in enumerate(methods):
            xs = [i + (k - (len(methods) - 1) / 2) * w for i in range(len(workloads))]
            vals = [data[wl][m] for wl in workloads]
            bars = ax.bar(xs, vals, w, label=m, color=colors[k % len(colors)])
            fmt = "{:.0%}" if data is hit_rate else "{:,.0f}"
            for b, v in zip(bars, vals, strict=True):
                ax.text(b.get_x() + b.get_width() / 2, b.get_height(), fmt.format(v),
                        ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(workloads)), workloads, fontsize=8)
        ax.set_ylabel(label)
        if data is hit_rate:
            ax.set_ylim(0, 1.1)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "prefix caching per workload", fontsize=10)
    fig.tight_layout()
    return fig


def plot_decode_stalls(runs: Mapping[str, Sequence[tuple[int, int, int]]],
                       title: str = "") -> Figure:
    """One timeline per run, from ``(prefill tokens, decode tokens, stalled requests)``
    per engine step: tokens computed, prefill (orange) and decode (blue) stacked; a red
    mark under a step where requests that were decoding got no token (they waited for a
    prefill)."""
    if not runs:
        raise ValueError("plot_decode_stalls needs at least one run")
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.2 * len(runs) + 0.4),
                             sharex=True, squeeze=False)
    for ax, (name, steps) in zip(axes[:, 0], runs.items(), strict=True):
        if not steps:
            raise ValueError(f"run {name!r} has no steps")
        prefill, decode, stalled = (list(col) for col in zip(*steps, strict=True))
        xs = range(len(steps))
        ax.bar(xs, prefill, 1.0, color=PREFILL_COLOR, label="prefill tokens")
        ax.bar(xs, decode, 1.0, bottom=prefill, color=DECODE_COLOR, label="decode tokens")
        stalls = [s for s in xs if stalled[s] > 0]
        top = max(p + d for p, d in zip(prefill, decode, strict=True)) or 1
        ax.scatter(stalls, [-0.06 * top] * len(stalls), marker="|", color=EVICT_COLOR,
                   s=60, label="decodes stalled")
        ax.set_ylabel("tokens")
        ax.set_title(f"{name}: {len(steps)} steps, {len(stalls)} with decodes stalled "
                     f"({sum(stalled)} request-steps)", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("engine step")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_chat_hits(turns: Sequence, title: str = "") -> Figure:
    """One stacked bar per request of a chat workload
    (:func:`paged_lib.studies.chat_prefix.serve_chat`'s :class:`ChatTurn` list), grouped by
    turn: prompt tokens read from the cache within the system prompt, beyond it (the
    conversation's history), and computed."""
    if not turns:
        raise ValueError("plot_chat_hits needs at least one turn")
    fig, ax = plt.subplots(figsize=(10, 3.4))
    n_conv = max(t.conversation for t in turns) + 1
    xs, labels = [], []
    for t in turns:
        x = t.turn * (n_conv + 1) + t.conversation
        system = t.system_hit
        parts = ((system, "#2E7D4F", "hit: system prompt"),
                 (t.hit_tokens - system, HIT_COLOR, "hit: the conversation's history"),
                 (t.prompt_tokens - t.hit_tokens, COMPUTED_COLOR, "computed"))
        bottom = 0
        for value, color, label in parts:
            ax.bar(x, value, 0.85, bottom=bottom, color=color,
                   label=label if not xs else None)
            bottom += value
        xs.append(x)
        labels.append(f"c{t.conversation}")
    ax.set_xticks(xs, labels, fontsize=7)
    turns_seen = sorted({t.turn for t in turns})
    for k in turns_seen:
        ax.text(k * (n_conv + 1) + (n_conv - 1) / 2, -0.16, f"turn {k + 1}", ha="center",
                transform=ax.get_xaxis_transform(), fontsize=9)
    ax.set_ylabel("prompt tokens")
    ax.legend(fontsize=8, loc="upper left", frameon=False)
    ax.set_title(title or "prompt tokens per request", fontsize=10)
    fig.tight_layout()
    return fig


def plot_ttft(runs: Mapping, requests: Sequence[int], title: str = "") -> Figure:
    """Chunked prefill's trade-off, from :func:`paged_lib.studies.chunked_ttft.measure_ttft`:
    per configuration, the mean time to first token of ``requests`` (the long prompts) and
    the largest step, in engine steps and tokens (left) and in wall-clock milliseconds
    (right: this machine's, noisy)."""
    if not runs:
        raise ValueError("plot_ttft needs at least one run")
    names = list(runs)
    xs = range(len(names))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.4))
    left.bar(xs, [runs[n].mean_ttft_steps(requests) for n in names], 0.6,
             color=PREFILL_COLOR)
    left.set_ylabel("time to first token (steps)", color=PREFILL_COLOR)
    tokens = left.twinx()
    tokens.plot(xs, [runs[n].max_step_tokens for n in names], "o-", color=DECODE_COLOR)
    tokens.set_ylabel("most tokens in one step", color=DECODE_COLOR)
    tokens.set_ylim(0, None)
    right.bar(xs, [1000 * runs[n].mean_ttft_seconds(requests) for n in names], 0.6,
              color=PREFILL_COLOR)
    right.set_ylabel("time to first token (ms)", color=PREFILL_COLOR)
    longest = right.twinx()
    longest.plot(xs, [1000 * max(runs[n].step_seconds) for n in names], "o-",
                 color=DECODE_COLOR)
    longest.set_ylabel("longest step (ms)", color=DECODE_COLOR)
    longest.set_ylim(0, None)
    for ax, what in ((left, "engine steps"), (right, "wall clock, this machine")):
        ax.set_xticks(xs, names, fontsize=8, rotation=20)
        ax.set_title(what, fontsize=9)
    fig.suptitle(title or "chunked prefill: the long prompts' first token", fontsize=10)
    fig.tight_layout()
    return fig
