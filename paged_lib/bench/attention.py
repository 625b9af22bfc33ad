"""Benchmarks of the course's kernels and engine.

    python -m paged_lib.bench attention     # the paged decode kernel
    python -m paged_lib.bench engine ...    # the engine (paged_lib.bench.engine)

Every number is checked before it is printed: each implementation's output is compared
with the float64 reference (:func:`~paged_lib.kernels.reference.ref_paged_attention`) on
the very batch it is then timed on, and an implementation that disagrees gets
``WRONG`` in its row instead of a time (:func:`measure` is the only way to a time).

On a GPU: decode over batch sizes and context lengths, timed with CUDA graphs
(``triton.testing.do_bench_cudagraph``: the launch overhead a serving engine removes
the same way), medians, with the chosen tile config and the real split count. Each
kernel is reported in GB/s (the bytes decode must read: every cached K and V of every
sequence, plus q and the output), as a share of the bandwidth a large plain read
reaches on this machine (:func:`read_bandwidth`) and of the spec peak, and against
contiguous attention (SDPA on unpaged K/V of the same lengths). FlexAttention's paged
attention runs last, time-boxed: compiling it can take minutes.

On a CPU, where Triton only interprets, the torch backend is timed against contiguous
per-sequence SDPA and FlexAttention paged (eager) on one configuration, as time ratios.

The notebooks call :func:`gpu_sweep` / :func:`cpu_ratios` (lists of dict rows) and
:func:`format_table`.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import torch

import paged_lib  # noqa: F401  (sets TRITON_INTERPRET before any kernel is defined)
from paged_lib.kernels.cases import DecodeCase, make_decode_case
from paged_lib.kernels.reference import (  # noqa: F401  (the baselines, by their old names)
    contiguous_kv,
    flex_paged_attention,
    ref_paged_attention,
    sdpa_per_sequence,
    sdpa_per_sequence_gqa,
)
from paged_lib.util import CheckFailed

#: Peak HBM bandwidth in GB/s, matched against ``torch.cuda.get_device_name()`` in order
#: (first substring that occurs wins, so the more specific names come first).
PEAK_BANDWIDTH_GBS: list[tuple[str, float]] = [
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    ("H800", 3350.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100", 1555.0),  # 40 GB
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("RTX 4090", 1008.0),
    ("RTX 3090", 936.0),
    ("V100", 900.0),
    ("T4", 320.0),
]


def peak_bandwidth_gbs(device_name: str) -> float | None:
    """The device's peak memory bandwidth in GB/s, or None if it is not in the table."""
    for key, gbs in PEAK_BANDWIDTH_GBS:
        if key in device_name:
            return gbs
    return None


#: How close a benchmarked output must be to the float64 reference, per dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
#: Text a row shows instead of a time when its output was wrong.
WRONG = "WRONG"


def check_output(name: str, out: torch.Tensor, expected: torch.Tensor) -> None:
    """Raise :class:`CheckFailed` unless ``out`` matches ``expected`` within the tolerance."""
    if out.shape != expected.shape:
        raise CheckFailed(f"{name}: shape {tuple(out.shape)}, expected {tuple(expected.shape)}")
    tol = TOLERANCE.get(out.dtype, 1e-4)
    err = (out.double() - expected.double()).abs()
    bound = tol + tol * expected.double().abs()
    if not bool(torch.isfinite(out).all()) or bool((err > bound).any()):
        raise CheckFailed(f"{name}: max error {float(err.nan_to_num(float('inf')).max()):.3g} "
                          f"(tolerance {tol:g})")


def measure(name: str, fn: Callable[[], torch.Tensor], expected: torch.Tensor,
            timer: Callable[[Callable[[], object]], float]) -> float:
    """Run ``fn`` once, check its output against ``expected``, then time it (ms).

    The one way to a time in this module: a wrong output raises :class:`CheckFailed`
    and nothing is timed.
    """
    check_output(name, fn(), expected)
    return timer(fn)


def decode_bytes(case: DecodeCase) -> int:
    """Bytes a decode step must move at least: all cached K/V it attends to, q, output."""
    q, k_cache = case.q, case.k_cache
    kv_per_token = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    return int(case.seq_lens.sum()) * kv_per_token + 2 * q.numel() * q.element_size()


