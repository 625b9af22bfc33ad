"""Benchmarks for the paged decode kernel.

    python -m paged_lib.bench attention

On a GPU: ``triton.testing.do_bench`` sweeps over context length and batch size, each
reported in GB/s (the bytes decode must read: every cached K and V of every sequence,
plus q and the output) against the device's peak HBM bandwidth, and against contiguous
attention (SDPA on unpaged K/V of the same lengths) and FlexAttention's paged attention.

On a CPU, where Triton only interprets, the torch backend is timed against contiguous
per-sequence SDPA and FlexAttention paged (eager) on one configuration, as time ratios.

The notebook calls :func:`gpu_sweep` / :func:`cpu_ratios` (lists of dict rows) and
:func:`format_table`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

import paged_lib  # noqa: F401  (sets TRITON_INTERPRET before any kernel is defined)

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


def make_decode_case(seq_lens: Sequence[int], num_heads: int = 32, num_kv_heads: int = 8,
                     head_dim: int = 128, block_size: int = 16,
                     dtype: torch.dtype = torch.float32, device: str = "cpu",
                     seed: int = 0) -> dict:
    """A decode batch with its blocks scattered over the cache (a shuffled free list).

    Returns q, k_cache, v_cache, block_tables, seq_lens (int32), scale.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    max_blocks = max(blocks_per_seq)
    physical = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    start = 0
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = physical[start:start + nb]
        start += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    gd = torch.Generator(device=device).manual_seed(seed)  # GBs of cache: draw on the device
    k_cache = torch.randn(shape, generator=gd, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gd, device=device, dtype=dtype)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gd, device=device, dtype=dtype)
    return {
        "q": q, "k_cache": k_cache, "v_cache": v_cache,
        "block_tables": block_tables.to(device),
        "seq_lens": torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        "scale": head_dim ** -0.5,
    }


def decode_bytes(case: dict) -> int:
    """Bytes a decode step must move at least: all cached K/V it attends to, q, output."""
    q, k_cache = case["q"], case["k_cache"]
    kv_per_token = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    return int(case["seq_lens"].sum()) * kv_per_token + 2 * q.numel() * q.element_size()


def contiguous_kv(case: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each sequence's K/V as contiguous ``[num_kv_heads, seq_len, head_dim]`` tensors."""
    from paged_lib.kernels.reference import gather_kv

    out = []
    for s, n in enumerate(case["seq_lens"].tolist()):
        k = gather_kv(case["k_cache"], case["block_tables"][s], n).transpose(0, 1).contiguous()
        v = gather_kv(case["v_cache"], case["block_tables"][s], n).transpose(0, 1).contiguous()
        out.append((k, v))
    return out


def sdpa_per_sequence(q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]],
                      scale: float) -> torch.Tensor:
    """Contiguous attention, one SDPA call per sequence (lengths differ).

    For one query token, the ``group`` query heads that share a KV head are just
    ``group`` query rows against that head's K/V, so q is viewed as
    ``[num_kv_heads, group, head_dim]``: GQA with no copies of K/V (the fastest
    contiguous form on a CPU; ``enable_gqa=True`` is several times slower there).
    """
    outs = []
    for s, (k, v) in enumerate(kv):
        qs = q[s].view(k.shape[0], -1, q.shape[-1])
        outs.append(F.scaled_dot_product_attention(qs, k, v, scale=scale).reshape(q.shape[1:]))
    return torch.stack(outs)


def sdpa_per_sequence_gqa(q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]],
                          scale: float) -> torch.Tensor:
    """Contiguous attention the straightforward way: one SDPA call per sequence with
    ``enable_gqa=True`` (one query token of every head against the KV heads)."""
    outs = []
    for s, (k, v) in enumerate(kv):
        outs.append(F.scaled_dot_product_attention(q[s].unsqueeze(1), k, v, scale=scale,
                                                   enable_gqa=True).squeeze(1))
    return torch.stack(outs)


