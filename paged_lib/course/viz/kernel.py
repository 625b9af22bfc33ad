"""Pictures for chapter 05: which blocks each kernel program reads, split-KV, benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from paged_lib.kernels.triton_split import split_len
from paged_lib.util import cdiv


def _programs_per_block(seq_lens: Sequence[int], block_size: int, num_splits: int,
                        tile_n: int) -> dict[tuple[int, int], int]:
    """(sequence, logical block) -> split index of the program that reads its first slot.

    As the kernel splits: each sequence on its own, ``split_len(seq_len, ...)`` tokens per
    segment (whole tiles), so a short sequence may use fewer segments than ``num_splits``.
    """
    owner = {}
    for s, n in enumerate(seq_lens):
        tokens = split_len(n, num_splits, tile_n) if num_splits > 1 else max(n, 1)
        for b in range(cdiv(n, block_size)):
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
                             for b in range(cdiv(n, block_size)))
    owner = _programs_per_block(seq_lens, block_size, num_splits, tile_n)
    programs = sorted({(s, j) for (s, _), j in owner.items()})
    cmap = plt.get_cmap("tab10" if len(programs) <= 10 else "tab20")
    color = {p: cmap(i % cmap.N) for i, p in enumerate(programs)}

    cols = max(8, min(16, num_blocks))
    rows_phys = cdiv(num_blocks, cols)
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
    """Benchmark rows from :mod:`paged_lib.bench.attention` as a figure.

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


