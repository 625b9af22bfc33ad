"""The kernels compile for A100 (sm_80) and H100/H200 (sm_90) without a GPU: no spills in
16-bit types, shared memory within the arch's limit, 128-bit loads, no tl.dot for MHA.

The interpreter accepts code no GPU compiles (a tile too large for shared memory, a
``tl.dot`` too small); this compiles kernels natively, in a subprocess (the tool turns
the interpreter off before Triton loads), with Triton's bundled ``ptxas``. A
representative subset, once per arch in a module fixture; the full sweep (every decode
and prefill config in fp16, bf16 and fp32) is ``tools/aot_compile.py --arch 80|90``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHS = (80, 90)
#: The heaviest configs (head size 256, MQA's 71 heads, the largest autotune tile), MHA's
#: tile without tl.dot next to GQA's with it, a group of 5 in prefill, head size 40.
SUBSET = ["decode 32/32 d128 b16 fp16", "decode 32/8 d128 b16 bf16", "decode 71/1 d256 b16 fp16",
          "decode 64/1 d40 b128 fp16 split", "decode autotune TILE_N=128",
          "prefill 71/1 d256 b16 bf16", "prefill 40/8 d112 b12 fp16"]


@pytest.fixture(scope="module")
def compiled() -> dict[int, dict[str, dict]]:
    """Per arch: kernel name -> shared_KB, regs, spills ("st/ld"), load_bits, mma."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    args = [a for m in SUBSET for a in ("--match", m)]
    runs = {arch: subprocess.Popen([sys.executable, str(ROOT / "tools" / "aot_compile.py"),
                                    "--arch", str(arch), *args], cwd=ROOT, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for arch in ARCHS}
    out = {}
    for arch, run in runs.items():
        stdout, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stdout + stderr[-2000:]
        rows = {}
        for line in stdout.splitlines()[1:]:
            *name, shared, regs, spills, bits, mma, _ = line.split()
            rows[" ".join(name)] = dict(shared_KB=float(shared), regs=int(regs),
                                        spills=spills, load_bits=int(bits), mma=int(mma))
        out[arch] = rows
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_of_the_subset_compiles_without_spills(compiled, arch):
    from paged_lib.kernels.triton_decode import smem_limit

    rows = compiled[arch]
    for m in SUBSET:
        assert any(m in name for name in rows), f"{m} did not compile for sm_{arch}"
    for name, r in rows.items():
        assert r["spills"] == "0/0", f"{name} spills {r['spills']} bytes on sm_{arch}"
        assert 0 < r["regs"] <= 255, (name, r)
        assert r["shared_KB"] * 1024 <= smem_limit(arch=arch), (name, r)
        assert r["load_bits"] == 128, f"{name}: rows should load as 128-bit vectors"


@pytest.mark.parametrize("arch", ARCHS)
def test_mha_decode_uses_no_tensor_cores_and_less_shared_memory(compiled, arch):
    """MHA's one-row tile: no mma (a 16-row tl.dot would be 15/16 padding)."""
    rows = compiled[arch]
    mha, gqa = rows["decode 32/32 d128 b16 fp16"], rows["decode 32/8 d128 b16 bf16"]
    assert mha["mma"] == 0 and gqa["mma"] > 0
    assert mha["shared_KB"] < gqa["shared_KB"] / 2