def median_ms(fn: Callable[[], object], repeats: int, warmup: int | None = None) -> float:
    """Median wall time in ms (by default one untimed warm-up run first when repeats > 1)."""
    for _ in range((1 if repeats > 1 else 0) if warmup is None else warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


_median_ms = median_ms  # the name chapter 04's notebook knew


def gpu_timer(fn: Callable[[], object]) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph; plain ``do_bench`` (launch
    overhead included, and said so) if it cannot be captured."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as err:  # noqa: BLE001 - not capturable: time it without a graph
        print(f"note: not capturable in a CUDA graph ({type(err).__name__}); timed with "
              "do_bench, launch overhead included")
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, rep=100, return_mode="median")


def read_bandwidth(device: str = "cuda", nbytes: int = 4 * 2**30) -> dict:
    """What this machine's memory really delivers: a large plain read (a sum over
    ``nbytes`` of fp16) and a large copy, in GB/s (medians). Decode is a read: this is
    the ceiling a paged kernel can be held to, typically 85-90% of the spec peak."""
    import triton.testing

    x = torch.ones(nbytes // 2, dtype=torch.float16, device=device)
    read_ms = triton.testing.do_bench(lambda: x.sum(dtype=torch.float32), return_mode="median")
    y = torch.empty_like(x)
    copy_ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    return {"read_GB/s": nbytes / (read_ms * 1e-3) / 1e9,
            "copy_GB/s": 2 * nbytes / (copy_ms * 1e-3) / 1e9, "bytes": nbytes}


def cpu_ratios(num_seqs: int = 16, num_heads: int = 32, num_kv_heads: int = 8,
               head_dim: int = 128, min_len: int = 512, max_len: int = 1536,
               block_size: int = 16, seed: int = 0, repeats: int = 5,
               flex_repeats: int = 1, sdpa_gqa: bool = True) -> list[dict]:
    """Time the torch backend, contiguous SDPA and FlexAttention paged on the CPU (fp32).

    Rows: ``{"impl", "ms", "vs_sdpa", "check"}`` (``vs_sdpa``: time / contiguous SDPA's
    time; ``check``: ``"ok"``, or ``WRONG`` with no time). Each implementation's output
    is checked against the float64 reference first. FlexAttention without
    ``torch.compile`` materializes scores over the whole cache and evaluates its mask
    element by element: seconds per call, so it runs last, ``flex_repeats`` times (0
    leaves it out). (Compiled FlexAttention is left out on the CPU: with torch 2.13 its
    paged form returned wrong values or failed to compile on our cases.) ``sdpa_gqa``
    adds the straightforward SDPA call with ``enable_gqa=True`` as a second, slower
    contiguous baseline.
    """
    from paged_lib.kernels import paged_attention

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (num_seqs,), generator=g).tolist()
    case = make_decode_case(lens, num_heads, num_kv_heads, head_dim, block_size, seed=seed,
                            shared=False, poison=False)
    expected = ref_paged_attention(*case)
    kv = contiguous_kv(*case[1:5])
    impls = [("contiguous SDPA (per sequence)", lambda: sdpa_per_sequence(case.q, kv, case.scale))]
    if sdpa_gqa:
        impls.append(("contiguous SDPA, enable_gqa=True",
                      lambda: sdpa_per_sequence_gqa(case.q, kv, case.scale)))
    impls.append(("paged, torch backend", lambda: paged_attention(*case, backend="torch")))
    rows = [_cpu_row(name, fn, expected, repeats) for name, fn in impls]
    if flex_repeats:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
            flex = flex_paged_attention(*case)
            rows.append(_cpu_row("FlexAttention paged (eager)", flex, expected, flex_repeats))
    sdpa_ms = rows[0]["ms"]
    for row in rows:
        row["vs_sdpa"] = row["ms"] / sdpa_ms
    return rows


def _cpu_row(name: str, fn: Callable[[], torch.Tensor], expected: torch.Tensor,
             repeats: int) -> dict:
    try:
        # The check's run is the warm-up.
        ms = measure(name, fn, expected, lambda f: median_ms(f, repeats, warmup=0))
        return {"impl": name, "ms": ms, "check": "ok"}
    except CheckFailed as err:
        print(f"not timed: {err}")
        return {"impl": name, "ms": float("nan"), "check": WRONG}