def plot_gqa_tile(group: int, head_dim: int, tile_n: int, valid_tokens: int) -> Figure:
    """One iteration of the decode kernel: query tile x K tile -> score tile.

    The query tile is ``[GROUP_PAD, HEAD_PAD]`` (the group's query heads, padded to a
    power of two and at least 16, as ``tl.dot`` wants); the K tile ``[TILE_N, HEAD_PAD]``.
    Shaded: padded heads, padded dimensions and tokens past the sequence's end (masked:
    never loaded); the score tile shows which scores are real.
    """
    import numpy as np
    from matplotlib.colors import ListedColormap

    group_pad = max(16, 1 << (group - 1).bit_length())
    head_pad = max(16, 1 << (head_dim - 1).bit_length())
    q = np.zeros((group_pad, head_pad))
    q[group:, :] = 1
    q[:, head_dim:] = 2
    k = np.zeros((tile_n, head_pad))
    k[valid_tokens:, :] = 3
    k[:, head_dim:] = 2
    s = np.zeros((group_pad, tile_n))
    s[group:, :] = 1
    s[:, valid_tokens:] = 3
    cmap = ListedColormap(["tab:blue", "lightgray", "wheat", "mistyrose"])
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4),
                             gridspec_kw={"width_ratios": [3, 3, 2]})
    titles = [f"q tile [GROUP_PAD={group_pad}, HEAD_PAD={head_pad}]",
              f"K tile [TILE_N={tile_n}, HEAD_PAD={head_pad}]",
              f"scores = q @ K^T [{group_pad}, {tile_n}]"]
    for ax, data, title in zip(axes, (q, k, s), titles, strict=True):
        ax.imshow(data, cmap=cmap, vmin=0, vmax=3, aspect="auto", interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0].set_ylabel(f"{group} real query heads")
    axes[1].set_ylabel(f"{valid_tokens} valid tokens")
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in cmap.colors]
    fig.legend(handles, ["real", "padded head (masked)", f"padded dim ({head_dim}->{head_pad})",
                         "token past seq_len (masked)"], loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


#: Codes of :func:`slot_status`: what a program did with each slot of its sequence.
UNTOUCHED, MASKED, READ, READ_PAST_END = 0, 1, 2, 3


def slot_status(trace, cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor) -> dict[tuple[int, int], dict]:
    """Per program (sequence, KV head): its sequence's slots, read or masked, from a trace.

    ``trace`` is a :class:`~paged_lib.instruments.load_trace.LoadTrace` of a decode launch
    with one program per (sequence, KV head). Returns, per program, ``"status"``: a list
    over the logical positions of its block table (``max_blocks * block_size``) with
    :data:`UNTOUCHED`, :data:`MASKED`, :data:`READ` or :data:`READ_PAST_END`, and
    ``"outside"``: how many elements it read from blocks not in its table. A masked lane
    counts only past the sequence's end (a kernel that loads its block id with
    ``other=0`` gives masked lanes block 0's addresses, which mean nothing).
    """
    block_size = cache.shape[1]
    width = block_tables.shape[1] * block_size
    out: dict[tuple[int, int], dict] = {}
    for read in trace.reads_of(cache):
        seq, head = read.program[:2]
        row = block_tables[seq].tolist()
        n = int(seq_lens[seq])
        used = row[:cdiv(n, block_size)]
        entry = out.setdefault((seq, head), {"status": [UNTOUCHED] * width, "outside": 0})
        for (blk, slot, _, _), on in zip(read.index.tolist(), read.mask.tolist(), strict=True):
            if blk not in used:
                entry["outside"] += int(on)
                continue
            pos = used.index(blk) * block_size + slot
            if not on and pos < n:  # a masked lane's address is often just `other`: noise
                continue
            code = (READ if pos < n else READ_PAST_END) if on else MASKED
            entry["status"][pos] = max(entry["status"][pos], code)
    return out


def plot_slot_status(status: dict[tuple[int, int], dict], block_size: int,
                     seq_lens: Sequence[int] | torch.Tensor) -> Figure:
    """A row per program: each slot of its block table read (green), read past the
    sequence's end (red), masked past the end (gray: only when a masked lane still
    addressed the sequence's block) or not read (white); block edges dashed. The legend
    lists only the colours that appear, besides "read" and "not read"."""
    import numpy as np
    from matplotlib.colors import ListedColormap

    keys = sorted(status)
    grid = np.array([status[k]["status"] for k in keys])
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.4 * len(keys)))
    cmap = ListedColormap(["white", "lightgray", "tab:green", "tab:red"])
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=3, aspect="auto", interpolation="nearest")
    for x in range(block_size, grid.shape[1], block_size):
        ax.axvline(x - 0.5, color="k", ls="--", lw=0.6)
    lens = [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor)
                             else seq_lens)]
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([f"seq {s}, kv_head {h} (len {lens[s]})"
                        + (f", {status[(s, h)]['outside']} outside" if status[(s, h)]["outside"]
                           else "") for s, h in keys], fontsize=8)
    ax.set_xlabel("logical slot of the sequence's block table (dashed: block edges)")
    # Only what the picture shows: a kernel that masks its block-id load gives masked lanes
    # block 0's addresses (other=0), which slot_status drops, so "masked" rarely appears.
    labels = ["not read", "masked (not read)", "read", "read past the end"]
    shown = [k for k in range(4) if k in (UNTOUCHED, READ) or (grid == k).any()]
    handles = [Rectangle((0, 0), 1, 1, facecolor=cmap.colors[k], edgecolor="k", lw=0.3)
               for k in shown]
    ax.legend(handles, [labels[k] for k in shown], loc="lower center",
              bbox_to_anchor=(0.5, 1.0), ncol=len(shown), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def plot_slot_mapping(block_table: Sequence[int], positions: Sequence[int],
                      block_size: int, num_blocks: int) -> Figure:
    """The write path: new tokens at ``positions`` of one sequence -> slots of the cache.

    ``slot = block_table[pos // block_size] * block_size + pos % block_size``; the cache is
    drawn as one strip of ``num_blocks * block_size`` slots, as the write kernel sees it.
    """
    fig, ax = plt.subplots(figsize=(10, 2.6))
    total = num_blocks * block_size
    for b in range(num_blocks):
        ax.add_patch(Rectangle((b * block_size, 0), block_size, 1, fill=False, lw=1.2))
        ax.text(b * block_size + block_size / 2, -0.35, f"block {b}", ha="center", fontsize=8)
    for i, pos in enumerate(positions):
        block = block_table[pos // block_size]
        slot = block * block_size + pos % block_size
        ax.add_patch(Rectangle((slot, 0), 1, 1, color="tab:orange"))
        x_tok = (i + 0.5) * total / max(len(positions), 1)
        ax.add_patch(FancyArrowPatch((x_tok, 2.2), (slot + 0.5, 1.0), arrowstyle="-|>",
                                     mutation_scale=10, color="k", alpha=0.7))
        ax.text(x_tok, 2.35, f"pos {pos}\n-> slot {slot}", ha="center", fontsize=8)
    ax.set_xlim(-1, total + 1)
    ax.set_ylim(-0.7, 3.0)
    ax.set_title(f"slot = block_table[pos // {block_size}] * {block_size} + pos % {block_size}"
                 f", block table {list(block_table)}", fontsize=9)
    ax.axis("off")
    fig.tight_layout()
    return fig


def plot_prefill_mask(context_len: int, query_len: int, block_size: int) -> Figure:
    """Paged prefill's causal mask: new token ``i`` sees positions ``0 .. context + i``.

    Rows: the new tokens; columns: every position (cached context, then the new tokens),
    with block edges dashed. The kernel skips whole blocks right of a row's last position.
    """
    import numpy as np

    total = context_len + query_len
    mask = np.zeros((query_len, total))
    for i in range(query_len):
        mask[i, :context_len + i + 1] = 1
        mask[i, :context_len] = 0.6
    fig, ax = plt.subplots(figsize=(8, 0.8 + 0.3 * query_len))
    ax.imshow(mask, cmap="Blues", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    for x in range(block_size, total, block_size):
        ax.axvline(x - 0.5, color="k", ls="--", lw=0.6)
    ax.axvline(context_len - 0.5, color="tab:red", lw=1.5)
    ax.set_xlabel(f"position (left of the red line: {context_len} cached tokens; dashed: "
                  f"blocks of {block_size})")
    ax.set_ylabel("new token")
    ax.set_title("paged prefill: causal over cached context + new tokens", fontsize=9)
    fig.tight_layout()
    return fig


def traced_slot_status(case, tile_n: int = 32, num_splits: int = 1
                       ) -> dict[tuple[int, int], dict]:
    """Run the library's decode kernel on ``case`` under the load tracer; its slot status.

    Interpreter only (the trace sees interpreted loads); ``case`` is a
    :class:`~paged_lib.kernels.cases.DecodeCase` on the CPU.
    """
    from paged_lib.instruments.load_trace import trace_loads
    from paged_lib.kernels.triton_decode import paged_attention_triton

    q, k_cache, v_cache, block_tables, seq_lens, scale = case
    with trace_loads() as trace:
        paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale,
                               num_splits=num_splits, tile_n=tile_n)
    return slot_status(trace, k_cache, block_tables, seq_lens)


def read_explorer(case):  # pragma: no cover - interactive; traced_slot_status is tested
    """A widget: pick TILE_N and the split count, see which slots each program read."""
    import ipywidgets as w

    def show(tile_n: int, num_splits: int) -> None:
        status = traced_slot_status(case, tile_n, num_splits)
        plt.show(plot_slot_status(status, case.k_cache.shape[1], case.seq_lens))

    return w.interactive(show, tile_n=w.Dropdown(options=[16, 32, 64], value=32),
                         num_splits=w.Dropdown(options=[1, 2, 3], value=1))
