"""Run notebooks in a real browser: JupyterLab + headless Chromium, driven by Playwright.

    .venv/bin/python tools/browser_check.py [NOTEBOOK ...]   # default: notebooks/*.ipynb

Each notebook runs with "Run All Cells" and fails on unexecuted cells, errors and
tracebacks (model and page, widgets included), unrendered ipywidgets, dialogs left open,
or a kernel off the venv; a screenshot goes to test-artifacts/browser/. The page side is
one JavaScript helper, ``browser_check.js``, injected into every page. Notebooks run as
copies (the rest of the repo symlinked beside them), so no committed file is written.
Exit 0: all pass; 1: one fails; 2: no Chromium ($CHROMIUM or /usr/bin/chromium).
"""

from __future__ import annotations

import argparse
import contextlib
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
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts" / "browser"
HELPER_JS = Path(__file__).with_suffix(".js")
NO_CHROMIUM = "no Chromium: run tools/ensure_chromium.sh --install, or set $CHROMIUM"
DEFAULT_TIMEOUT_S = 240.0
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-quic", "--no-first-run", "--no-default-browser-check"]
MIRROR_SKIP = {".git", ".venv", ".ipynb_checkpoints", "test-artifacts", "__pycache__"}
LAB_SETTINGS = {  # no autosave (it is a copy), every cell in the DOM, no network checks
    "docmanager-extension/plugin": {"autosave": False},
    "notebook-extension/tracker": {"windowingMode": "none", "autoStartDefaultKernel": True},
    "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "extensionmanager-extension/plugin": {"enabled": False},
}


def find_chromium() -> str | None:
    """Path of a usable Chromium: $CHROMIUM, else Debian's /usr/bin/chromium."""
    if env := os.environ.get("CHROMIUM"):
        path = shutil.which(env) or env
        return path if os.access(path, os.X_OK) else None
    return next((c for c in CHROMIUM_CANDIDATES if os.access(c, os.X_OK)), None)


def discover_notebooks(folder: Path = REPO / "notebooks") -> list[Path]:
    return sorted(p for p in folder.glob("*.ipynb") if p.is_file())


def _short(text: str, limit: int = 800) -> str:
    return text.strip() if len(text.strip()) <= limit else "..." + text.strip()[-limit:]


@dataclass
class Lab:
    """A running JupyterLab: where it listens, what it serves, the Python it runs on."""
    port: int
    token: str
    src: Path  # the folder mirrored into the workspace
    python_prefix: str  # sys.prefix of the venv: kernels must run there too
    log_path: Path

    def rel_path(self, notebook: Path) -> str:
        return Path(notebook).resolve().relative_to(self.src).as_posix()

    def url_for(self, notebook: Path) -> str:
        workspace = "bc-" + re.sub(r"\W+", "-", Path(notebook).stem)
        return (f"http://127.0.0.1:{self.port}/lab/workspaces/{workspace}/tree/"
                f"{self.rel_path(notebook)}?reset&token={self.token}")

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        return "(no log)"


def _mirror(src: Path, dst: Path, notebooks: set[Path], parents: set[Path]) -> None:
    """Copy the notebooks, symlink everything else, descend only towards notebooks."""
    dst.mkdir(parents=True, exist_ok=True)
    for entry in sorted(e for e in src.iterdir() if e.name not in MIRROR_SKIP):
        if entry in notebooks:
            shutil.copy2(entry, dst / entry.name)
        elif entry in parents:
            _mirror(entry, dst / entry.name, notebooks, parents)
        else:
            (dst / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())


