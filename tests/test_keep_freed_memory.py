"""util.keep_freed_memory: the memory a model step frees is reused by the next step, not
faulted in afresh. With glibc's defaults, blocks over the mmap threshold are unmapped at
free and the heap's free top past the trim threshold is handed back, so each step's
activations fault every page in again (SmolLM2's prefill of the chat trace: 170,000
faults a step, measured here)."""

import subprocess
import sys

import pytest

from paged_lib.util import keep_freed_memory

#: a "step" allocates eight 4 MB activations and frees them; six steps, and the page
#: faults of the last (glibc's thresholds adapt over the first ones)
PROBE = r"""
import resource, sys, torch
from paged_lib.util import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
def step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    activations = [torch.ones(2**20) for _ in range(8)]
    del activations
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print([step() for _ in range(6)][-1])
"""
PAGES_PER_STEP = 8 * 4 * 2**20 // 4096


def last_step_faults(mode: str) -> int:
    run = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return int(run.stdout.split()[-1])


def test_a_step_reuses_the_memory_the_last_step_freed():
    if not keep_freed_memory():
        pytest.skip("not glibc: malloc keeps its own policy")
    # glibc's defaults fault most of a step's pages in most runs (6,000-8,200 of 8,192
    # here), though not all: a heap layout where nothing is trimmed shows 0
    assert last_step_faults("keep") < PAGES_PER_STEP // 20


def test_it_can_be_turned_off(monkeypatch):
    keep_freed_memory.cache_clear()
    monkeypatch.setenv("PAGED_LIB_MALLOC", "system")
    try:
        assert keep_freed_memory() is False
    finally:
        keep_freed_memory.cache_clear()
        monkeypatch.delenv("PAGED_LIB_MALLOC")
        keep_freed_memory()
