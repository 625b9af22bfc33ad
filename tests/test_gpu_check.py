"""``make gpu-check`` on a machine without a GPU, and its report writer (no GPU needed)."""

from __future__ import annotations

import paged_lib  # noqa: F401

# isort: split

import pytest
import torch

from paged_lib.bench import gpu_check

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")


@no_gpu
def test_says_it_needs_a_gpu_and_writes_nothing(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path / "reports")]) != 0
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "reports").exists()


def test_report_formats_a_given_result():
    result = {
        "environment": {"device": "NVIDIA H200", "date": "2026-11-29 16:00 UTC",
                        "torch": "2.13.0", "triton": "3.9.0", "cuda": "12.8", "sms": 132,
                        "memory_gib": 139.8},
        "seconds": 301.0,
        "tests": {"summary": "150 passed, 1 skipped in 80.0s", "ok": True, "seconds": 81.2,
                  "details": "SKIPPED [1] needs two CUDA GPUs"},
        "correctness": [
            {"shape": "64q/1kv d40 b128", "dtype": "bfloat16", "path": "decode, 4 splits",
             "max_err": 0.0078125, "ok": True},
            {"shape": "71q/1kv d256 b16", "dtype": "float16", "path": "prefill",
             "max_err": 0.25, "ok": False}],
        "bandwidth": {"read_GB/s": 4210.4, "copy_GB/s": 3990.0, "bytes": 4 * 2**30,
                      "peak_GB/s": 4800.0},
        "sweep": [{"batch": 64, "context": 4096, "splits": 2, "config": "TILE_N=32|x",
                   "triton_us": 290.123, "GB/s": 3702.2, "%achievable": 0.8793,
                   "%peak": 0.7713, "sdpa_us": 270.0, "vs_sdpa": 1.0745,
                   "flex_us": "time box"}],
        "goals": ["batch 64 at 4096: 77% of spec peak (goal >= 75%): met"],
    }
    report = gpu_check.format_report(result)
    lines = report.splitlines()
    assert lines[0] == "# GPU check: NVIDIA H200"
    assert "2026-11-29 16:00 UTC; torch 2.13.0, triton 3.9.0" in report
    assert "`150 passed, 1 skipped in 80.0s` in 81.2 s: passed" in report
    assert "1 of 2 checks within tolerance" in report
    assert "| 64q/1kv d40 b128 | bfloat16 | decode, 4 splits | 0.00781 | yes |" in lines
    assert "| 71q/1kv d256 b16 | float16 | prefill | 0.25 | **NO** |" in lines
    assert "Plain read of 4 GiB: 4210 GB/s; copy: 3990 GB/s; spec peak: 4800.0 GB/s." in report
    assert ("| 64 | 4096 | 2 | TILE_N=32\\|x | 290 | 3702 | 88% | 77% | 270 | 1.07 | time box |"
            in lines)
    assert "- batch 64 at 4096: 77% of spec peak (goal >= 75%): met" in lines
    assert gpu_check.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_correctness_sweep_runs_small_on_any_device():
    rows = gpu_check.correctness_sweep(paged_lib.default_device(), shapes=[((4, 2), 40, 8)],
                                       lens=(0, 1, 17), prefill=((0, 9), (5, 2)))
    assert [r["path"] for r in rows[:4]] == ["decode, 1 split", "decode, 4 splits",
                                            "decode, torch backend", "prefill"]
    assert {r["dtype"] for r in rows} == {"float16", "bfloat16"}
    assert all(r["ok"] for r in rows), rows