def _settings(tmp: Path, disable_extensions: tuple[str, ...]) -> dict[str, str]:
    """Write JupyterLab's settings and config under ``tmp``; the environment that uses them."""
    for name, values in LAB_SETTINGS.items():
        path = tmp / "lab-settings" / f"@jupyterlab/{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    (tmp / "config" / "labconfig").mkdir(parents=True)
    (tmp / "config" / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {n: True for n in disable_extensions}}))
    return {name: str(tmp / sub) for name, sub in (
        ("JUPYTERLAB_SETTINGS_DIR", "lab-settings"), ("JUPYTER_CONFIG_DIR", "config"),
        ("JUPYTERLAB_WORKSPACES_DIR", "lab-workspaces"), ("JUPYTER_RUNTIME_DIR", "runtime"),
        ("JUPYTER_DATA_DIR", "data"))}


@contextlib.contextmanager
def jupyterlab(notebooks: list[Path], disable_extensions: tuple[str, ...] = (),
               log_path: Path | None = None) -> Iterator[Lab]:
    """JupyterLab on 127.0.0.1 (token auth) serving temporary copies of ``notebooks``.

    On exit the server's whole process group and the workspace are removed.
    """
    notebooks = [Path(nb).resolve() for nb in notebooks]
    src = REPO if all(REPO in nb.parents for nb in notebooks) else \
        Path(os.path.commonpath([nb.parent for nb in notebooks]))
    tmp, proc = Path(tempfile.mkdtemp(prefix="browser-check-")), None
    try:
        root = tmp / "root"
        _mirror(src, root, set(notebooks),
                {p for nb in notebooks for p in nb.parents if src in p.parents})
        env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "JUPYTER_PATH")}
        env.update(_settings(tmp, disable_extensions))
        python = str(REPO / ".venv/bin/python") if (REPO / ".venv").exists() else sys.executable
        env.update(PATH=str(Path(python).parent) + os.pathsep + env.get("PATH", ""),
                   PYTHONUNBUFFERED="1", PYDEVD_DISABLE_FILE_VALIDATION="1")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        prefix = subprocess.check_output([python, "-c", "import sys; print(sys.prefix)"],
                                         text=True).strip()
        lab = Lab(port, secrets.token_hex(24), src, prefix, log_path or tmp / "jupyterlab.log")
        lab.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lab.log_path, "w") as log:
            proc = subprocess.Popen(
                [python, "-m", "jupyterlab", "--no-browser", "--allow-root",
                 "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
                 "--ServerApp.port_retries=0", f"--IdentityProvider.token={lab.token}",
                 f"--ServerApp.root_dir={root}", "--ServerApp.terminals_enabled=False",
                 "--LabApp.expose_app_in_browser=True"],
                cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/api/status",
                                     headers={"Authorization": f"token {lab.token}"})
        deadline = time.monotonic() + 90
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(req, timeout=5) as resp:
                if resp.status == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab exited ({proc.poll()}) or did not answer "
                                   f"within 90 s:\n{lab.log_tail()}")
            time.sleep(0.5)
        yield lab
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class NotebookResult:
    notebook: str
    seconds: float = 0.0  # from opening the page until the checks were done
    run_seconds: float = 0.0  # Run All Cells until the kernel was idle again
    code_cells: int = 0
    executed: int = 0
    widgets: int = 0
    images: int = 0
    kernel_python: str = ""
    screenshot: str = ""
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def report(self) -> str:
        return "\n".join([
            f"{self.notebook}: {'ok' if self.ok else 'FAILED'} in {self.seconds:.1f} s (run "
            f"{self.run_seconds:.1f} s); {self.executed}/{self.code_cells} code cells executed, "
            f"{self.widgets} widgets, {self.images} images; screenshot {self.screenshot or '-'}"
        ] + [f"  PROBLEM {p}" for p in self.problems] + [f"  warning: {w}" for w in self.warnings])


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """Headless Chromium through Playwright's sync API (Playwright's download is not used)."""
    from playwright.sync_api import sync_playwright

    if (path := find_chromium()) is None:
        raise FileNotFoundError(NO_CHROMIUM)
    with sync_playwright() as pw:  # stopping Playwright closes the browser
        yield pw.chromium.launch(executable_path=path, headless=True, args=CHROMIUM_ARGS)


