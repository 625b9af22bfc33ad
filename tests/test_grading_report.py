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


def test_every_generated_case_family_names_the_states_it_reaches():
    """``states()`` is read only by this report (and the closing table of reached states):
    a family that loses it would print "-" for an exercise that has generated inputs."""
    import importlib
    import inspect
    import pkgutil

    from paged_lib.course import grading
    from paged_lib.course.grading import generated

    families = 0
    for package in (grading, generated):
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for name, fn in vars(module).items():
                if not (name.endswith("_cases") and not name.startswith("_")
                        and inspect.isfunction(fn) and fn.__module__ == module.__name__):
                    continue
                required = [p for p in inspect.signature(fn).parameters.values()
                            if p.default is inspect.Parameter.empty]
                for args in ([("05.1",), ("05.2",), ("05.3",), ("05.4",)] if required
                             else [()]):  # ramp_cases(ex): one family per Triton exercise
                    families += 1
                    cases = fn(*args)[:40]
                    assert any(c.states() for c in cases), f"{module.__name__}.{name}{args}"
    assert families >= 25
