"""Run notebooks in a real browser: JupyterLab + headless Chromium, driven by Playwright.

For every notebook this opens it in JupyterLab, runs all cells (the command
``notebook:run-all-cells``), waits until the kernel is idle, and reports

* code cells that did not get an execution count,
* error outputs and tracebacks (in the notebook model and in the rendered page),
* ipywidgets views that did not render (still "Loading widget...", "Error displaying
  widget", or shown as plain text because the widget manager did not take them),
* the Python the kernel ran on (must be the one JupyterLab runs from, i.e. the venv),

and saves a screenshot of the whole notebook after the run.

The notebooks are *copied* into a temporary workspace (every other file and folder
of the repository is symlinked next to them, so relative paths still work) and
autosave is off, so a run never writes over the committed notebooks.

Standalone::

    .venv/bin/python tools/browser_check.py notebooks/00_setup_and_tour.ipynb ...
    .venv/bin/python tools/browser_check.py            # all notebooks/*.ipynb

Exit status 0 when every notebook passes, 1 when one fails, 2 when Chromium is missing.
Chromium: ``$CHROMIUM``, else ``/usr/bin/chromium`` (Debian's ``chromium`` package; see
``tools/ensure_chromium.sh``). Playwright's own browser download is not used.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts" / "browser"
DEFAULT_TIMEOUT_S = 240.0
SERVER_START_TIMEOUT_S = 90.0

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
# Playwright adds --headless itself (headless=True) and gives every launch a fresh,
# temporary --user-data-dir (it refuses one in `args`).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
]

# Names never mirrored into the temporary workspace.
MIRROR_SKIP = {".git", ".venv", ".ipynb_checkpoints", "test-artifacts", "__pycache__"}

# JupyterLab user settings for the run (written to a temporary JUPYTERLAB_SETTINGS_DIR).
LAB_SETTINGS = {
    # never write the notebook back (it is a temporary copy anyway)
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    # every cell in the DOM, so that every output can be checked and photographed
    "@jupyterlab/notebook-extension/tracker": {
        "windowingMode": "none",
        "autoStartDefaultKernel": True,
    },
    # no news / update checks (no network here), no toasts over the page
    "@jupyterlab/apputils-extension/notification": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
    "@jupyterlab/extensionmanager-extension/plugin": {"enabled": False},
}

STDERR_MIME = "application/vnd.jupyter.stderr"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def find_chromium() -> str | None:
    """Path of a usable Chromium: $CHROMIUM, else Debian's /usr/bin/chromium."""
    env = os.environ.get("CHROMIUM")
    if env:
        path = shutil.which(env) or env
        return path if os.access(path, os.X_OK) else None
    for cand in CHROMIUM_CANDIDATES:
        if os.access(cand, os.X_OK):
            return cand
    return None


def default_python() -> str:
    """The Python JupyterLab (and so the 'python3' kernel) runs on: the repo's venv."""
    venv_python = REPO / ".venv" / "bin" / "python"
    return str(venv_python) if venv_python.exists() else sys.executable


def discover_notebooks(folder: Path = REPO / "notebooks") -> list[Path]:
    return sorted(p for p in folder.glob("*.ipynb") if p.is_file())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _strip_ansi(text: str) -> str:
    return ANSI_RE.sub("", text)


def _short(text: str, limit: int = 1500) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


# --------------------------------------------------------------------------- server