def check_notebook(browser: Any, lab: Lab, notebook: Path,
                   timeout_s: float = DEFAULT_TIMEOUT_S,
                   screenshot_dir: Path | None = ARTIFACTS) -> NotebookResult:
    """Open one notebook, run all cells, check every output, take a screenshot."""
    from playwright.sync_api import Error as PlaywrightError

    path, t0 = lab.rel_path(notebook), time.monotonic()
    result = NotebookResult(notebook=path)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.add_init_script(path=str(HELPER_JS))
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    def call(name: str, *args: object):  # window.__bc[name](path, ...args)
        return page.evaluate(f"([p, ...a]) => window.__bc.{name}(p, ...a)", [path, *args])

    try:
        page.goto(lab.url_for(notebook), wait_until="domcontentloaded", timeout=timeout_s * 1e3)
        run = call("runAll", timeout_s * 1000)  # waits for the kernel, runs, waits
        result.run_seconds = run.get("seconds", 0.0)
        result.problems += [f"notebook: {run['error']}"] if run["error"] else []
        checked = call("check")
        result.problems += checked.pop("problems")
        result.warnings += checked.pop("warnings")
        vars(result).update(checked)  # code_cells, executed, widgets, images
        if not run["error"] or run["error"].startswith("run all"):
            result.kernel_python, _, prefix = call("kernelPython").partition("\n")
            if prefix != os.path.realpath(lab.python_prefix):
                result.problems.append(f"notebook: kernel on {result.kernel_python} (prefix "
                                       f"{prefix!r}), not on {lab.python_prefix}")
    except PlaywrightError as e:
        result.problems.append(f"notebook: browser: {_short(str(e))}\n"
                               f"(server log:\n{lab.log_tail(15)})")
    result.warnings += [f"JavaScript error in the page: {_short(e, 300)}" for e in errors]
    result.seconds = time.monotonic() - t0
    if screenshot_dir is not None:
        _screenshot(page, call, path, result, screenshot_dir)
    with contextlib.suppress(PlaywrightError):
        call("shutdown")
    context.close()
    return result


def _screenshot(page, call, path: str, result: NotebookResult, folder: Path) -> None:
    """The whole notebook: a viewport as tall as its cells (JupyterLab scrolls inside)."""
    from playwright.sync_api import Error as PlaywrightError

    target = folder / (Path(path).stem + ".png")
    try:
        height = int(call("scrollHeight") or 0)
        page.set_viewport_size({"width": 1400, "height": max(800, min(height, 16000))})
        for _ in range(2):  # the second call scrolls back to the top after the resize
            page.wait_for_timeout(500)
            call("scrollHeight")
        folder.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(target), full_page=True, timeout=30000)
        result.screenshot = os.path.relpath(target)
    except (PlaywrightError, TypeError, ValueError) as e:
        result.warnings.append(f"screenshot failed: {_short(str(e), 200)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/*.ipynb")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="s per notebook")
    ap.add_argument("--artifacts", type=Path, default=ARTIFACTS, help="screenshots, server log")
    ap.add_argument("--disable-labextension", action="append", default=[], metavar="NAME",
                    help="to test the checker, e.g. @jupyter-widgets/jupyterlab-manager")
    args = ap.parse_args(argv)
    notebooks = args.notebooks or discover_notebooks()
    if find_chromium() is None:
        print(f"browser_check: {NO_CHROMIUM}", file=sys.stderr)
        return 2
    t0, results = time.monotonic(), []
    with jupyterlab(notebooks, tuple(args.disable_labextension),
                    args.artifacts / "jupyterlab.log") as lab, chromium() as browser:
        for nb in notebooks:
            results.append(check_notebook(browser, lab, nb, args.timeout, args.artifacts))
            print(results[-1].report())
    failed = sum(not r.ok for r in results)
    print(f"browser_check: {len(results) - failed}/{len(results)} notebooks ok "
          f"in {time.monotonic() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
