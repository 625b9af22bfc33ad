"""Reading and running the course's notebooks: what the tools and the scoreboard share.

* :data:`EXERCISE_HEADING`: an exercise starts at a Markdown heading
  ``### Exercise NN.k: title`` (CONTRIBUTING.md, "Exercises"); :func:`exercise_headings`
  reads them off a cell.
* :func:`code_cells` and :func:`solution_spans`: the code cells of a notebook, and the
  lines of a cell inside ``### BEGIN SOLUTION`` ... ``### END SOLUTION``.
* :func:`execute`: run a notebook the way its stored outputs are meant to be produced,
  in a fresh kernel whose working directory is the notebook's folder (as nbval and
  JupyterLab run it), with a fixed hash seed, storing no timestamps, no widget state and
  each run of prints to one stream as one output (so a diff of a re-run notebook shows
  only what really changed).

``tools/run_notebooks.py`` executes notebooks in place with it, stopping at the first
error; ``make grade`` (:mod:`paged_lib.course.grading.scoreboard`) executes exercise
notebooks with it going on after errors, and reads the verdicts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import nbformat

#: ``### Exercise 03.2: title`` (any heading level; ``:``, ``.``, ``-`` or a dash after
#: the id). Groups: the exercise id, its title.
EXERCISE_HEADING = re.compile(r"^#+\s*Exercise\s+(\d+\.\d+)\s*[:.\-\u2014]\s*(.+?)\s*$",
                              re.M)
BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
#: ``hash()`` of a string, and so the order of a set of strings, depends on it.
HASH_SEED = "0"


def read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def exercise_headings(cell: nbformat.NotebookNode) -> list[tuple[str, str]]:
    """(exercise id, title) of every exercise heading in a Markdown cell; [] otherwise."""
    if cell.cell_type != "markdown":
        return []
    return EXERCISE_HEADING.findall(cell.source)


def code_cells(nb: nbformat.NotebookNode) -> Iterator[tuple[int, nbformat.NotebookNode]]:
    """(index in ``nb.cells``, cell) of every code cell, in order."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            yield i, cell


def solution_spans(source: str) -> list[tuple[int, int]]:
    """(BEGIN line, END line), 1-based, of each solution region of a cell's source: the
    learner's part is the lines strictly between them."""
    spans, start = [], None
    for n, line in enumerate(source.split("\n"), 1):
        if line.strip() == BEGIN_SOLUTION:
            start = n
        elif line.strip() == END_SOLUTION and start is not None:
            spans.append((start, n))
            start = None
    return spans


def execute(path: Path, timeout: int = 600, keep_going: bool = False
            ) -> nbformat.NotebookNode:
    """Run the notebook at ``path`` in a fresh ``python3`` kernel and return it with its
    outputs (nothing is written back).

    ``timeout`` is seconds per cell. By default the first cell error raises
    :class:`nbclient.exceptions.CellExecutionError` (and a slow cell
    ``CellTimeoutError``). With ``keep_going`` every cell runs whatever the cells above
    did, as a learner's "Run All" would: an error, an interrupted slow cell or a kernel
    that died is stored as an ``error`` output of its cell.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    path = Path(path)
    nb = read(path)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            extra_arguments=["--IPKernelApp.log_level=ERROR"],
                            record_timing=False,  # timestamps per cell only churn diffs
                            allow_errors=keep_going, interrupt_on_timeout=keep_going,
                            resources={"metadata": {"path": str(path.parent)}})
    running: list[nbformat.NotebookNode] = []
    client.on_cell_execute = lambda cell, cell_index: running.append(cell)
    try:
        client.execute(env={"PYTHONHASHSEED": HASH_SEED, **os.environ})
    except DeadKernelError as err:
        if not keep_going or not running:
            raise
        running[-1].outputs.append(nbformat.v4.new_output(
            "error", ename="DeadKernelError", evalue=f"the kernel died running this cell "
            f"({err}); the cells after it did not run", traceback=[]))
    nb.metadata.pop("widgets", None)  # random model ids: storing them churns git diffs
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = _coalesce_streams(cell.outputs)
    return nb


def _coalesce_streams(outputs: list) -> list:
    """Adjacent prints to the same stream as one output: how many pieces the kernel sent
    them in depends on timing, and would churn diffs (nbval compares them merged too)."""
    merged: list = []
    for out in outputs:
        last = merged[-1] if merged else None
        if last is not None and out.output_type == last.output_type == "stream" \
                and out.name == last.name:
            last.text += out.text
        else:
            merged.append(out)
    return merged
