"""paged_lib picks Triton's interpreter before any kernel is defined, unless told."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SNIPPET = "import os, paged_lib; print(os.environ.get('TRITON_INTERPRET'))"


def _run(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if env_value is not None:
        env["TRITON_INTERPRET"] = env_value
    return subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_interpreter_turned_on_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: kernels compile natively")
    assert _run(None) == "1"


@pytest.mark.parametrize("choice", ["0", "1"])
def test_learners_choice_is_kept(choice):
    assert _run(choice) == choice


def test_mode_describes_what_runs():
    import paged_lib

    mode = paged_lib.mode()
    text = mode.describe()
    assert ("interpreter" in text) == mode.triton_interpreter
    assert mode.device in ("cpu", "cuda")


def test_tour_kernel_adds_with_a_ragged_last_program():
    import torch

    from paged_lib.course.demos.tour import add

    x = torch.arange(1000, dtype=torch.float32)
    assert torch.equal(add(x, x), 2 * x)
    with pytest.raises(ValueError, match="must match"):
        add(x, x[:10])
