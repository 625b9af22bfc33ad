"""Numbers in a chapter's prose come from cells that compute them.

nbval checks code-cell outputs, not Markdown, so a library change could leave a
paragraph quoting a stale figure. Every percentage with a decimal in a chapter's
Markdown must appear in an earlier cell (its source or output), unless it is one of the
paper's own figures, which the chapters quote to compare against.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from paged_lib.fragmentation import PAPER_FIG2

ROOT = Path(__file__).resolve().parent.parent
PERCENT = re.compile(r"(?<![\w.])(\d+\.\d+)\s?%")
PAPER = {f"{100 * v:.1f}" for shares in PAPER_FIG2.values() for v in shares.values() if v}
PAPER |= {f"{100 - float(p):.1f}" for p in PAPER}  # "the other 3.7%" of vLLM's 96.3%


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_percentages_in_prose_were_computed_above(path):
    nb = nbformat.read(path, as_version=4)
    seen = ""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            seen += cell.source
            for out in cell.outputs:
                seen += out.get("text", "") or out.get("data", {}).get("text/plain", "")
            continue
        for number in PERCENT.findall(cell.source):
            assert number in seen or number in PAPER, (
                f"{path.name}, Markdown cell {i} says {number}% but no cell above computes it: "
                "re-execute the notebook and update the prose, or print the number")
