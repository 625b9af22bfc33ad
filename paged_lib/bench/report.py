"""How benchmark rows are shown: table cells, plain-text and Markdown tables, and the
speed goals of chapter 05 with the measured values."""

from __future__ import annotations


def format_value(col: str, x: object) -> str:
    """One table cell: floats with 3 significant digits (NaN as -), ``%`` columns as %."""
    if isinstance(x, float):
        if x != x:
            return "-"
        if col.startswith("%"):
            return f"{x:.0%}"
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def format_table(rows: list[dict]) -> str:
    """A plain-text table: floats with 3 significant digits, percentages as %."""
    if not rows:
        return "(no rows)"
    cols = list(dict.fromkeys(c for r in rows for c in r))
    cells = [[format_value(c, r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))
    out = [line, "-" * len(line)]
    out += ["  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(out)


def markdown_table(rows: list[dict]) -> str:
    """Rows of dicts as a Markdown table (cells as :func:`format_value`; booleans as
    yes / **NO**)."""
    if not rows:
        return "(no rows)\n"
    cols = list(dict.fromkeys(c for r in rows for c in r))

    def cell(col: str, x: object) -> str:
        if isinstance(x, bool):
            return "yes" if x else "**NO**"
        return format_value(col, x).replace("|", "\\|")

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(cell(c, r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(out) + "\n"


def goals(rows: list[dict]) -> list[str]:
    """The speed goals (chapter 05), each with the measured value and met / NOT met.

    Batch 64 at 4K: >= 75% of spec bandwidth and <= 1.25x contiguous SDPA; batch 1 at
    32K: >= 50% of spec bandwidth (decode, 32/8 heads, head size 128, fp16).
    """
    out = []
    for batch, ctx, share, ratio in ((64, 4096, 0.75, 1.25), (1, 32768, 0.50, None)):
        row = next((r for r in rows if r["batch"] == batch and r["context"] == ctx), None)
        if row is None or not isinstance(row.get("triton_us"), float):
            out.append(f"batch {batch} at {ctx}: not measured")
            continue
        got = row["%peak"]
        line = (f"batch {batch} at {ctx}: {got:.0%} of spec peak (goal >= {share:.0%}): "
                f"{'met' if got >= share else 'NOT met'}")
        if ratio is not None and isinstance(row.get("sdpa_us"), float):
            line += (f"; {row['vs_sdpa']:.2f}x contiguous SDPA (goal <= {ratio}x): "
                     f"{'met' if row['vs_sdpa'] <= ratio else 'NOT met'}")
        out.append(line)
    return out
