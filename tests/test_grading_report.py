"""tools/grading_report.py counts what the generated stages run for each exercise."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import grading_report  # noqa: E402


def test_the_report_counts_each_exercise_s_generated_inputs_and_states():
    lines = grading_report.report(ROOT / "solutions" / "01_kv_bytes.ipynb")
    assert [line.split()[0] for line in lines] == ["[01.1]", "[01.2]", "[01.3]", "[01.4]"]
    assert all(line.split()[1] == "✅" for line in lines)
    inputs = [int(line.split("generated inputs")[1].split()[0]) for line in lines]
    assert all(n > 0 for n in inputs)
    assert "head_dim not hidden / heads" in lines[0]