def flex_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         compiled: bool = False) -> Callable[[], torch.Tensor]:
    """Prepare PyTorch FlexAttention's ``PagedAttention`` on our cache; returns a callable.

    An independent implementation of the same computation: its page table is our block
    table, its cache a ``[1, num_kv_heads, num_blocks * block_size, head_dim]`` view of ours,
    and its mask hides positions past each sequence's length. (It cannot express one
    sequence using the same physical block twice; sharing between sequences is fine.)
    """
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask

    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    device = str(q.device)
    pa = PagedAttention(num_blocks, block_size, num_seqs, device=device)
    for s, n in enumerate(seq_lens.tolist()):
        used = block_tables[s, :-(-n // block_size)].long()
        pa.page_table[s, :len(used)] = used
        pa.physical_to_logical[s, used] = torch.arange(len(used), device=q.device)
    kc = k_cache.permute(2, 0, 1, 3).reshape(1, num_kv_heads, num_blocks * block_size, head_dim)
    vc = v_cache.permute(2, 0, 1, 3).reshape(1, num_kv_heads, num_blocks * block_size, head_dim)
    logical = create_block_mask(noop_mask, num_seqs, None, 1, block_tables.shape[1] * block_size,
                                device=device, BLOCK_SIZE=(1, block_size))
    mask = pa.convert_logical_block_mask(logical, kv_len=seq_lens.long())
    fn = torch.compile(flex_attention) if compiled else flex_attention
    q4 = q.unsqueeze(2)

    def run() -> torch.Tensor:
        return fn(q4, kc, vc, block_mask=mask, scale=scale,
                  enable_gqa=num_heads != num_kv_heads).squeeze(2)

    return run


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time in ms (one untimed warm-up run first when repeats > 1)."""
    for _ in range(1 if repeats > 1 else 0):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def cpu_ratios(num_seqs: int = 16, num_heads: int = 32, num_kv_heads: int = 8,
               head_dim: int = 128, min_len: int = 512, max_len: int = 1536,
               block_size: int = 16, seed: int = 0, repeats: int = 5,
               flex_repeats: int = 1, sdpa_gqa: bool = True) -> list[dict]:
    """Time the torch backend, contiguous SDPA and FlexAttention paged on the CPU (fp32).

    Rows: ``{"impl", "ms", "vs_sdpa"}`` (``vs_sdpa``: time / contiguous SDPA's time).
    FlexAttention without ``torch.compile`` materializes scores over the whole cache and
    evaluates its mask element by element: seconds per call, so it runs ``flex_repeats``
    times (0 leaves it out). (Compiled FlexAttention is left out on the CPU: with torch
    2.13 its paged form returned wrong values or failed to compile on our cases.)
    ``sdpa_gqa`` adds the straightforward SDPA call with ``enable_gqa=True`` as a second,
    slower contiguous baseline.
    """
    import warnings

    from paged_lib.kernels import paged_attention

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (num_seqs,), generator=g).tolist()
    case = make_decode_case(lens, num_heads, num_kv_heads, head_dim, block_size, seed=seed)
    args = [case[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens")]
    kv = contiguous_kv(case)
    rows = []
    sdpa_ms = _median_ms(lambda: sdpa_per_sequence(case["q"], kv, case["scale"]), repeats)
    rows.append({"impl": "contiguous SDPA (per sequence)", "ms": sdpa_ms})
    if sdpa_gqa:
        ms = _median_ms(lambda: sdpa_per_sequence_gqa(case["q"], kv, case["scale"]), repeats)
        rows.append({"impl": "contiguous SDPA, enable_gqa=True", "ms": ms})
    try:
        ms = _median_ms(lambda: paged_attention(*args, case["scale"], backend="torch"), repeats)
        rows.append({"impl": "paged, torch backend", "ms": ms})
    except ImportError:
        rows.append({"impl": "paged, torch backend (not available)", "ms": float("nan")})
    if flex_repeats:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
            flex = flex_paged_attention(*args, case["scale"])
            rows.append({"impl": "FlexAttention paged (eager)",
                         "ms": _median_ms(flex, flex_repeats)})
    for row in rows:
        row["vs_sdpa"] = row["ms"] / sdpa_ms
    return rows


def gpu_sweep(context_lens: Sequence[int] = (512, 1024, 2048, 4096, 8192),
              batches: Sequence[int] = (1, 8, 64), num_heads: int = 32, num_kv_heads: int = 8,
              head_dim: int = 128, block_size: int = 16, dtype: torch.dtype = torch.float16,
              include_flex: bool = True) -> list[dict]:
    """Decode on the GPU: triton paged vs contiguous SDPA vs FlexAttention paged.

    Every sequence of a batch has the same context length, so contiguous attention is
    one batched SDPA call with no padding: the fairest unpaged baseline.
    Rows: batch, context, splits, triton_us, GB/s, %peak, sdpa_us, vs_sdpa, flex_us.
    """
    import triton.testing

    from paged_lib.kernels.triton_decode import num_sms, paged_attention_triton
    from paged_lib.kernels.triton_split import choose_num_splits

    if not torch.cuda.is_available():
        raise RuntimeError("gpu_sweep needs a CUDA GPU")
    peak = peak_bandwidth_gbs(torch.cuda.get_device_name())
    rows = []
    for batch in batches:
        for ctx in context_lens:
            case = make_decode_case([ctx] * batch, num_heads, num_kv_heads, head_dim,
                                    block_size, dtype, device="cuda")
            args = [case[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens")]
            splits = choose_num_splits(batch, num_kv_heads, ctx, num_sms(case["q"].device))
            t_ms = triton.testing.do_bench(
                lambda args=args, case=case, ctx=ctx: paged_attention_triton(
                    *args, case["scale"], max_seq_len=ctx))
            kv = contiguous_kv(case)
            k = torch.stack([k for k, _ in kv])  # [B, KV, L, D], unpaged
            v = torch.stack([v for _, v in kv])
            del kv
            # The query heads of a KV head as query rows: GQA with no K/V copies.
            q4 = case["q"].view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
            sdpa_ms = triton.testing.do_bench(
                lambda q4=q4, k=k, v=v, case=case: F.scaled_dot_product_attention(
                    q4, k, v, scale=case["scale"]))
            gbs = decode_bytes(case) / (t_ms * 1e-3) / 1e9
            row = {"batch": batch, "context": ctx, "splits": splits,
                   "triton_us": 1e3 * t_ms, "GB/s": gbs,
                   "%peak": gbs / peak if peak else float("nan"),
                   "sdpa_us": 1e3 * sdpa_ms, "vs_sdpa": t_ms / sdpa_ms,
                   "flex_us": float("nan")}
            if include_flex:
                try:
                    flex = flex_paged_attention(*args, case["scale"], compiled=True)
                    row["flex_us"] = 1e3 * triton.testing.do_bench(flex)
                except Exception as err:  # noqa: BLE001 - report, keep sweeping
                    print(f"FlexAttention paged failed at batch {batch}, context {ctx}: "
                          f"{type(err).__name__}: {str(err)[:200]}")
                    include_flex = False
            rows.append(row)
            del case, args, k, v
    return rows


def format_table(rows: list[dict]) -> str:
    """A plain-text table: floats with 3 significant digits, percentages as %."""
    if not rows:
        return "(no rows)"
    cols = list(rows[0])

    def fmt(col: str, x: object) -> str:
        if isinstance(x, float):
            if x != x:
                return "-"
            if col.startswith("%"):
                return f"{x:.0%}"
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
        return str(x)

    cells = [[fmt(c, r[c]) for c in cols] for r in rows]
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
        head = (f"Paged decode on {name} (peak {peak:.0f} GB/s), 32 query / 8 KV heads, "
                "head_dim 128, block 16, fp16" if peak else
                f"Paged decode on {name} (peak bandwidth unknown: GB/s only), 32/8 heads, "
                "head_dim 128, block 16, fp16")
        return head + "\n" + format_table(gpu_sweep())
    head = ("CPU (no GPU, Triton only interprets): torch backend vs contiguous SDPA vs "
            "FlexAttention paged;\n16 sequences, 32 query / 8 KV heads, head_dim 128, "
            "lengths 512-1536 (seed 0), block 16, fp32")
    return head + "\n" + format_table(cpu_ratios())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged_lib.bench",
                                     description="Benchmarks of the course's kernels.")
    parser.add_argument("what", choices=["attention"], help="what to benchmark")
    parser.parse_args(argv)
    print(attention_report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