def gpu_sweep(context_lens: Sequence[int] = (512, 4096, 32768),
              batches: Sequence[int] = (1, 8, 64), num_heads: int = 32, num_kv_heads: int = 8,
              head_dim: int = 128, block_size: int = 16, dtype: torch.dtype = torch.float16,
              include_flex: bool = True, flex_budget_s: float = 120.0,
              achievable_gbs: float | None = None) -> list[dict]:
    """Decode on the GPU: triton paged vs contiguous SDPA, then FlexAttention paged.

    Every sequence of a batch has the same context length, so contiguous attention is
    one batched SDPA call with no padding: the fairest unpaged baseline. Rows: batch,
    context, splits, config, triton_us, GB/s, %achievable (of ``achievable_gbs``, a
    measured plain read), %peak (spec), sdpa_us, vs_sdpa, flex_us; a time is a string
    (``WRONG``, or why it is missing) where it could not be checked.
    FlexAttention runs after everything else, until ``flex_budget_s`` is spent.
    """
    import torch.nn.functional as F

    from paged_lib.kernels import paged_attention
    from paged_lib.kernels import triton_decode as td

    if not torch.cuda.is_available():
        raise RuntimeError("gpu_sweep needs a CUDA GPU")
    peak = peak_bandwidth_gbs(torch.cuda.get_device_name())
    nan = float("nan")
    rows, flex_jobs = [], []
    for batch in batches:
        for ctx in context_lens:
            case = make_decode_case([ctx] * batch, num_heads, num_kv_heads, head_dim,
                                    block_size, dtype, "cuda", shared=False, poison=False)
            expected = ref_paged_attention(*case)  # float64 on the GPU

            def paged(case=case, ctx=ctx):
                return paged_attention(*case, validate=False, max_seq_len=ctx)

            row = {"batch": batch, "context": ctx, "splits": "-", "config": "-"}
            try:
                t_ms = measure("triton paged", paged, expected, gpu_timer)
                gbs = decode_bytes(case) / (t_ms * 1e-3) / 1e9
                row.update(splits=td.LAST_LAUNCH["num_splits"], config=td.LAST_LAUNCH["config"],
                           triton_us=1e3 * t_ms, **{"GB/s": gbs})
                row["%achievable"] = gbs / achievable_gbs if achievable_gbs else nan
                row["%peak"] = gbs / peak if peak else nan
            except CheckFailed as err:
                print(f"not timed: {err}")
                t_ms = None
                row.update(triton_us=WRONG, **{"GB/s": nan, "%achievable": nan, "%peak": nan})
            kv = contiguous_kv(*case[1:5])
            k = torch.stack([k for k, _ in kv])  # [B, KV, L, D], unpaged
            v = torch.stack([v for _, v in kv])
            del kv
            # The query heads of a KV head as query rows: GQA with no K/V copies.
            q4 = case.q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)

            def sdpa(q4=q4, k=k, v=v, case=case):
                return F.scaled_dot_product_attention(q4, k, v, scale=case.scale).reshape(
                    case.q.shape)

            try:
                s_ms = measure("contiguous SDPA", sdpa, expected, gpu_timer)
                row["sdpa_us"] = 1e3 * s_ms
                row["vs_sdpa"] = t_ms / s_ms if t_ms is not None else nan
            except CheckFailed as err:
                print(f"not timed: {err}")
                row.update(sdpa_us=WRONG, vs_sdpa=nan)
            row["flex_us"] = "not run"
            rows.append(row)
            if include_flex:
                flex_jobs.append((row, batch, ctx))
            del case, expected, k, v, q4
            torch.cuda.empty_cache()
    _flex_pass(flex_jobs, num_heads, num_kv_heads, head_dim, block_size, dtype, flex_budget_s)
    return rows


def _flex_pass(jobs: list, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               dtype: torch.dtype, budget_s: float) -> None:
    """FlexAttention paged (compiled) for the rows in ``jobs``, until ``budget_s`` is spent."""
    deadline = time.monotonic() + budget_s
    for row, batch, ctx in jobs:
        if time.monotonic() > deadline:
            row["flex_us"] = "time box"
            continue
        case = make_decode_case([ctx] * batch, num_heads, num_kv_heads, head_dim, block_size,
                                dtype, "cuda", shared=False, poison=False)
        try:
            flex = flex_paged_attention(*case, compiled=True)
            expected = ref_paged_attention(*case)
            row["flex_us"] = 1e3 * measure("FlexAttention paged", flex, expected, gpu_timer)
        except CheckFailed as err:
            print(f"not timed: {err}")
            row["flex_us"] = WRONG
        except Exception as err:  # noqa: BLE001 - report, stop trying
            print(f"FlexAttention paged failed at batch {batch}, context {ctx}: "
                  f"{type(err).__name__}: {str(err)[:200]}")
            row["flex_us"] = "failed"
            deadline = 0.0
        del case
        torch.cuda.empty_cache()


