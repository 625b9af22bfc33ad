"""``make gpu-check``: the first run on a real GPU, in one command, with a stored report.

    python -m paged_lib.bench.gpu_check [--out reports] [--skip-tests]

On one CUDA GPU, in at most about 8 minutes:

1. the kernel tests, natively compiled (including the GPU-only ones: 32K/128K contexts,
   a cache of more than 2**31 elements, bf16);
2. a correctness sweep against the float64 reference over the shapes the kernels must
   handle (head sizes 40-256, GQA groups up to 71:1, block sizes 1-128, a length-0
   sequence, forced split-KV, prefill), in fp16 and bf16;
3. the bandwidth sweep of :mod:`paged_lib.bench.attention` (a plain read for the achievable
   bandwidth, then every checked kernel time as a share of it and of the spec peak).

It writes ``reports/gpu-check-<device>.md`` (device name, date, versions, every table)
and the same numbers as ``.json`` for the notebook to show. On a machine without a GPU
it says so and exits non-zero without writing anything.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

import paged_lib  # noqa: F401  (sets TRITON_INTERPRET before any kernel is defined)
from paged_lib.bench.checks import TOLERANCE
from paged_lib.bench.report import markdown_table
from paged_lib.device import interpreter_on

#: The shapes of the correctness sweep: (num_heads, num_kv_heads), head_dim, block_size.
SWEEP_SHAPES = [
    ((32, 8), 128, 16), ((4, 4), 64, 16), ((12, 4), 96, 1), ((40, 8), 112, 12),
    ((64, 1), 40, 128), ((71, 1), 256, 16), ((8, 2), 72, 32), ((16, 2), 120, 8),
]
#: Lengths of every sweep batch: empty, one token, around blocks, long enough to split.
SWEEP_LENS = (0, 1, 17, 300, 1000, 4100)
TEST_FILES = ["tests/test_kernels.py", "tests/test_cases.py", "tests/test_torch_backend.py",
              "tests/test_kernel_extras.py", "tests/test_bench.py"]


class NeedsGPU(RuntimeError):
    """Raised (and reported) where the check would run on something that is not a GPU."""


def require_gpu() -> str:
    """The GPU's name, or :class:`NeedsGPU` saying why this machine cannot run the check."""
    if not torch.cuda.is_available():
        raise NeedsGPU("make gpu-check needs a CUDA GPU: none is visible here "
                       "(torch.cuda.is_available() is False). Nothing was run and no "
                       "report was written; the CPU checks are `make test`.")
    if interpreter_on():
        raise NeedsGPU("TRITON_INTERPRET is set: the kernels would run in the interpreter, "
                       "not natively. Unset it and run make gpu-check again.")
    return torch.cuda.get_device_name()


def device_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``: the report's file name part."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def environment(name: str) -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"device": name, "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda or "?", "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1)}


