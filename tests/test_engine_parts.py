"""The engine's time split into parts (python -m paged_lib.bench.engine_parts)."""

import pytest
from conftest import needs_smollm2
from torch import nn

import paged_lib  # noqa: F401  # isort: split
from paged_lib import model as model_module
from paged_lib.bench import engine_parts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@needs_smollm2
def test_parts_are_timed_inside_the_forward_and_the_wrappers_go_away(capsys):
    before = [getattr(owner, name) for owner, name, _ in engine_parts.PARTS]
    assert engine_parts.main(["--requests", "3", "--max-tokens", "6"]) == 0
    assert [getattr(owner, name) for owner, name, _ in engine_parts.PARTS] == before
    assert nn.Linear.forward is before[1] and model_module.paged_attention is before[3]
    text = capsys.readouterr().out
    rows = {line.split("  wall")[0].strip(): line for line in text.splitlines()[1:]}
    assert set(rows) == {part for _, _, part in engine_parts.PARTS}

    def wall(part):
        return float(rows[part].split("wall")[1].split()[0])

    # the forward holds the others; 30 layers x 7 linear maps per forward
    assert wall("model forward") >= wall("linear maps (LM head too)") + wall("LM head") > 0
    forwards = int(rows["model forward"].split(", ")[-1].split()[0])
    assert int(rows["linear maps (LM head too)"].split(", ")[-1].split()[0]) == 211 * forwards
    assert int(rows["decode attention"].split(", ")[-1].split()[0]) > 0
