"""The benchmark tells the truth: nothing unchecked is timed, the engine bench is reachable."""

from __future__ import annotations

import paged_lib  # noqa: F401

# isort: split

import sys
import types

import pytest
import torch

from paged_lib.bench import __main__ as cli
from paged_lib.bench import attention, checks, report
from paged_lib.kernels import cpu_decode
from paged_lib.util import CheckFailed


def _expected():
    return torch.ones(2, 4, 8)


def test_measure_times_only_a_checked_output():
    timed = []

    def timer(fn):
        timed.append(fn)
        return 1.5

    right = _expected
    assert checks.measure("right", right, _expected(), timer) == 1.5
    for wrong, why in ((lambda: _expected() * 1.01, "max error"),
                       (lambda: _expected()[:1], "shape"),
                       (lambda: _expected() * float("nan"), "max error inf")):
        with pytest.raises(CheckFailed, match=why):
            checks.measure("wrong", wrong, _expected(), timer)
    assert timed == [right]  # the wrong ones were never timed


def test_a_wrong_implementation_gets_no_time_in_its_row(capsys):
    row = attention._cpu_row("broken", lambda: _expected() + 1, _expected(), repeats=1)
    assert row["check"] == checks.WRONG and row["ms"] != row["ms"]  # NaN: no time
    assert "not timed: broken" in capsys.readouterr().out
    table = report.format_table([{"impl": "ok", "ms": 2.0, "check": "ok"}, row])
    assert table.splitlines()[-1].split() == ["broken", "-", "WRONG"]


def test_goals_are_reported_with_the_measured_values():
    rows = [{"batch": 64, "context": 4096, "triton_us": 300.0, "%peak": 0.8, "sdpa_us": 280.0,
             "vs_sdpa": 300 / 280},
            {"batch": 1, "context": 32768, "triton_us": "WRONG", "%peak": float("nan")}]
    lines = report.goals(rows)
    assert lines[0] == ("batch 64 at 4096: 80% of spec peak (goal >= 75%): met; "
                        "1.07x contiguous SDPA (goal <= 1.25x): met")
    assert lines[1] == "batch 1 at 32768: not measured"
    rows[0]["%peak"] = 0.5
    assert "NOT met" in report.goals(rows)[0]


def test_engine_bench_is_dispatched_with_its_arguments(monkeypatch):
    seen = []
    fake = types.ModuleType("paged_lib.bench.engine")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "paged_lib.bench.engine", fake)
    assert cli.main(["engine", "--requests", "4"]) == 0
    assert seen == [["--requests", "4"]]


def test_engine_bench_missing_says_so(monkeypatch, capsys):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(cli.importlib, "import_module", missing)
    assert cli.main(["engine"]) == 2
    assert "not in this checkout yet" in capsys.readouterr().out


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2)])
def test_lean_contiguous_baselines_equal_the_reference(num_heads, num_kv_heads):
    from paged_lib.kernels.cases import make_decode_case
    from paged_lib.kernels.reference import (
        contiguous_kv,
        matmul_per_sequence,
        padded_kv,
        ref_paged_attention,
        sdpa_padded,
    )

    case = make_decode_case([5, 33, 17], num_heads, num_kv_heads, 16, 8, seed=1,
                            shared=False, poison=False)
    expected = ref_paged_attention(*case).float()
    kv = contiguous_kv(*case[1:5])
    torch.testing.assert_close(matmul_per_sequence(case.q, kv, case.scale), expected,
                               atol=1e-5, rtol=1e-5)
    k, v, mask = padded_kv(kv)
    assert k.shape[2] == 33 and mask.sum().item() == 5 + 33 + 17
    torch.testing.assert_close(sdpa_padded(case.q, k, v, mask, case.scale), expected,
                               atol=1e-5, rtol=1e-5)


def test_cpu_ratios_lists_every_baseline_and_the_floor():
    rows = attention.cpu_ratios(num_seqs=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                min_len=8, max_len=24, block_size=8, repeats=1,
                                flex_repeats=0, sdpa_gqa=False)
    names = [r["impl"] for r in rows]
    c_kernel = ["paged, C kernel (backend='cpu')"] if cpu_decode.available() else []
    assert names == ["contiguous SDPA (per sequence)", "contiguous grouped matmuls",
                     "contiguous SDPA, one padded call", "paged, torch backend", *c_kernel,
                     "read K/V once (memory floor)"]
    assert [r["check"] for r in rows] == ["ok"] * (4 + len(c_kernel)) + ["floor"]
    assert rows[0]["vs_sdpa"] == 1.0


def test_cpu_goal_compares_the_fastest_paged_with_the_fastest_contiguous():
    rows = [{"impl": "contiguous a", "ms": 10.0, "check": "ok"},
            {"impl": "contiguous b", "ms": 8.0, "check": "ok"},
            {"impl": "paged, slow", "ms": 30.0, "check": "ok"},
            {"impl": "paged, fast", "ms": 9.0, "check": "ok"},
            {"impl": "paged, wrong", "ms": float("nan"), "check": "WRONG"},
            {"impl": "read K/V once (memory floor)", "ms": 2.0, "check": "floor"}]
    assert attention.cpu_goal(rows) == ("paged, fast / contiguous b = 1.12x (goal <= 1.2x): "
                                        "met")
    rows[3]["ms"] = 12.0
    assert attention.cpu_goal(rows).endswith("1.50x (goal <= 1.2x): NOT met")
    assert attention.cpu_goal(rows[:2]) == "paged / best contiguous: not measured"
