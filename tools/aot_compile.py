"""Compile the course's Triton kernels for a GPU on a machine without one (ahead of time).

    .venv/bin/python tools/aot_compile.py [--arch 90] [--quick] [--match "decode 64/1" ...]

Triton's interpreter checks no hardware limit; this does the next best thing to a GPU
run: Triton compiles each kernel, for the shapes and configs the launchers use, down to
PTX and a cubin for ``sm_<arch>`` (Triton ships ``ptxas``), and ``ptxas -v`` reports
registers and spills, and the PTX shows the widest global load or cp.async copy (128
bits: rows are vectorised, e.g. head size 40 thanks to the kernels' ``ALIGN`` hint)
and how many tensor-core instructions (``mma``/``wgmma``) it holds. Configs are chosen
for ``--arch``'s shared memory per block (``triton_decode.smem_limit``).
A config that needs too much shared memory, a ``tl.dot`` shape the
GPU cannot do, or a tile that spills shows up here, before anyone has a GPU. (Whether the
result is *right* is for the tests, and for ``make gpu-check`` on a real GPU.)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, even without a GPU (before triton loads)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

#: Pointer arguments that hold int32 (block tables, lengths) or fp32 (split partials).
INT_PTRS = {"block_tables_ptr", "seq_lens_ptr", "query_start_ptr", "slot_mapping_ptr"}
FP32_PTRS = {"lse_ptr", "partial_ptr"}
FLOAT_ARGS = {"scale_log2"}


def signature(fn, constexprs: dict, dtype: str, out_fp32: bool = False) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in INT_PTRS:
            sig[name] = "*i32" if name != "slot_mapping_ptr" else "*i64"
        elif name in FP32_PTRS or (out_fp32 and name == "out_ptr"):
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def ptxas_report(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from ``ptxas -v``."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        suffix = "a" if arch >= 90 else ""
        done = subprocess.run([ptxas, f"-arch=sm_{arch}{suffix}", "-v", str(src), "-o",
                               str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
    text = done.stdout + done.stderr
    regs = int(m.group(1)) if (m := re.search(r"Used (\d+) registers", text)) else -1
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return regs, int(spills.group(1)) if spills else -1, int(spills.group(2)) if spills else -1


def specialize(fn, constexprs: dict, ints: dict) -> tuple[dict, dict]:
    """What Triton's launcher does with real arguments: an int equal to 1 (a unit stride)
    becomes a constant; pointers (16-byte aligned tensors) and ints divisible by 16 get
    ``tt.divisibility=16``, which is what lets the compiler emit vector loads."""
    constexprs = {**constexprs, **{k: 1 for k, v in ints.items() if v == 1}}
    attrs = {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            continue
        if name.endswith("_ptr") or ints.get(name, 1) % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return constexprs, attrs


def decode_ints(num_heads: int, kv_heads: int, head_dim: int, block_size: int,
                max_blocks: int = 64) -> dict:
    """The int arguments of a decode launch on contiguous tensors of these sizes."""
    kv = (block_size * kv_heads * head_dim, kv_heads * head_dim, head_dim, 1)
    return dict(zip(["stride_qs", "stride_qh", "stride_qd", "stride_kb", "stride_kt", "stride_kh",
                     "stride_kd", "stride_vb", "stride_vt", "stride_vh", "stride_vd",
                     "stride_bts", "stride_btb", "stride_ot", "stride_oh", "stride_od"],
                    [num_heads * head_dim, head_dim, 1, *kv, *kv, max_blocks, 1,
                     num_heads * head_dim, head_dim, 1], strict=True)) | {
        "stride_os": num_heads * head_dim, "stride_osplit": head_dim}


def compile_one(fn, constexprs: dict, dtype: str, arch: int, num_warps: int, num_stages: int,
                out_fp32: bool = False, ints: dict | None = None) -> dict:
    constexprs, attrs = specialize(fn, constexprs, ints or {})
    src = triton.compiler.ASTSource(fn=fn, signature=signature(fn, constexprs, dtype, out_fp32),
                                    constexprs=constexprs, attrs=attrs)
    t0 = time.monotonic()
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": num_warps, "num_stages": num_stages})
    regs, spill_st, spill_ld = ptxas_report(k.asm["ptx"], arch)
    # K/V tiles are loaded either by cp.async (pipelined into shared memory; its size is
    # the last operand) or by ld.global; the widest of either tells whether rows are vectorised.
    ptx = k.asm["ptx"]
    loads = re.findall(r"ld\.global(?:\.\w+)*?\.(v[248]\.)?b(\d+)", ptx)
    widest = max((int(b) * int((v or "v1.")[1]) for v, b in loads), default=0)
    copies = re.findall(r"cp\.async\.c[ag]\.shared\.global[^,]*,[^,]*,\s*(0x[0-9a-f]+|\d+)", ptx)
    widest = max([widest, *(8 * int(n, 0) for n in copies)])
    mma = len(re.findall(r"\b(?:mma\.sync|wgmma\.mma_async)\.", ptx))
    return {"shared_KB": k.metadata.shared / 1024, "regs": regs, "spill_st": spill_st,
            "spill_ld": spill_ld, "load_bits": widest, "mma": mma,
            "s": round(time.monotonic() - t0, 1)}


#: Decode shapes ((num_heads, num_kv_heads), head_dim, block_size): GQA 4:1, 3:1, 5:1,
#: MQA 64:1 and 71:1, MHA (a 1-row tile without tl.dot); odd head and block sizes.
DECODE_SHAPES = [((32, 8), 128, 16), ((12, 4), 96, 1), ((40, 8), 112, 12), ((64, 1), 40, 128),
                 ((71, 1), 256, 16), ((8, 2), 72, 32), ((32, 32), 128, 16), ((16, 16), 256, 8),
                 ((12, 12), 64, 12)]
#: Prefill shapes: GQA 4:1, MQA 64:1 and 71:1, MHA, group 5 (12 tokens x 5 heads a tile).
PREFILL_SHAPES = [((32, 8), 128, 16), ((64, 1), 40, 128), ((71, 1), 256, 16),
                  ((32, 32), 128, 16), ((40, 8), 112, 12)]


def decode_jobs(quick: bool, arch: int = 90):
    import torch

    from paged_lib.kernels import triton_decode as td

    smem = td.smem_limit(arch=arch)
    shapes = DECODE_SHAPES
    if quick:
        shapes = shapes[:1] + shapes[4:5] + shapes[6:7]
    for (h, kv), d, b in shapes:
        for dtype, tdt in (("fp16", torch.float16), ("bf16", torch.bfloat16),
                           ("fp32", torch.float32)):
            if quick and dtype == "bf16":
                continue
            cfg = td.launch_config(d, tdt, smem)
            for split in (False, True):
                c = dict(GROUP=h // kv, GROUP_TILE=td.group_tile(h // kv), HEAD_DIM=d,
                         HEAD_PAD=td.head_pad(d), ALIGN=td.alignment(d * kv * b, d * kv, d),
                         BLOCK_SIZE=b, TILE_N=cfg["TILE_N"], IS_SPLIT=split, UPCAST=False,
                         DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", KV_QUANT=0)
                name = f"decode {h}/{kv} d{d} b{b} {dtype}{' split' if split else ''}"
                yield name, td._paged_decode_kernel, c, dtype, cfg["num_warps"], \
                    cfg["num_stages"], split, decode_ints(h, kv, d, b)
    if not quick:
        for t, w, s in td.gpu_configs(128, torch.float16, smem):
            c = dict(GROUP=4, GROUP_TILE=16, HEAD_DIM=128, HEAD_PAD=128, ALIGN=16, BLOCK_SIZE=16,
                     TILE_N=t, IS_SPLIT=False, UPCAST=False, DOT_PRECISION="tf32",
                     KV_QUANT=0)
            yield f"decode autotune TILE_N={t} w{w} s{s}", td._paged_decode_kernel, c, "fp16", \
                w, s, False, decode_ints(32, 8, 128, 16)


def other_jobs(quick: bool):
    import torch

    DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    from paged_lib.kernels import triton_cache, triton_prefill, triton_split

    for (h, kv), d, b in PREFILL_SHAPES[: 1 if quick else None]:
        gt, bq = triton_prefill.prefill_tiles(h // kv)
        ints = decode_ints(h, kv, d, b) | {"stride_qt": h * d, "stride_ot": h * d}
        for dtype in ("fp16",) if quick else ("fp16", "bf16", "fp32"):
            cfg = triton_prefill.prefill_config(d, DTYPES[dtype])
            c = dict(GROUP=h // kv, GROUP_TILE=gt, BLOCK_Q=bq, ROWS=triton_prefill.BLOCK_M,
                     HEAD_DIM=d, HEAD_PAD=max(16, triton.next_power_of_2(d)), ALIGN=8,
                     BLOCK_SIZE=b, TILE_N=cfg["TILE_N"], UPCAST=False,
                     DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", KV_QUANT=0)
            yield f"prefill {h}/{kv} d{d} b{b} {dtype}", triton_prefill._paged_prefill_kernel, \
                c, dtype, cfg["num_warps"], cfg["num_stages"], False, ints
    for splits, d, heads in ((16, 256, 2), (4, 128, 16)):
        c = dict(HEADS=heads, SPLIT_PAD=splits, HEAD_DIM=d, HEAD_PAD=d)
        yield f"merge {splits} splits d{d} {heads} heads", triton_split._merge_splits_kernel, \
            c, "fp16", 4, 3, False, {"stride_os": 32 * d, "stride_oh": d, "stride_od": 1}
    c = dict(NUM_KV_HEADS=8, HEADS_PAD=8, HEAD_DIM=128, HEAD_PAD=128, BLOCK_SIZE=16)
    ints = dict(zip(triton_cache._reshape_and_cache_kernel.arg_names[5:19],
                    [1024, 128, 1] * 2 + [16 * 1024, 1024, 128, 1] * 2, strict=True))
    yield "reshape_and_cache kv8 d128", triton_cache._reshape_and_cache_kernel, c, "fp16", 4, 3, \
        False, ints


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability (90: H100/H200)")
    parser.add_argument("--quick", action="store_true", help="a few representative kernels")
    parser.add_argument("--match", action="append", default=[],
                        help="only kernels whose name contains this (repeatable: any of them)")
    args = parser.parse_args(argv)
    import paged_lib  # noqa: F401

    failed = 0
    print(f"{'kernel':44s} {'shared KB':>9s} {'regs':>5s} {'spill st/ld':>12s} "
          f"{'load bits':>9s} {'mma':>5s} {'s':>5s}")
    for name, fn, c, dtype, w, s, split, ints in [*decode_jobs(args.quick, args.arch),
                                                  *other_jobs(args.quick)]:
        if args.match and not any(m in name for m in args.match):
            continue
        try:
            r = compile_one(fn, c, dtype, args.arch, w, s, out_fp32=split, ints=ints)
        except Exception as err:  # noqa: BLE001 - report every failure, keep going
            failed += 1
            print(f"{name:44s} FAILED: {type(err).__name__}: {str(err)[:300]}", flush=True)
            continue
        spill = f"{r['spill_st']}/{r['spill_ld']}"
        print(f"{name:44s} {r['shared_KB']:9.1f} {r['regs']:5d} {spill:>12s} "
              f"{r['load_bits']:9d} {r['mma']:5d} {r['s']:5.1f}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
