"""A pytest plugin that records what each nbval cell printed, for the scoreboard.

``make grade`` runs the exercise notebooks with ``pytest --nbval-lax`` (each code cell is
a test item; a failing cell does not stop the cells after it) and this plugin writes
every cell's outputs to the JSON file named by ``--scoreboard-json``. The scoreboard
(:mod:`paged_lib.course.grading.scoreboard`) reads them back next to the notebook's Markdown
headings. Loaded with ``-p paged_lib.course.grading.nbval_plugin``.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

_outputs: dict[str, dict[int, list]] = defaultdict(dict)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--scoreboard-json", default=None,
                     help="write each notebook cell's outputs to this JSON file")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    yield
    if call.when == "call" and hasattr(item, "cell_num"):
        outs = getattr(item, "test_outputs", None) or []
        _outputs[str(item.path)][item.cell_num] = [dict(o) for o in outs]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("--scoreboard-json")
    if path:
        with open(path, "w") as f:
            json.dump({nb: {str(k): v for k, v in cells.items()}
                       for nb, cells in _outputs.items()}, f)
