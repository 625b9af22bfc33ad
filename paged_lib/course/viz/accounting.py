"""Pictures and a calculator for chapter 01 (KV bytes). Every plot returns a Figure."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from paged_lib.accounting import (
    DTYPE_BYTES,
    SPECS,
    GiB,
    KiB,
    ModelSpec,
    format_bytes,
    get_spec,
    kv_bytes,
    kv_bytes_per_token,
    requests_that_fit,
    weight_bytes,
)

KIND_COLORS = {"MHA": "#4c72b0", "GQA": "#dd8452", "MQA": "#55a868"}
WEIGHT_COLOR, FREE_COLOR = "#9a9a9a", "#f2f2f2"


def _names(models: Sequence[str | ModelSpec] | None) -> list[ModelSpec]:
    return [get_spec(m) for m in (models if models is not None else SPECS)]


def kv_per_token_bars(models: Sequence[str | ModelSpec] | None = None,
                      per_token: Callable[[ModelSpec], int] = kv_bytes_per_token,
                      title: str = "KV bytes per token, fp16 (K and V, all layers)") -> Figure:
    """One bar per model: KiB of KV cache per token, coloured by MHA / GQA / MQA.

    ``per_token`` computes the bytes (a learner's own function can draw the chart).
    """
    specs = _names(models)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    values = [per_token(s) / KiB for s in specs]
    bars = ax.bar([s.name for s in specs], values,
                  color=[KIND_COLORS[s.attention] for s in specs])
    for bar, v in zip(bars, values, strict=True):
        ax.annotate(f"{v:,.0f}", (bar.get_x() + bar.get_width() / 2, v),
                    ha="center", va="bottom", fontsize=8)
    for kind, color in KIND_COLORS.items():
        ax.bar([0], [0], width=0, color=color, label=kind)  # legend entries only
    ax.legend(title="attention", fontsize=8)
    ax.set_ylabel("KV cache per token (KiB)")
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=35, labelsize=8)
    fig.tight_layout()
    return fig


def kv_vs_context(models: Sequence[str | ModelSpec] | None = None, max_context: int = 32_768,
                  gpu_gib: Sequence[float] = (40, 80)) -> Figure:
    """KV cache of one request (GiB) against its length: one straight line per model.

    Dashed horizontal lines mark whole-GPU capacities for scale.
    """
    specs = _names(models)
    contexts = list(range(0, max_context + 1, max(1, max_context // 64)))
    fig, ax = plt.subplots(figsize=(7, 4))
    for s in specs:
        ax.plot(contexts, [kv_bytes(s, n) / GiB for n in contexts],
                color=KIND_COLORS[s.attention],
                linestyle={"MHA": "-", "GQA": "--", "MQA": ":"}[s.attention],
                label=f"{s.name} ({s.attention})")
    for cap in gpu_gib:
        ax.axhline(cap, color="black", linewidth=0.8, linestyle=(0, (4, 4)))
        ax.annotate(f"{cap:g} GiB GPU", (0, cap), xytext=(2, 2), textcoords="offset points",
                    fontsize=8)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KV cache of one request (GiB)")
    ax.set_title("KV grows linearly with context")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def requests_fit_bars(models: Sequence[str | ModelSpec] | None = None,
                      gpu_gib: Sequence[float] = (40, 80), context_len: int = 2048) -> Figure:
    """Where a GPU's memory goes: fp16 weights, the KV of every request that fits, the rest.

    One horizontal stacked bar per (model, GPU) pair, labelled with the number of
    ``context_len``-token requests that fit after the weights.
    """
    specs = _names(models)
    rows = [(s, cap) for s in specs for cap in gpu_gib]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    xmax = max(max(cap, weight_bytes(s) / GiB) for s, cap in rows)
    for y, (s, cap) in enumerate(rows):
        w = weight_bytes(s) / GiB
        n = requests_that_fit(s, round(cap * GiB), context_len)
        kv = n * kv_bytes(s, context_len) / GiB
        ax.barh(y, min(w, cap), color=WEIGHT_COLOR)
        if w > cap:
            ax.barh(y, w - cap, left=cap, color=WEIGHT_COLOR, hatch="///", edgecolor="red")
            label = f"weights ({w:.0f} GiB) > GPU"
        else:
            ax.barh(y, kv, left=w, color=KIND_COLORS[s.attention])
            if 1 < n <= 80:  # one tick per request, while they are wide enough to see
                per = kv / n
                ax.vlines([w + i * per for i in range(1, n)], y - 0.4, y + 0.4,
                          color="white", linewidth=0.6)
            ax.barh(y, cap - w - kv, left=w + kv, color=FREE_COLOR, edgecolor="#cccccc")
            label = f"{n:,} requests"
        ax.annotate(label, (min(w, cap) + (kv if w <= cap else w - cap) + 0.01 * xmax, y),
                    va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{s.name} on {cap:g} GiB" for s, cap in rows],
                  fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, xmax * 1.25)
    ax.set_xlabel("GPU memory (GiB)")
    ax.set_title(f"How many {context_len:,}-token requests fit after the fp16 weights "
                 "(grey: weights, colour: KV, light: left over)", fontsize=9)
    fig.tight_layout()
    return fig


def kv_token_layout(models: Sequence[str | ModelSpec] = ("llama-2-7b", "llama-2-70b",
                                                         "falcon-7b")) -> Figure:
    """What one token leaves behind: a K and a V vector per layer and KV head.

    Each small square is one ``head_dim``-long vector. All panels share one scale, so the
    area of a panel is the number of vectors a token adds to the cache.
    """
    specs = _names(models)
    rows = max(s.num_layers for s in specs)
    cols = max(2 * s.num_kv_heads + 2 for s in specs)
    fig, axes = plt.subplots(1, len(specs), figsize=(3.3 * len(specs), 4.6), squeeze=False)
    for ax, s in zip(axes[0], specs, strict=True):
        color = KIND_COLORS[s.attention]
        for i, part in enumerate(("K", "V")):
            x0 = i * (s.num_kv_heads + 2)
            for h in range(s.num_kv_heads + 1):
                ax.plot([x0 + h, x0 + h], [0, s.num_layers], color="white", linewidth=0.4)
            for layer in range(s.num_layers + 1):
                ax.plot([x0, x0 + s.num_kv_heads], [layer, layer], color="white", linewidth=0.4)
            ax.fill_between([x0, x0 + s.num_kv_heads], 0, s.num_layers, color=color,
                            alpha=0.85 if part == "K" else 0.55, zorder=0, linewidth=0)
            ax.text(x0 + s.num_kv_heads / 2, s.num_layers + 1, part, ha="center",
                    va="bottom", fontsize=9)
        ax.set_xlim(-1, cols)
        ax.set_ylim(-1, rows + 4)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([0, s.num_layers])
        ax.set_ylabel("layers", fontsize=8)
        ax.set_xlabel(f"{s.num_kv_heads} KV heads per layer (each square: {s.head_dim} values)",
                      fontsize=7)
        vectors = 2 * s.num_layers * s.num_kv_heads
        ax.set_title(f"{s.name} ({s.attention})\n{vectors:,} vectors x {s.head_dim} x "
                     f"{s.dtype_bytes} B\n= {format_bytes(kv_bytes_per_token(s))} per token",
                     fontsize=8)
        for side in ("top", "right", "bottom"):
            ax.spines[side].set_visible(False)
    fig.suptitle("One token's KV cache: K and V, one vector per layer and KV head", fontsize=10)
    fig.tight_layout()
    return fig


def calculator_report(model: str | ModelSpec, dtype: str = "fp16", context_len: int = 2048,
                      batch: int = 1, gpu_gib: float = 80) -> str:
    """The KV bill of ``batch`` requests of ``context_len`` tokens, as text.

    ``dtype`` is the KV cache's; weights are counted in fp16.
    """
    spec = get_spec(model).with_dtype(dtype)
    if not isinstance(batch, int) or batch < 0:
        raise ValueError(f"batch must be a non-negative integer, got {batch!r}")
    per_token = kv_bytes_per_token(spec)
    per_request = kv_bytes(spec, context_len)
    weights = weight_bytes(spec, "fp16")
    gpu = round(gpu_gib * GiB)
    total = weights + batch * per_request
    fits = "fits" if total <= gpu else "does NOT fit"
    n_fit = requests_that_fit(spec, gpu, context_len) if context_len > 0 else None
    lines = [
        f"{spec.name} ({spec.attention}, {spec.num_heads} query heads, "
        f"{spec.num_kv_heads} KV heads), KV in {dtype} ({spec.dtype_bytes} B per value)",
        f"per token   : 2 x {spec.num_layers} layers x {spec.num_kv_heads} KV heads x "
        f"{spec.head_dim} x {spec.dtype_bytes} B = {per_token:,} B = {format_bytes(per_token)}",
        f"per request : {context_len:,} tokens -> {per_request:,} B = "
        f"{format_bytes(per_request)} ({format_bytes(per_request, binary=False)})",
        f"batch of {batch:,}: {batch * per_request:,} B = {format_bytes(batch * per_request)}",
        f"fp16 weights: {weights:,} B = {format_bytes(weights)}",
        f"weights + KV = {format_bytes(total)}: {fits} in {gpu_gib:g} GiB",
    ]
    if n_fit is not None:
        lines.append(f"at most {n_fit:,} requests of {context_len:,} tokens fit in "
                     f"{gpu_gib:g} GiB after the weights")
    return "\n".join(lines)


def calculator_widget():
    """An ipywidgets front end to :func:`calculator_report` (prints on every change)."""
    import ipywidgets as widgets

    def show(model: str, dtype: str, context_len: int, batch: int, gpu_gib: int) -> None:
        print(calculator_report(model, dtype, context_len, batch, gpu_gib))

    style = {"description_width": "110px"}
    return widgets.interactive(
        show,
        model=widgets.Dropdown(options=list(SPECS), value="llama-2-7b", style=style),
        dtype=widgets.Dropdown(options=list(DTYPE_BYTES), value="fp16", style=style),
        context_len=widgets.IntSlider(value=2048, min=0, max=131_072, step=256,
                                      description="context (tokens)", style=style),
        batch=widgets.IntSlider(value=8, min=1, max=256, description="batch", style=style),
        gpu_gib=widgets.Dropdown(options=[24, 40, 48, 80, 141], value=80,
                                 description="GPU (GiB)", style=style),
    )
