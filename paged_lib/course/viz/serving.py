"""Chapter 14's pictures: the paper's Fig. 12 shape, normalised latency against request rate."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

#: The paper's names for the four policies.
LABELS = {"paged": "paged (vLLM)", "orca-oracle": "Orca (Oracle)", "orca-pow2": "Orca (Pow2)",
          "orca-max": "Orca (Max)"}
STYLES = {"paged": ("#C44E52", "o"), "orca-oracle": ("#4C72B0", "s"),
          "orca-pow2": ("#55A868", "^"), "orca-max": ("#8172B3", "v")}


def latency_vs_rate(curves: dict[str, tuple[list, list]], bound: float | None = None,
                    title: str = "", unit: str = "s/token", ax=None) -> Figure:
    """One line per policy: normalised latency at each request rate (the paper's Fig. 12),
    with the latency bound as a dashed line when given."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
    else:
        fig = ax.figure
    for policy, (rates, lat) in curves.items():
        colour, marker = STYLES.get(policy, ("grey", "."))
        ax.plot(rates, lat, marker=marker, color=colour, label=LABELS.get(policy, policy))
    if bound is not None:
        ax.axhline(bound, color="grey", linestyle="--", linewidth=1, label="latency bound")
    top = max((max(lat) for _, lat in curves.values()), default=1.0)
    ax.set_ylim(0, min(top, 4 * bound) * 1.05 if bound else top * 1.05)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(f"normalised latency ({unit})")
    ax.set_title(title)
    ax.legend(frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