class JupyterLab:
    """JupyterLab on 127.0.0.1 with token auth, serving temporary copies of notebooks.

    Use as a context manager; the server (its whole process group) and the temporary
    workspace are removed on exit, also on errors.
    """

    def __init__(
        self,
        notebooks: list[Path],
        python: str | None = None,
        disable_extensions: tuple[str, ...] = (),
        log_path: Path | None = None,
    ):
        self.notebooks = [Path(nb).resolve() for nb in notebooks]
        self.python = python or default_python()
        self.disable_extensions = disable_extensions
        self.log_path = log_path
        self.token = secrets.token_hex(24)
        self.port = 0
        self.tmp: Path | None = None
        self.root: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.rel_paths: dict[Path, str] = {}
        self.python_prefix = ""
        self._log = None

    # -- workspace
    def _source_root(self) -> Path:
        if all(REPO in nb.parents for nb in self.notebooks):
            return REPO
        return Path(os.path.commonpath([nb.parent for nb in self.notebooks]))

    def _mirror(self, src: Path, dst: Path, copy: set[Path], descend: set[Path]) -> None:
        dst.mkdir(parents=True, exist_ok=True)
        for entry in sorted(src.iterdir()):
            if entry.name in MIRROR_SKIP:
                continue
            target = dst / entry.name
            if entry in copy:
                shutil.copy2(entry, target)
            elif entry in descend:
                self._mirror(entry, target, copy, descend)
            else:
                target.symlink_to(entry, target_is_directory=entry.is_dir())

    def _make_workspace(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="browser-check-"))
        self.root = self.tmp / "root"
        src_root = self._source_root()
        copy = set(self.notebooks)
        descend = {
            parent for nb in self.notebooks for parent in nb.parents if src_root in parent.parents
        }
        self._mirror(src_root, self.root, copy, descend)
        for nb in self.notebooks:
            self.rel_paths[nb] = nb.relative_to(src_root).as_posix()
        settings = self.tmp / "lab-settings"
        for name, values in LAB_SETTINGS.items():
            path = settings / f"{name}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values, indent=2))
        config = self.tmp / "config"
        (config / "labconfig").mkdir(parents=True)
        if self.disable_extensions:
            page_config = {"disabledExtensions": {n: True for n in self.disable_extensions}}
            (config / "labconfig" / "page_config.json").write_text(json.dumps(page_config))

    # -- process
    def start(self) -> JupyterLab:
        self._make_workspace()
        assert self.tmp is not None and self.root is not None
        self.python_prefix = subprocess.run(
            [self.python, "-c", "import sys; print(sys.prefix)"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        env = dict(os.environ)
        env.pop("MPLBACKEND", None)  # the kernel must use the inline backend
        env.pop("JUPYTER_PATH", None)
        env.update(
            {
                "JUPYTERLAB_SETTINGS_DIR": str(self.tmp / "lab-settings"),
                "JUPYTERLAB_WORKSPACES_DIR": str(self.tmp / "lab-workspaces"),
                "JUPYTER_CONFIG_DIR": str(self.tmp / "config"),
                "JUPYTER_RUNTIME_DIR": str(self.tmp / "runtime"),
                "JUPYTER_DATA_DIR": str(self.tmp / "data"),
                "PATH": str(Path(self.python).parent) + os.pathsep + env.get("PATH", ""),
                "PYTHONUNBUFFERED": "1",
                "PYDEVD_DISABLE_FILE_VALIDATION": "1",
            }
        )
        self.port = _free_port()
        cmd = [
            self.python,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--ServerApp.terminals_enabled=False",
            "--LabApp.expose_app_in_browser=True",
        ]
        log_path = self.log_path or (self.tmp / "jupyterlab.log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop())
        self.log_path = log_path
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.root,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        url = f"{self.base_url}/api/status"
        req = urllib.request.Request(url, headers={"Authorization": f"token {self.token}"})
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"JupyterLab exited with {self.proc.returncode}:\n" + self.log_tail()
                )
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(
            f"JupyterLab did not answer within {SERVER_START_TIMEOUT_S:.0f} s:\n" + self.log_tail()
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text().splitlines()[-lines:])
        except (OSError, TypeError):
            return "(no log)"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url_for(self, notebook: Path, workspace: str) -> str:
        rel = self.rel_paths[Path(notebook).resolve()]
        return f"{self.base_url}/lab/workspaces/{workspace}/tree/{rel}?reset&token={self.token}"

    def rel_path(self, notebook: Path) -> str:
        return self.rel_paths[Path(notebook).resolve()]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=15)
            except (ProcessLookupError, PermissionError):
                pass
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def __enter__(self) -> JupyterLab:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------- results


@dataclass
class Problem:
    cell: int | None  # index in the notebook (all cells, 0-based)
    first_line: str
    kind: str
    text: str

    def __str__(self) -> str:
        where = "notebook" if self.cell is None else f"cell {self.cell} ({self.first_line!r})"
        return f"{where}: {self.kind}: {self.text}"


@dataclass
class NotebookResult:
    notebook: str
    seconds: float = 0.0  # from opening the page until the run finished
    run_seconds: float = 0.0  # Run All Cells until the kernel was idle again
    code_cells: int = 0
    executed: int = 0
    widgets: int = 0
    images: int = 0
    kernel_python: str = ""
    screenshot: str = ""
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        status = "ok" if self.ok else "FAILED"
        return (
            f"{self.notebook}: {status} in {self.seconds:.1f} s "
            f"(run {self.run_seconds:.1f} s); {self.executed}/{self.code_cells} code cells "
            f"executed, {self.widgets} widgets, "
            f"{self.images} images; screenshot {self.screenshot or '-'}"
        )

    def report(self) -> str:
        lines = [self.summary()]
        lines += [f"  PROBLEM {p}" for p in self.problems]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


# --------------------------------------------------------------------------- browser

# Helper defined in every evaluate(): the notebook panel open on `path`.
_FIND_PANEL = """
const findPanel = (path) => {
  const app = window.jupyterapp;
  if (!app || !app.shell) return null;
  for (const w of app.shell.widgets('main')) {
    if (w.context && w.context.path === path && w.content && w.content.model
        && w.sessionContext) return w;
  }
  return null;
};
"""

_JS_PANEL_READY = (
    _FIND_PANEL
    + """
(path) => {
  const p = findPanel(path);
  if (!p || !p.context.isReady) return false;
  const k = p.sessionContext.session && p.sessionContext.session.kernel;
  return !!k && k.status === 'idle' && k.connectionStatus === 'connected';
}
"""
)

_JS_RUN_ALL = (
    _FIND_PANEL
    + """
async (path) => {
  const app = window.jupyterapp;
  const p = findPanel(path);
  app.shell.activateById(p.id);
  if (app.shell.collapseLeft) app.shell.collapseLeft();
  if (app.shell.collapseRight) app.shell.collapseRight();
  await new Promise(r => setTimeout(r, 200));
  if (app.shell.currentWidget !== p) return 'the notebook is not the current widget';
  window.__bcDone = null;
  app.commands.execute('notebook:run-all-cells').then(
    r => { window.__bcDone = {ok: r === undefined ? true : r}; },
    e => { window.__bcDone = {error: String(e)}; });
  return '';
}
"""
)

_JS_STATE = (
    _FIND_PANEL
    + """
(path) => {
  const p = findPanel(path);
  if (!p) return {missing: true};
  const k = p.sessionContext.session && p.sessionContext.session.kernel;
  const cells = p.content.widgets.map((c) => {
    const prompt = c.node.querySelector('.jp-InputPrompt');
    return {
      type: c.model.type,
      count: c.model.type === 'code' ? c.model.executionCount : null,
      running: c.model.type === 'code' && (c.model.executionState === 'running'
               || (!!prompt && prompt.textContent.includes('*'))),
    };
  });
  return {
    done: window.__bcDone,
    status: k ? k.status : 'no kernel',
    loadingWidgets: Array.from(p.node.querySelectorAll('.jp-OutputArea-output'))
      .filter(n => (n.textContent || '').startsWith('Loading widget')).length,
    cells,
  };
}
"""
)

# Everything the checks need, per cell: the model (source, count, nbformat outputs) and
# the rendered page (output nodes with their mime type, text, and widget classes).
_JS_COLLECT = (
    _FIND_PANEL
    + """
(path) => {
  const p = findPanel(path);
  const describe = (n) => ({
    mime: n.getAttribute('data-mime-type') || '',
    text: (n.innerText || n.textContent || '').slice(0, 4000),
    widgetView: !!n.querySelector('.jupyter-widgets, [class*="widget-"]'),
  });
  return p.content.widgets.map((c, index) => {
    const isCode = c.model.type === 'code';
    // one .jp-OutputArea-child per model output, in order (the cell's own output area)
    const children = isCode && c.outputArea
      ? Array.from(c.outputArea.node.children)
          .filter(ch => ch.classList.contains('jp-OutputArea-child'))
          .map(ch => { const o = ch.querySelector('.jp-OutputArea-output');
                       return o ? describe(o) : {mime: '', text: '', widgetView: false}; })
      : [];
    return {
      index,
      type: c.model.type,
      source: c.model.sharedModel.getSource(),
      count: isCode ? c.model.executionCount : null,
      outputs: isCode ? c.model.outputs.toJSON() : [],
      children,
      // every rendered output, also those nested in widgets (interact's Output widget)
      dom: Array.from(c.node.querySelectorAll('.jp-OutputArea-output')).map(describe),
    };
  });
}
"""
)

_JS_DIALOGS = """
() => Array.from(document.querySelectorAll('.jp-Dialog'))
  .map((d) => (d.innerText || '').replace(/\\s+/g, ' ').trim())
"""

_JS_KERNEL_PYTHON = (
    _FIND_PANEL
    + """
async (path) => {
  const p = findPanel(path);
  const k = p.sessionContext.session.kernel;
  const future = k.requestExecute({
    code: 'import sys; print(sys.executable); print(sys.prefix)',
    silent: false, store_history: false});
  let out = '';
  future.onIOPub = (msg) => {
    if (msg.header.msg_type === 'stream') out += msg.content.text;
    if (msg.header.msg_type === 'error') out += 'ERROR ' + msg.content.ename;
  };
  const timeout = new Promise((resolve) => setTimeout(() => resolve('timeout'), 30000));
  if (await Promise.race([future.done, timeout]) === 'timeout') return 'TIMEOUT ' + out;
  return out;
}
"""
)

_JS_SCROLL_HEIGHT = (
    _FIND_PANEL
    + """
(path) => {
  // Scroll the notebook to its top and return the page height that shows every cell
  // without scrolling inside the notebook (JupyterLab scrolls there, not the page).
  const p = findPanel(path);
  p.content.activeCellIndex = 0;
  p.content.deselectAll();
  const outer = p.node.querySelector('.jp-WindowedPanel-outer') || p.content.node;
  outer.scrollTop = 0;
  const cells = p.content.widgets;
  if (!cells.length) return 0;
  const last = cells[cells.length - 1].node.getBoundingClientRect().bottom;
  return Math.ceil(last + outer.scrollTop + 60);
}
"""
)

_JS_SHUTDOWN = (
    _FIND_PANEL
    + """
async (path) => {
  const p = findPanel(path);
  if (p) {
    const timeout = new Promise((resolve) => setTimeout(resolve, 15000));
    await Promise.race([p.sessionContext.shutdown(), timeout]);
  }
  return true;
}
"""
)


class Browser:
    """Headless Chromium through Playwright's sync API. Context manager."""

    def __init__(self, chromium: str | None = None):
        self.chromium = chromium or find_chromium()
        if self.chromium is None:
            raise FileNotFoundError(
                "no Chromium: install Debian's chromium (tools/ensure_chromium.sh --install) "
                "or set CHROMIUM=/path/to/chromium"
            )
        self._pw = None
        self.browser = None

    def __enter__(self) -> Browser:
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        try:
            self.browser = self._pw.chromium.launch(
                executable_path=self.chromium, headless=True, args=CHROMIUM_ARGS
            )
        except BaseException:
            self._pw.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.browser is not None:
                self.browser.close()
        finally:
            if self._pw is not None:
                self._pw.stop()

    def check_notebook(
        self,
        lab: JupyterLab,
        notebook: Path,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        screenshot_dir: Path | None = ARTIFACTS,
    ) -> NotebookResult:
        """Open one notebook, run all cells, check outputs, take a screenshot."""
        from playwright.sync_api import Error as PlaywrightError

        path = lab.rel_path(notebook)
        result = NotebookResult(notebook=path)
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        context = self.browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        page_errors: list[str] = []
        page.on("pageerror", lambda e: page_errors.append(str(e)))
        workspace = "bc-" + re.sub(r"[^A-Za-z0-9]+", "-", Path(path).stem)

        def ms_left() -> float:
            return max(1000.0, (deadline - time.monotonic()) * 1000)

        try:
            page.goto(
                lab.url_for(notebook, workspace), wait_until="domcontentloaded", timeout=ms_left()
            )
            try:
                page.wait_for_function(
                    _JS_PANEL_READY, arg=path, timeout=min(ms_left(), 120000), polling=250
                )
            except PlaywrightError:
                result.problems.append(
                    Problem(
                        None,
                        "",
                        "not opened",
                        "the notebook did not open with an idle, connected kernel within "
                        f"{time.monotonic() - t0:.0f} s (kernel selection dialog? server log:\n"
                        f"{lab.log_tail(15)})",
                    )
                )
                self._screenshot(page, path, result, screenshot_dir, lab)
                return result
            err = page.evaluate(_JS_RUN_ALL, path)
            if err:
                result.problems.append(Problem(None, "", "run all", err))
                return result
            t_run = time.monotonic()
            state = self._wait_finished(page, path, deadline)
            result.run_seconds = time.monotonic() - t_run
            if state.get("timed_out"):
                pending = [i for i, c in enumerate(state.get("cells", [])) if c.get("running")]
                result.problems.append(
                    Problem(
                        None,
                        "",
                        "timeout",
                        f"not finished after {timeout_s:.0f} s (kernel {state.get('status')}, "
                        f"cells still running: {pending})",
                    )
                )
            elif state.get("kernel_dead"):
                result.problems.append(
                    Problem(None, "", "kernel died", f"kernel status {state.get('status')!r}")
                )
            elif (state.get("done") or {}).get("error"):
                result.problems.append(Problem(None, "", "run all", state["done"]["error"]))
            self._wait_widgets(page, path, min(deadline, time.monotonic() + 20))
            cells = page.evaluate(_JS_COLLECT, path)
            self._check_cells(cells, result)
            # a dialog left open (e.g. "Kernel Restarting: the kernel appears to have died")
            for text in page.evaluate(_JS_DIALOGS):
                result.problems.append(Problem(None, "", "dialog", _short(text, 400)))
            if not (state.get("timed_out") or state.get("kernel_dead")):
                self._check_kernel_python(page, path, lab, result)
            result.warnings += [
                f"JavaScript error in the page: {_short(e, 300)}" for e in page_errors
            ]
            result.seconds = time.monotonic() - t0
            self._screenshot(page, path, result, screenshot_dir, lab)
        except PlaywrightError as e:
            result.problems.append(Problem(None, "", "browser", _short(str(e), 800)))
            self._screenshot(page, path, result, screenshot_dir, lab)
        finally:
            try:
                page.evaluate(_JS_SHUTDOWN, path)
            except PlaywrightError:
                pass
            context.close()
            if not result.seconds:
                result.seconds = time.monotonic() - t0
        return result

    # -- helpers
    @staticmethod
    def _wait_finished(page, path: str, deadline: float) -> dict:
        """Poll until run-all resolved, the kernel is idle and no cell is running.

        The state must hold for two polls in a row (a widget callback may still be busy).
        """
        stable = 0
        state: dict = {}
        while time.monotonic() < deadline:
            state = page.evaluate(_JS_STATE, path)
            finished = (
                state.get("done") is not None
                and state.get("status") == "idle"
                and not any(c["running"] for c in state.get("cells", []))
            )
            stable = stable + 1 if finished else 0
            if stable >= 2:
                return state
            if state.get("status") == "dead":
                state["kernel_dead"] = True
                return state
            page.wait_for_timeout(500)
        state["timed_out"] = True
        return state

    @staticmethod
    def _wait_widgets(page, path: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            state = page.evaluate(_JS_STATE, path)
            if not state.get("loadingWidgets"):
                return
            page.wait_for_timeout(500)

    @staticmethod
    def _check_cells(cells: list[dict], result: NotebookResult) -> None:
        for cell in cells:
            if cell["type"] != "code":
                continue
            result.code_cells += 1
            idx = cell["index"]
            first = next((ln for ln in cell["source"].splitlines() if ln.strip()), "")[:80]

            def problem(kind: str, text: str, idx=idx, first=first) -> None:
                result.problems.append(Problem(idx, first, kind, text))

            if cell["count"] is None:
                if cell["source"].strip():
                    problem("not executed", "no execution count after Run All Cells")
            else:
                result.executed += 1
            # -- the notebook model
            widget_at: list[int] = []  # positions of outputs that hold a widget view
            for pos, out in enumerate(cell["outputs"]):
                otype = out.get("output_type")
                if otype == "error":
                    tb = _strip_ansi("\n".join(out.get("traceback") or []))
                    problem(
                        "error output", f"{out.get('ename')}: {out.get('evalue')}\n{_short(tb)}"
                    )
                elif otype == "stream" and out.get("name") == "stderr":
                    text = _strip_ansi(out.get("text", ""))
                    if "Traceback (most recent call last)" in text:
                        problem("traceback on stderr", _short(text))
                    elif text.strip():
                        result.warnings.append(
                            f"cell {idx} ({first!r}) wrote to stderr: {_short(text, 300)}"
                        )
                elif otype in ("display_data", "execute_result"):
                    data = out.get("data", {})
                    if WIDGET_MIME in data:
                        widget_at.append(pos)
                    if "image/png" in data or "image/svg+xml" in data:
                        result.images += 1
            # -- the rendered page: errors anywhere in the cell's outputs, including
            # outputs nested in widgets (an exception in an interact callback shows up
            # only there)
            model_errors = any(
                p.cell == idx and p.kind in ("error output", "traceback on stderr")
                for p in result.problems
            )
            for node in cell["dom"]:
                text = _strip_ansi(node["text"])
                if (
                    node["mime"] == STDERR_MIME
                    and not model_errors
                    and ("Traceback" in text or re.search(r"^\w+(Error|Exception)\b", text, re.M))
                ):
                    problem("error in page", _short(text))
                if text.startswith("Error displaying widget"):
                    problem("widget not rendered", _short(text, 300))
            # -- every widget view in the model must be a rendered widget in the page
            children = cell["children"]
            for pos in widget_at:
                if len(children) != len(cell["outputs"]):
                    problem(
                        "widget not rendered",
                        f"{len(cell['outputs'])} outputs in the model but "
                        f"{len(children)} in the page",
                    )
                    break
                node = children[pos]
                text = _strip_ansi(node["text"]).strip()
                if text.startswith("Error displaying widget"):
                    continue  # reported above
                if node["mime"] == "text/plain" or text.startswith("Loading widget"):
                    problem(
                        "widget not rendered",
                        f"output {pos} shows {_short(text, 160)!r} instead of the widget "
                        "(ipywidgets extension missing, or the widget model never arrived)",
                    )
                elif not node["widgetView"]:
                    problem(
                        "widget not rendered",
                        f"output {pos} holds no .jupyter-widgets / .widget-* element: "
                        f"{_short(text, 160)!r}",
                    )
                else:
                    result.widgets += 1

    @staticmethod
    def _check_kernel_python(page, path: str, lab: JupyterLab, result: NotebookResult) -> None:
        out = page.evaluate(_JS_KERNEL_PYTHON, path).strip().splitlines()
        if len(out) < 2:
            result.problems.append(Problem(None, "", "kernel", f"could not ask the kernel: {out}"))
            return
        result.kernel_python = out[0]
        if os.path.realpath(out[1]) != os.path.realpath(lab.python_prefix):
            result.problems.append(
                Problem(
                    None,
                    "",
                    "wrong kernel",
                    f"kernel runs {out[0]} (prefix {out[1]}), expected prefix {lab.python_prefix}",
                )
            )

    @staticmethod
    def _screenshot(
        page, path: str, result: NotebookResult, screenshot_dir: Path | None, lab: JupyterLab
    ) -> None:
        if screenshot_dir is None:
            return
        from playwright.sync_api import Error as PlaywrightError

        screenshot_dir.mkdir(parents=True, exist_ok=True)
        target = screenshot_dir / (Path(path).stem + ".png")
        try:
            try:
                height = int(page.evaluate(_JS_SCROLL_HEIGHT, path))
            except (PlaywrightError, TypeError, ValueError):
                height = 0
            # JupyterLab scrolls inside the notebook, not the page: make the viewport as
            # tall as the notebook (capped) so the "full page" holds every output.
            page.set_viewport_size({"width": 1400, "height": max(800, min(height, 16000))})
            page.wait_for_timeout(500)
            page.evaluate(_JS_SCROLL_HEIGHT, path)  # back to the top after the resize
            page.wait_for_timeout(500)
            page.screenshot(path=str(target), full_page=True, timeout=30000)
            try:
                result.screenshot = str(target.resolve().relative_to(Path.cwd().resolve()))
            except ValueError:
                result.screenshot = str(target)
        except PlaywrightError as e:
            result.warnings.append(f"screenshot failed: {_short(str(e), 200)}")


# --------------------------------------------------------------------------- API / CLI


def check_notebooks(
    notebooks: list[Path],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    screenshot_dir: Path | None = ARTIFACTS,
    disable_extensions: tuple[str, ...] = (),
    echo=print,
) -> list[NotebookResult]:
    results = []
    log = screenshot_dir / "jupyterlab.log" if screenshot_dir else None
    with (
        JupyterLab(notebooks, disable_extensions=disable_extensions, log_path=log) as lab,
        Browser() as browser,
    ):
        for nb in notebooks:
            res = browser.check_notebook(lab, nb, timeout_s, screenshot_dir)
            echo(res.report())
            results.append(res)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "notebooks", nargs="*", type=Path, help="notebooks to check (default: notebooks/*.ipynb)"
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds per notebook (default %(default)s)",
    )
    ap.add_argument(
        "--artifacts",
        type=Path,
        default=ARTIFACTS,
        help="folder for screenshots and the server log (default %(default)s)",
    )
    ap.add_argument(
        "--disable-labextension",
        action="append",
        default=[],
        metavar="NAME",
        help="disable a JupyterLab extension (to test the checker itself, e.g. "
        "@jupyter-widgets/jupyterlab-manager)",
    )
    args = ap.parse_args(argv)
    notebooks = args.notebooks or discover_notebooks()
    if not notebooks:
        print("browser_check: no notebooks to check")
        return 0
    missing = [str(nb) for nb in notebooks if not nb.is_file()]
    if missing:
        print(f"browser_check: no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    if find_chromium() is None:
        print(
            "browser_check: no Chromium; install Debian's chromium "
            "(tools/ensure_chromium.sh --install) or set CHROMIUM=/path",
            file=sys.stderr,
        )
        return 2
    t0 = time.monotonic()
    results = check_notebooks(
        notebooks, args.timeout, args.artifacts, tuple(args.disable_labextension)
    )
    failed = [r for r in results if not r.ok]
    print(
        f"browser_check: {len(results) - len(failed)}/{len(results)} notebooks ok "
        f"in {time.monotonic() - t0:.1f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
