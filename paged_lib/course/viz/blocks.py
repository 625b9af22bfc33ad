"""Pictures of block tables: logical blocks on the left, the physical pool on the right.

Drawing works on a :class:`PoolState` snapshot, not on live objects, so a scripted
scenario (:func:`grow_requests`) can record every step and a widget (:func:`stepper`)
can replay them; the tests call both functions directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from paged_lib.blocks import BlockAllocator, BlockTable, OutOfBlocks
from paged_lib.course.viz.widgets import frame_player
from paged_lib.util import cdiv

COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3"]
FREE_COLOR = "#EEEEEE"
BLOCK_W, BLOCK_H, GAP = 1.0, 0.55, 0.35


@dataclass(frozen=True)
class PoolState:
    """Everything a picture of the pool needs, copied out of the live objects."""

    num_blocks: int
    block_size: int
    tables: dict[str, tuple[list[int], int]]  # request name -> (blocks, num_tokens)
    ref_counts: list[int]
    free_block_ids: list[int]
    caption: str = ""
    highlight: set[int] = field(default_factory=set)  # physical blocks touched this step
    order: tuple[str, ...] = ()  # row order and colours, incl. requests without a table


def _names(state: PoolState) -> tuple[str, ...]:
    return state.order or tuple(state.tables)


def snapshot(tables: dict[str, BlockTable], allocator: BlockAllocator, caption: str = "",
             highlight: set[int] | None = None, order: tuple[str, ...] = ()) -> PoolState:
    """Copy the state of live tables (by request name) and their allocator.

    ``order`` fixes rows and colours across a scenario, so a request keeps its colour
    while others come and go.
    """
    sizes = {t.block_size for t in tables.values()} or {1}
    if len(sizes) != 1:
        raise ValueError(f"tables in one pool must share a block size, got {sorted(sizes)}")
    return PoolState(allocator.num_blocks, sizes.pop(),
                     {name: (t.blocks, t.num_tokens) for name, t in tables.items()},
                     list(allocator.ref_counts), list(allocator.free_block_ids),
                     caption, set(highlight or ()), tuple(order))


def block_fills(state: PoolState) -> dict[int, int]:
    """Filled slots of every physical block in use (all holders of a block agree)."""
    fills: dict[int, int] = {}
    for blocks, n in state.tables.values():
        for j, b in enumerate(blocks):
            fills[b] = min(state.block_size, n - j * state.block_size)
    return fills


def draw_block_tables(tables: dict[str, BlockTable], allocator: BlockAllocator,
                      title: str = "") -> Figure:
    """Draw live tables and their pool (see :func:`draw_pool`)."""
    return draw_pool(snapshot(tables, allocator, title))


def draw_pool(state: PoolState, pool_columns: int = 8) -> Figure:
    """Logical blocks per request (left), physical pool (right), one arrow per mapping.

    Filled token slots are coloured by request; a shared physical block is hatched
    and shows its reference count; free blocks are grey, and the free list is printed
    in the order ``allocate`` will hand blocks out.
    """
    rows = max(len(_names(state)), cdiv(state.num_blocks, pool_columns))
    width = _left_width(state) + 1.5 + min(pool_columns, state.num_blocks) * (BLOCK_W + GAP)
    fig, ax = plt.subplots(figsize=(0.62 * width + 0.6, 0.75 * rows + 1.2))
    _draw(ax, state, pool_columns)
    fig.tight_layout()
    return fig


def draw_frames(states: list[PoolState], pool_columns: int = 8) -> Figure:
    """Several states stacked top to bottom (a static strip of a scenario)."""
    first = states[0]
    rows = max(max(len(_names(s)) for s in states), cdiv(first.num_blocks, pool_columns))
    width = max(_left_width(s) for s in states) + 1.5 + \
        min(pool_columns, first.num_blocks) * (BLOCK_W + GAP)
    fig, axes = plt.subplots(len(states), 1, squeeze=False,
                             figsize=(0.62 * width + 0.6, (0.75 * rows + 1.0) * len(states)))
    for ax, state in zip(axes[:, 0], states, strict=True):
        _draw(ax, state, pool_columns, left_width=max(_left_width(s) for s in states))
    fig.tight_layout()
    return fig


def _left_width(state: PoolState) -> float:
    most = max((len(b) for b, _ in state.tables.values()), default=0)
    return 1.6 + max(most, 1) * (BLOCK_W + GAP)


def _slots(ax, x: float, y: float, filled: int, block_size: int, color: str,
           hatch: str | None = None, edge: str = "black", lw: float = 1.0) -> None:
    """One block as ``block_size`` slot stripes, the first ``filled`` coloured."""
    ax.add_patch(Rectangle((x, y), BLOCK_W, BLOCK_H, facecolor=FREE_COLOR, edgecolor="none"))
    if filled:
        ax.add_patch(Rectangle((x, y), BLOCK_W * filled / block_size, BLOCK_H,
                               facecolor=color, edgecolor="none", hatch=hatch))
    if block_size <= 32:
        for k in range(1, block_size):
            xs = x + BLOCK_W * k / block_size
            ax.plot([xs, xs], [y, y + BLOCK_H], color="white", lw=0.5)
    ax.add_patch(Rectangle((x, y), BLOCK_W, BLOCK_H, fill=False, edgecolor=edge, lw=lw))


def _draw(ax, state: PoolState, pool_columns: int, left_width: float | None = None) -> None:
    bs = state.block_size
    names = _names(state)
    colors = {name: COLORS[i % len(COLORS)] for i, name in enumerate(names)}
    owners: dict[int, list[str]] = {}
    for name, (blocks, _) in state.tables.items():
        for b in blocks:
            owners.setdefault(b, []).append(name)
    fills = block_fills(state)
    left_width = _left_width(state) if left_width is None else left_width
    x_pool = left_width + 1.5

    # Physical pool, right.
    where: dict[int, tuple[float, float]] = {}
    for b in range(state.num_blocks):
        x = x_pool + (b % pool_columns) * (BLOCK_W + GAP)
        y = -(b // pool_columns) * (BLOCK_H + 0.45)
        where[b] = (x, y)
        held = owners.get(b, [])
        shared = state.ref_counts[b] > 1
        touched = b in state.highlight
        _slots(ax, x, y, fills.get(b, 0), bs, colors[held[0]] if held else FREE_COLOR,
               hatch="///" if shared else None, edge="red" if touched else "black",
               lw=2.5 if touched else 1.0)
        ax.text(x + BLOCK_W / 2, y + BLOCK_H + 0.05, f"#{b}", ha="center", va="bottom",
                fontsize=8, fontweight="bold" if held else "normal")
        below = f"ref {state.ref_counts[b]}" if state.ref_counts[b] else "free"
        ax.text(x + BLOCK_W / 2, y - 0.05, below, ha="center", va="top", fontsize=7,
                color="black" if state.ref_counts[b] else "gray")
    pool_rows = cdiv(state.num_blocks, pool_columns)
    free = " ".join(map(str, state.free_block_ids)) or "(empty)"
    ax.text(x_pool, -pool_rows * (BLOCK_H + 0.45) + 0.15, f"free list (next first): {free}",
            ha="left", va="top", fontsize=8)

    # Logical blocks, left, with arrows to their physical blocks.
    for i, name in enumerate(names):
        y = -i * (BLOCK_H + 0.45)
        blocks, n = state.tables.get(name, ([], 0))
        label = f"{name}\n{n} tok" if name in state.tables else f"{name}\n-"
        ax.text(0, y + BLOCK_H / 2, label, ha="left", va="center", fontsize=8,
                color=colors[name], fontweight="bold")
        for j, b in enumerate(blocks):
            x = 1.6 + j * (BLOCK_W + GAP)
            filled = min(bs, n - j * bs)
            _slots(ax, x, y, filled, bs, colors[name])
            ax.text(x + BLOCK_W / 2, y + BLOCK_H + 0.05, f"L{j}→#{b}", ha="center",
                    va="bottom", fontsize=7)
            ax.text(x + BLOCK_W / 2, y - 0.05, f"{filled}/{bs}", ha="center", va="top",
                    fontsize=7)
            px, py = where[b]
            bend = "arc3,rad=-0.15" if abs(py - y) < 1e-9 and px > x_pool else "arc3,rad=0"
            ax.annotate("", xy=(px, py + BLOCK_H / 2), xytext=(x + BLOCK_W, y + BLOCK_H / 2),
                        zorder=0.5, arrowprops=dict(arrowstyle="->", color=colors[name],
                                                    alpha=0.6, lw=1.0, shrinkA=1, shrinkB=1,
                                                    connectionstyle=bend))

    rows = max(len(names), pool_rows)
    ax.set_xlim(-0.1, x_pool + min(pool_columns, state.num_blocks) * (BLOCK_W + GAP))
    ax.set_ylim(-rows * (BLOCK_H + 0.45) - 0.25, BLOCK_H + 0.45)
    ax.text(0, BLOCK_H + 0.4, "logical blocks (block tables)", fontsize=9, va="bottom")
    ax.text(x_pool, BLOCK_H + 0.4, f"physical blocks (pool of {state.num_blocks}, "
            f"block size {bs})", fontsize=9, va="bottom")
    ax.set_title(state.caption, fontsize=10, loc="left", pad=14)
    ax.axis("off")


def grow_requests(requests: dict[str, tuple[int, int]] | None = None, num_blocks: int = 5,
                  block_size: int = 4, table_cls: type[BlockTable] = BlockTable,
                  allocator: BlockAllocator | None = None) -> Iterator[PoolState]:
    """A scripted decode loop: yield the pool's state after every single token.

    ``requests`` maps a name to ``(arrival_step, num_tokens)``. Each step, every
    arrived, unfinished request appends one token (as a decode step does); a request
    that reaches its length is freed at once, and its blocks go back on the free list
    for the others. A request that finds no free block waits for a later step.

    ``table_cls`` and ``allocator`` (a fresh pool of ``num_blocks`` if None) let a
    learner's own table and allocator drive the same scenario.
    """
    if requests is None:
        requests = {"A": (0, 11), "B": (0, 6), "C": (1, 9)}
    allocator = BlockAllocator(num_blocks) if allocator is None else allocator
    num_blocks = allocator.num_blocks
    live: dict[str, BlockTable] = {}
    done: set[str] = set()
    order = tuple(requests)
    yield snapshot({}, allocator, "step 0: empty pool", order=order)
    step = 0
    while len(done) < len(requests):
        step += 1
        progress = False
        for name, (arrival, length) in requests.items():
            if name in done or arrival >= step:
                continue
            table = live.setdefault(name, table_cls(allocator, block_size))
            try:
                slot = table.append_token()
            except OutOfBlocks as err:
                yield snapshot(live, allocator, f"step {step}: {name} waits ({err})",
                               order=order)
                continue
            progress = True
            new = " (new block)" if slot.offset == 0 else ""
            yield snapshot(live, allocator, f"step {step}: {name} token {table.num_tokens - 1}"
                           f" -> block {slot.block}, offset {slot.offset}{new}", {slot.block},
                           order)
            if table.num_tokens == length:
                returned = table.blocks
                table.free()
                del live[name]
                done.add(name)
                free = " ".join(map(str, allocator.free_block_ids))
                yield snapshot(live, allocator, f"step {step}: {name} finished; blocks "
                               f"{returned} go back tail first: free list {free}",
                               set(returned), order)
        if not progress and all(a < step for a, _ in requests.values()):
            raise RuntimeError(f"step {step}: every request waits for a block; "
                               f"the pool of {num_blocks} is too small for this scenario")


def fork_and_write(prompt_len: int = 6, num_samples: int = 2, block_size: int = 4,
                   num_blocks: int = 8, table_cls: type[BlockTable] = BlockTable,
                   allocator: BlockAllocator | None = None) -> list[PoolState]:
    """Parallel sampling on one prompt: fork, then every sequence writes one token.

    Frames: the prompt alone, after the forks (every block shared), then one frame per
    write: the samples copy the shared, part-filled last block before writing
    (copy-on-write) and the parent, by then its last holder, writes in place.
    """
    allocator = BlockAllocator(num_blocks) if allocator is None else allocator
    parent = table_cls(allocator, block_size)
    for _ in range(prompt_len):
        parent.append_token()
    tables = {"prompt": parent}
    states = [snapshot(tables, allocator, f"a {prompt_len}-token prompt")]
    for k in range(1, num_samples + 1):
        tables[f"sample {k}"] = parent.fork()
    states.append(snapshot(tables, allocator, f"after {num_samples} forks: every block "
                           f"shared, nothing allocated"))
    for name in [*tables][1:] + ["prompt"]:
        slot = tables[name].append_token()
        what = f"copy block {slot.copy[0]} into block {slot.copy[1]}, then write" \
            if slot.copy else "write in place"
        states.append(snapshot(tables, allocator, f"{name} appends a token: {what} "
                               f"(block {slot.block}, offset {slot.offset})", {slot.block}))
    return states


def stepper(states: list[PoolState]):
    """An ipywidgets player over recorded states (draws with :func:`draw_pool`)."""
    return frame_player(len(states), lambda i: draw_pool(states[i]), interval=400,
                        description="frame")
