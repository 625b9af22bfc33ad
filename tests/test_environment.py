"""The two set-up paths (pip via the Makefile, conda via environment.yml) agree, and CI
runs the README's test command."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pyproject_pins() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["test"]
    pins = {}
    for req in reqs:
        name, _, version = req.partition("==")
        assert version, f"pyproject.toml: {req!r} is not pinned with =="
        pins[name.lower()] = version
    return pins


def _environment_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "environment.yml").read_text().splitlines():
        m = re.match(r"^\s+- ([A-Za-z0-9_.\-]+)==(\S+)\s*$", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def test_environment_yml_pins_what_pyproject_pins():
    assert _environment_pins() == _pyproject_pins()


def test_environment_yml_installs_the_package_and_python_311():
    text = (ROOT / "environment.yml").read_text()
    assert re.search(r"^name: \S+", text, re.M)
    assert "- python=3.11" in text
    assert "- -e ." in text


def test_torch_is_pinned_exactly():
    # A looser requirement pulls a multi-GB CUDA build on a CPU machine.
    assert _pyproject_pins()["torch"] == "2.13.0"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make lab" in readme
    assert re.search(r"^make test$", ci, re.M)


def test_readme_lists_every_chapter():
    from paged_lib.course.chapters import CHAPTERS

    readme = (ROOT / "README.md").read_text()
    for ch in CHAPTERS:
        assert f"| {ch.number} |" in readme, f"README's chapter table misses {ch.number}"
        if ch.available(ROOT):
            assert f"]({ch.notebook})" in readme, f"README does not link {ch.notebook}"


def test_jupyterlab_opens_without_the_news_prompt():
    """`make lab` installs JupyterLab settings overrides: no "get notified about official
    Jupyter news?" prompt and no update check (checked by hand against a running lab: the
    notification plugin's schema defaults become these values)."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    overrides = json.loads((root / "tools/jupyterlab/overrides.json").read_text())
    assert overrides["@jupyterlab/apputils-extension:notification"] == {
        "fetchNews": "false", "checkForUpdates": False}
    makefile = (root / "Makefile").read_text()
    assert ("cp tools/jupyterlab/overrides.json "
            "$(VENV)/share/jupyter/lab/settings/overrides.json") in makefile