def goals(rows: list[dict]) -> list[str]:
    """The speed goals (chapter 05), each with the measured value and met / NOT met.

    Batch 64 at 4K: >= 75% of spec bandwidth and <= 1.25x contiguous SDPA; batch 1 at
    32K: >= 50% of spec bandwidth (decode, 32/8 heads, head size 128, fp16).
    """
    out = []
    for batch, ctx, share, ratio in ((64, 4096, 0.75, 1.25), (1, 32768, 0.50, None)):
        row = next((r for r in rows if r["batch"] == batch and r["context"] == ctx), None)
        if row is None or not isinstance(row.get("triton_us"), float):
            out.append(f"batch {batch} at {ctx}: not measured")
            continue
        got = row["%peak"]
        line = (f"batch {batch} at {ctx}: {got:.0%} of spec peak (goal >= {share:.0%}): "
                f"{'met' if got >= share else 'NOT met'}")
        if ratio is not None and isinstance(row.get("sdpa_us"), float):
            line += (f"; {row['vs_sdpa']:.2f}x contiguous SDPA (goal <= {ratio}x): "
                     f"{'met' if row['vs_sdpa'] <= ratio else 'NOT met'}")
        out.append(line)
    return out


def format_value(col: str, x: object) -> str:
    """One table cell: floats with 3 significant digits (NaN as -), ``%`` columns as %."""
    if isinstance(x, float):
        if x != x:
            return "-"
        if col.startswith("%"):
            return f"{x:.0%}"
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def format_table(rows: list[dict]) -> str:
    """A plain-text table: floats with 3 significant digits, percentages as %."""
    if not rows:
        return "(no rows)"
    cols = list(dict.fromkeys(c for r in rows for c in r))
    cells = [[format_value(c, r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))
    out = [line, "-" * len(line)]
    out += ["  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(out)


def attention_report() -> str:
    """What ``python -m paged_lib.bench attention`` prints."""
    from paged_lib.device import interpreter_on

    if torch.cuda.is_available() and not interpreter_on():
        name = torch.cuda.get_device_name()
        peak = peak_bandwidth_gbs(name)
        bw = read_bandwidth()
        head = [f"Paged decode on {name}: 32 query / 8 KV heads, head_dim 128, block 16, fp16.",
                f"Spec peak {peak:.0f} GB/s" if peak else "Spec peak unknown (GB/s only)",
                f"Measured: plain read {bw['read_GB/s']:.0f} GB/s, copy {bw['copy_GB/s']:.0f} "
                "GB/s (%achievable is of the read)",
                "Times: medians over CUDA-graph replays, each implementation checked against "
                "the float64 reference on the same batch first."]
        rows = gpu_sweep(achievable_gbs=bw["read_GB/s"])
        return "\n".join([*head, format_table(rows), "", "Goals:", *goals(rows)])
    head = ("CPU (no GPU, Triton only interprets): torch backend vs contiguous SDPA vs "
            "FlexAttention paged;\n16 sequences, 32 query / 8 KV heads, head_dim 128, "
            "lengths 512-1536 (seed 0), block 16, fp32; every output checked against the "
            "float64 reference before it is timed")
    return head + "\n" + format_table(cpu_ratios())


def run_engine_bench(argv: Sequence[str]) -> int:
    """``python -m paged_lib.bench engine ...``: the engine's own benchmark, imported late."""
    try:
        module = importlib.import_module("paged_lib.bench.engine")
    except ModuleNotFoundError as err:
        if err.name not in ("paged_lib.engine", "paged_lib.bench.engine"):
            raise
        print("The engine benchmark (paged_lib/bench/engine.py, chapter 06) is not in this "
              "checkout yet: nothing to run.")
        return 2
    return int(module.main(list(argv)) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged_lib.bench",
                                     description="Benchmarks of the course's kernels and engine.")
    parser.add_argument("what", choices=["attention", "engine"], help="what to benchmark")
    parser.add_argument("rest", nargs=argparse.REMAINDER,
                        help="for 'engine': its own options (python -m paged_lib.bench engine "
                        "--help)")
    args = parser.parse_args(argv)
    if args.what == "engine":
        return run_engine_bench(args.rest)
    if args.rest:
        parser.error(f"'attention' takes no options, got {args.rest}")
    print(attention_report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