def run_tests(timeout_s: float) -> dict:
    """The kernel test files under pytest, natively; returns the summary line and status."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
           "-rfs", *TEST_FILES]
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"summary": f"timed out after {timeout_s:.0f} s", "ok": False, "seconds": timeout_s,
                "details": ""}
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else done.stderr.strip()[-300:]
    details = "\n".join(ln for ln in lines if ln.startswith(("FAILED", "ERROR", "SKIPPED")))
    return {"summary": summary.strip("= "), "ok": done.returncode == 0,
            "seconds": round(time.monotonic() - t0, 1), "details": details}


def correctness_sweep(device: str = "cuda", shapes=SWEEP_SHAPES, lens=SWEEP_LENS,
                      dtypes=(torch.float16, torch.bfloat16),
                      prefill=((0, 40, 300), (33, 1, 70))) -> list[dict]:
    """Every shape x dtype x (no split, 4 splits, torch backend, prefill) against the
    float64 reference. ``prefill`` is (contexts, query_lens) of the prefill batch.

    Rows: shape, dtype, path, max_err, ok. The reference runs on ``device`` in float64.
    """
    from paged_lib.kernels import paged_attention, paged_prefill
    from paged_lib.kernels.cases import make_decode_case, make_prefill_case
    from paged_lib.kernels.reference import ref_paged_attention, ref_paged_prefill

    rows = []
    for (heads, kv_heads), head_dim, block_size in shapes:
        for dtype in dtypes:
            shape = f"{heads}q/{kv_heads}kv d{head_dim} b{block_size}"
            case = make_decode_case(list(lens), heads, kv_heads, head_dim, block_size, dtype,
                                    device, seed=head_dim + block_size)
            expected = ref_paged_attention(*case)
            results = [(f"decode, {n} split{'s' * (n > 1)}",
                        paged_attention(*case, num_splits=n), expected) for n in (1, 4)]
            results.append(("decode, torch backend", paged_attention(*case, backend="torch"),
                            expected))
            pf = make_prefill_case(*prefill, heads, kv_heads, head_dim,
                                   block_size, dtype, device, seed=1)
            results.append(("prefill", paged_prefill(*pf), ref_paged_prefill(*pf)))
            for path, out, ref in results:
                err = float((out.double() - ref.double()).abs().nan_to_num(float("inf")).max())
                rows.append({"shape": shape, "dtype": str(dtype).removeprefix("torch."),
                             "path": path, "max_err": err, "ok": err <= TOLERANCE[dtype]})
    return rows


def format_report(result: dict) -> str:
    """The Markdown report of one run (``result`` as :func:`run_check` returns it)."""
    env = result["environment"]
    lines = [f"# GPU check: {env['device']}", "",
             f"{env['date']}; torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, "
             f"{env['sms']} SMs, {env['memory_gib']} GiB. Written by `make gpu-check` "
             f"in {result['seconds']:.0f} s.", ""]
    tests = result.get("tests")
    if tests:
        lines += ["## Kernel tests (natively compiled)", "",
                  f"`{tests['summary']}` in {tests['seconds']} s: "
                  f"{'passed' if tests['ok'] else '**FAILED**'}", ""]
        if tests["details"]:
            lines += ["```", tests["details"], "```", ""]
    sweep = result.get("correctness", [])
    bad = [r for r in sweep if not r["ok"]]
    lines += ["## Correctness against the float64 reference", "",
              f"{len(sweep) - len(bad)} of {len(sweep)} checks within tolerance "
              f"(fp16 {TOLERANCE[torch.float16]:g}, bf16 {TOLERANCE[torch.bfloat16]:g}); "
              f"lengths {list(SWEEP_LENS)} in every decode batch.", "",
              markdown_table(sweep)]
    bw = result.get("bandwidth")
    if bw:
        lines += ["## Bandwidth", "",
                  f"Plain read of {bw['bytes'] / 2**30:.0f} GiB: {bw['read_GB/s']:.0f} GB/s; "
                  f"copy: {bw['copy_GB/s']:.0f} GB/s; spec peak: "
                  f"{bw['peak_GB/s'] or 'unknown'} GB/s.", "",
                  "Decode, 32 query / 8 KV heads, head size 128, block 16, fp16; times are "
                  "medians of CUDA-graph replays, each output checked first.", "",
                  markdown_table(result.get("sweep", [])), "### Goals", ""]
        lines += [f"- {g}" for g in result.get("goals", [])] + [""]
    return "\n".join(lines)


def run_check(skip_tests: bool = False, budget_s: float = 480.0) -> dict:
    """Everything, on the GPU, within about ``budget_s`` seconds."""
    from paged_lib.bench.attention import gpu_sweep
    from paged_lib.bench.hardware import peak_bandwidth_gbs
    from paged_lib.bench.report import goals
    from paged_lib.bench.timing import read_bandwidth

    name = require_gpu()
    t0 = time.monotonic()
    result = {"environment": environment(name)}
    if not skip_tests:
        print("kernel tests ...", flush=True)
        result["tests"] = run_tests(timeout_s=0.45 * budget_s)
        print(" ", result["tests"]["summary"], flush=True)
    print("correctness sweep ...", flush=True)
    result["correctness"] = correctness_sweep()
    print("bandwidth ...", flush=True)
    bw = read_bandwidth()
    bw["peak_GB/s"] = peak_bandwidth_gbs(name)
    result["bandwidth"] = bw
    left = budget_s - (time.monotonic() - t0)
    result["sweep"] = gpu_sweep(achievable_gbs=bw["read_GB/s"],
                                flex_budget_s=max(0.0, min(90.0, left - 150.0)))
    result["goals"] = goals(result["sweep"])
    result["seconds"] = time.monotonic() - t0
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged_lib.bench.gpu_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="reports", help="folder for the report")
    parser.add_argument("--skip-tests", action="store_true", help="skip the pytest run")
    args = parser.parse_args(argv)
    try:
        result = run_check(skip_tests=args.skip_tests)
    except NeedsGPU as err:
        print(err, file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gpu-check-{device_slug(result['environment']['device'])}"
    report = format_report(result)
    stem.with_suffix(".md").write_text(report)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(report)
    print(f"wrote {stem}.md and {stem}.json")
    failed = (not result.get("tests", {"ok": True})["ok"]
              or any(not r["ok"] for r in result["correctness"]))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
