"""The attention benchmark: the paged decode kernel against contiguous attention.

Every number is checked before it is printed (:mod:`~paged_lib.bench.checks`): each
implementation's output is compared with the float64 reference
(:func:`~paged_lib.kernels.reference.ref_paged_attention`) on the very batch it is then
timed on, and an implementation that disagrees gets ``WRONG`` in its row instead of a time.

On a GPU (:func:`gpu_sweep`): decode over batch sizes and context lengths, timed with CUDA
graphs (:func:`~paged_lib.bench.timing.gpu_timer`: the launch overhead a serving engine
removes the same way), medians, with the launch config and the real split count. Each
kernel is reported in GB/s (the bytes decode must read: every cached K and V of every
sequence, plus q and the output), as a share of the bandwidth a large plain read
reaches on this machine (:func:`~paged_lib.bench.timing.read_bandwidth`) and of the spec
peak (:mod:`~paged_lib.bench.hardware`), and against contiguous attention (SDPA on unpaged
K/V of the same lengths). FlexAttention's paged attention runs last, time-boxed:
compiling it can take minutes.

On a CPU, where Triton only interprets (:func:`cpu_ratios`), the torch backend is timed
on one configuration against three contiguous baselines (SDPA per sequence, grouped
matmuls per sequence, one padded batched SDPA call), FlexAttention paged (eager), and the
memory floor (every K/V byte read once), as time ratios. Rows are dicts;
:mod:`~paged_lib.bench.report` formats them.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence

import torch

import paged_lib  # noqa: F401  (sets TRITON_INTERPRET before any kernel is defined)
from paged_lib.bench.checks import WRONG, measure
from paged_lib.bench.hardware import peak_bandwidth_gbs
from paged_lib.bench.report import format_table, goals
from paged_lib.bench.timing import gpu_timer, median_ms, read_bandwidth
from paged_lib.kernels.cases import DecodeCase, make_decode_case
from paged_lib.kernels.reference import (
    contiguous_kv,
    flex_paged_attention,
    matmul_per_sequence,
    padded_kv,
    ref_paged_attention,
    sdpa_padded,
    sdpa_per_sequence,
    sdpa_per_sequence_gqa,
)
from paged_lib.util import CheckFailed


def decode_bytes(case: DecodeCase) -> int:
    """Bytes a decode step must move at least: all cached K/V it attends to, q, output."""
    q, k_cache = case.q, case.k_cache
    kv_per_token = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    return int(case.seq_lens.sum()) * kv_per_token + 2 * q.numel() * q.element_size()


def cpu_ratios(num_seqs: int = 16, num_heads: int = 32, num_kv_heads: int = 8,
               head_dim: int = 128, min_len: int = 512, max_len: int = 1536,
               block_size: int = 16, seed: int = 0, repeats: int = 5,
               flex_repeats: int = 1, sdpa_gqa: bool = True,
               bandwidth: float | None = None) -> list[dict]:
    """Time the torch backend, contiguous SDPA and FlexAttention paged on the CPU (fp32).

    Rows: ``{"impl", "ms", "vs_sdpa", "check"}`` (``vs_sdpa``: time / contiguous SDPA's
    time; ``check``: ``"ok"``, or ``WRONG`` with no time), and with ``bandwidth`` (bytes/s
    this machine reads, :func:`paged_lib.bench.floor.measure_machine`) ``GB/s`` (the
    bytes decode must read, :func:`decode_bytes`, over the time) and ``x floor`` (the
    time over those bytes at ``bandwidth``). Each implementation's output
    is checked against the float64 reference first. FlexAttention without
    ``torch.compile`` materializes scores over the whole cache and evaluates its mask
    element by element: seconds per call, so it runs last, ``flex_repeats`` times (0
    leaves it out). (Compiled FlexAttention is left out on the CPU: with torch 2.13 its
    paged form returned wrong values or failed to compile on our cases.) ``sdpa_gqa``
    adds the straightforward SDPA call with ``enable_gqa=True`` as a second, slower
    contiguous baseline.
    """
    from paged_lib.kernels import cpu_decode, paged_attention

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (num_seqs,), generator=g).tolist()
    case = make_decode_case(lens, num_heads, num_kv_heads, head_dim, block_size, seed=seed,
                            shared=False, poison=False)
    expected = ref_paged_attention(*case)
    kv = contiguous_kv(*case[1:5])
    k_pad, v_pad, mask = padded_kv(kv)
    impls = [("contiguous SDPA (per sequence)", lambda: sdpa_per_sequence(case.q, kv, case.scale)),
             ("contiguous grouped matmuls", lambda: matmul_per_sequence(case.q, kv, case.scale)),
             ("contiguous SDPA, one padded call",
              lambda: sdpa_padded(case.q, k_pad, v_pad, mask, case.scale))]
    if sdpa_gqa:
        impls.append(("contiguous SDPA, enable_gqa=True",
                      lambda: sdpa_per_sequence_gqa(case.q, kv, case.scale)))
    impls.append(("paged, torch backend", lambda: paged_attention(*case, backend="torch")))
    if cpu_decode.available():
        impls.append(("paged, C kernel (backend='cpu')",
                      lambda: paged_attention(*case, backend="cpu")))
    rows = [_cpu_row(name, fn, expected, repeats) for name, fn in impls]
    if flex_repeats:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
            flex = flex_paged_attention(*case)
            rows.append(_cpu_row("FlexAttention paged (eager)", flex, expected, flex_repeats))
    rows.append(_read_floor_row(kv, repeats))
    sdpa_ms = rows[0]["ms"]
    floor_ms = None if bandwidth is None else 1e3 * decode_bytes(case) / bandwidth
    for row in rows:
        row["vs_sdpa"] = row["ms"] / sdpa_ms
        if floor_ms is not None:
            row["GB/s"] = decode_bytes(case) / row["ms"] / 1e6
            row["x floor"] = row["ms"] / floor_ms
    return rows


def _read_floor_row(kv: list[tuple[torch.Tensor, torch.Tensor]], repeats: int) -> dict:
    """The memory floor: the time to read every cached K and V byte once (a sum over each
    contiguous tensor). Not attention, so nothing to check against the reference: a
    lower bound no decode can beat on this machine."""
    def read_all() -> torch.Tensor:
        return torch.stack([k.sum() + v.sum() for k, v in kv])
    ms = median_ms(read_all, repeats)
    return {"impl": "read K/V once (memory floor)", "ms": ms, "check": "floor"}


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
                _, launch = td.paged_attention_triton(*case[:5], case.scale, max_seq_len=ctx,
                                                      return_launch=True)
                row.update(splits=launch.num_splits, config=launch.config,
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
        try:  # everything CUDA in here: a fault in FlexAttention's kernel (an illegal
            # address leaves the context unusable) must not lose the rows measured before
            case = make_decode_case([ctx] * batch, num_heads, num_kv_heads, head_dim,
                                    block_size, dtype, "cuda", shared=False, poison=False)
            flex = flex_paged_attention(*case, compiled=True)
            expected = ref_paged_attention(*case)
            row["flex_us"] = 1e3 * measure("FlexAttention paged", flex, expected, gpu_timer)
            del case, flex, expected
            torch.cuda.empty_cache()
        except CheckFailed as err:
            print(f"not timed: {err}")
            row["flex_us"] = WRONG
        except Exception as err:  # noqa: BLE001 - report, stop trying
            print(f"FlexAttention paged failed at batch {batch}, context {ctx}: "
                  f"{type(err).__name__}: {str(err)[:200]}")
            row["flex_us"] = "failed"
            deadline = 0.0


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
    from paged_lib.bench.floor import measure_machine

    machine = measure_machine()
    head = ("CPU (no GPU, Triton only interprets): torch backend and C kernel vs contiguous "
            "SDPA vs FlexAttention paged;\n16 sequences, 32 query / 8 KV heads, head_dim 128, "
            "lengths 512-1536 (seed 0), block 16, fp32; every output checked against the "
            "float64 reference before it is timed.\nFloor: " + machine.describe()
            + "; 'x floor' is each time over the time to read the K/V bytes at that rate")
    rows = cpu_ratios(bandwidth=machine.bandwidth)
    return "\n".join([head, format_table(rows), "", "Goal:", cpu_goal(rows)])


def cpu_goal(rows: list[dict]) -> str:
    """The CPU goal: the fastest paged decode within 1.2x of the fastest contiguous one."""
    def fastest(prefix: str) -> dict | None:
        timed = [r for r in rows if r["impl"].startswith(prefix) and r["check"] == "ok"]
        return min(timed, key=lambda r: r["ms"], default=None)

    paged, contiguous = fastest("paged"), fastest("contiguous")
    if paged is None or contiguous is None:
        return "paged / best contiguous: not measured"
    ratio = paged["ms"] / contiguous["ms"]
    return (f"{paged['impl']} / {contiguous['impl']} = {ratio:.2f}x (goal <= 1.2x): "
            f"{'met' if ratio <= 1.2 else 'NOT met'}")
