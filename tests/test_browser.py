"""Real-browser test: every chapter notebook runs in JupyterLab in headless Chromium.

One JupyterLab (token auth, 127.0.0.1, a free port, serving temporary copies of the
notebooks) and one headless Chromium serve the whole module, once per pytest-xdist worker
(``make browser`` runs two, one per core: the notebooks are independent copies, as under
nbval); each ``notebooks/*.ipynb`` (sorted) gets its own browser context and its own
test. Each notebook is opened, run with "Run All Cells", and must finish within
``BROWSER_TIMEOUT`` seconds (default 240) with every code cell executed, no traceback or
error output anywhere on the page, every ipywidgets view rendered, and the kernel on the
venv's Python. A full-page screenshot per notebook, and per worker the JupyterLab log and
the timings, go to ``test-artifacts/browser/``.

Run only this test: ``.venv/bin/pytest -m browser -v``; leave it out: ``-m "not browser"``.
The driver also works on its own: ``.venv/bin/python tools/browser_check.py NOTEBOOK...``.

Needs Chromium: ``$CHROMIUM`` or Debian's ``/usr/bin/chromium``
(``tools/ensure_chromium.sh --install``). Without it the test is skipped, except in CI
(``CI=true``), where it fails.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("browser_check", REPO / "tools" / "browser_check.py")
browser_check = importlib.util.module_from_spec(_spec)
sys.modules["browser_check"] = browser_check
_spec.loader.exec_module(browser_check)

# BROWSER_NOTEBOOKS=<folder> checks that folder's *.ipynb instead (to try the test itself)
NOTEBOOKS = browser_check.discover_notebooks(
    Path(os.environ.get("BROWSER_NOTEBOOKS", REPO / "notebooks")).resolve()
)
TIMEOUT_S = float(os.environ.get("BROWSER_TIMEOUT", browser_check.DEFAULT_TIMEOUT_S))
ARTIFACTS = browser_check.ARTIFACTS

pytestmark = [pytest.mark.browser, pytest.mark.slow]

HOW_TO_ENABLE = (
    "install Debian's chromium (tools/ensure_chromium.sh --install, i.e. "
    "apt-get install chromium) or set CHROMIUM=/path/to/chromium"
)


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _unavailable(reason: str) -> None:
    if _in_ci():
        pytest.fail(f"CI=true but {reason}; run tools/ensure_chromium.sh before the tests")
    pytest.skip(f"browser test skipped: {reason}; to enable it, {HOW_TO_ENABLE}")


@pytest.fixture(scope="module")
def lab_and_browser():
    if browser_check.find_chromium() is None:
        where = os.environ.get("CHROMIUM") or " or ".join(browser_check.CHROMIUM_CANDIDATES)
        _unavailable(f"no Chromium at {where}")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _unavailable("the Python package playwright is not installed (pip install -e '.[test]')")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    # each worker writes its own files (a notebook's stale screenshot goes in its own test)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    suffix = f"-{worker}" if worker else ""
    results: dict[str, dict] = {}
    with (
        browser_check.jupyterlab(NOTEBOOKS, log_path=ARTIFACTS / f"jupyterlab{suffix}.log")
        as lab,
        browser_check.chromium() as browser,
    ):
        yield lab, browser, results
    lines = [
        f"{r['notebook']}: {'ok' if r['ok'] else 'FAILED'} {r['seconds']:.1f} s"
        for r in results.values()
    ]
    (ARTIFACTS / f"timings{suffix}.txt").write_text("\n".join(lines) + "\n")
    (ARTIFACTS / f"results{suffix}.json").write_text(json.dumps(list(results.values()), indent=2))


@pytest.mark.parametrize(
    "notebook",
    NOTEBOOKS or [pytest.param(None, marks=pytest.mark.skip(reason="no notebooks/*.ipynb"))],
    ids=lambda nb: nb.name if nb else "none",
)
def test_notebook_runs_in_browser(lab_and_browser, notebook, record_property):
    lab, browser, results = lab_and_browser
    before = hashlib.sha256(notebook.read_bytes()).hexdigest()
    (ARTIFACTS / f"{notebook.stem}.png").unlink(missing_ok=True)  # an earlier run's
    res = browser_check.check_notebook(browser, lab, notebook, TIMEOUT_S, ARTIFACTS)
    record_property("seconds", round(res.seconds, 1))
    results[res.notebook] = {**dataclasses.asdict(res), "ok": res.ok,
                             "seconds": round(res.seconds, 1),
                             "run_seconds": round(res.run_seconds, 1)}
    print(res.report())  # shown with -s / -rA
    # JupyterLab only sees a temporary copy; the committed file must be untouched
    # (this also trips if someone edits the notebook during the run)
    assert hashlib.sha256(notebook.read_bytes()).hexdigest() == before, (
        f"{notebook} changed on disk while the browser ran it (it must run on a copy)"
    )
    if not res.ok:
        pytest.fail(
            "in the browser:\n" + res.report() + f"\n(JupyterLab log: {lab.log_path})",
            pytrace=False,
        )
