"""Chapter 05's pictures and benchmark helpers (its graders: tests/test_graders_ch04_05.py)."""

from __future__ import annotations

# First, before triton is imported anywhere: sets TRITON_INTERPRET on a CPU.
import paged_lib  # noqa: F401

# isort: split

import math

import pytest
import torch
from matplotlib.figure import Figure

from paged_lib.bench import __main__ as cli
from paged_lib.bench import attention as bench
from paged_lib.bench.hardware import peak_bandwidth_gbs
from paged_lib.bench.report import format_table
from paged_lib.course.viz import kernel as viz_kernel

# The chapter-05 graders are tested in tests/test_graders_ch04_05.py.


def test_program_reads_picture():
    bt = torch.tensor([[5, 2, 9, -1], [5, 7, -1, -1], [1, 3, 4, 8]], dtype=torch.int32)
    fig = viz_kernel.plot_program_reads(bt, [37, 20, 50], 16, num_blocks=12, num_kv_heads=2)
    assert isinstance(fig, Figure)
    table, cache = fig.axes[:2]
    texts = [t.get_text() for t in table.texts]
    assert "9\n5/16" in texts and "7\n4/16" in texts  # partial last blocks
    assert texts.count("·") == 3  # never-read entries
    hatched = [p for p in cache.patches if p.get_hatch()]
    assert len(hatched) == 1  # block 5 is shared by sequences 0 and 1
    fig = viz_kernel.plot_program_reads(bt, torch.tensor([37, 20, 50]), 16, num_splits=2)
    colours = {tuple(p.get_facecolor()) for p in fig.axes[0].patches}
    assert len(colours) == 1 + 6  # grey + 2 segments each: the kernel splits every sequence


def test_split_and_bench_pictures():
    assert isinstance(viz_kernel.plot_split_kv(120, 16, 3, tile_n=8), Figure)
    cpu_rows = [{"impl": "contiguous SDPA (per sequence)", "ms": 1.0, "vs_sdpa": 1.0},
                {"impl": "paged, torch backend", "ms": 2.0, "vs_sdpa": 2.0}]
    assert isinstance(viz_kernel.plot_bench(cpu_rows), Figure)
    gpu_rows = [{"batch": b, "context": c, "GB/s": 100.0 * c / 512} for b in (1, 8)
                for c in (512, 1024)]
    assert isinstance(viz_kernel.plot_bench(gpu_rows, peak_gbs=4800), Figure)


@pytest.mark.parametrize("name,peak", [("NVIDIA H200", 4800), ("NVIDIA H100 80GB HBM3", 3350),
                                       ("NVIDIA H100 PCIe", 2000),
                                       ("NVIDIA A100-SXM4-80GB", 2039),
                                       ("NVIDIA L40S", 864), ("NVIDIA L4", 300),
                                       ("Some Future GPU", None)])
def test_peak_bandwidth_table(name, peak):
    assert peak_bandwidth_gbs(name) == peak


def test_bench_bytes_and_contiguous_baselines():
    from paged_lib.kernels.cases import make_decode_case
    from paged_lib.kernels.reference import ref_paged_attention

    case = make_decode_case([20, 33], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                            shared=False, poison=False)
    assert bench.decode_bytes(case) == 53 * 2 * 2 * 16 * 4 + 2 * 2 * 4 * 16 * 4
    from paged_lib.kernels.reference import contiguous_kv, sdpa_per_sequence, sdpa_per_sequence_gqa

    kv = contiguous_kv(*case[1:5])
    got = sdpa_per_sequence(case.q, kv, case.scale)
    torch.testing.assert_close(got, ref_paged_attention(*case), atol=1e-5, rtol=1e-5)
    got_gqa = sdpa_per_sequence_gqa(case.q, kv, case.scale)
    torch.testing.assert_close(got_gqa, ref_paged_attention(*case), atol=1e-5, rtol=1e-5)


def test_cpu_ratios_rows_and_table():
    rows = bench.cpu_ratios(num_seqs=2, num_heads=4, num_kv_heads=2, head_dim=16, min_len=20,
                            max_len=40, repeats=1, flex_repeats=1)
    assert [r["impl"].split(" (")[0] for r in rows][0] == "contiguous SDPA"
    assert rows[0]["vs_sdpa"] == 1.0
    assert all(math.isfinite(r["ms"]) and r["check"] == "ok" for r in rows[:-1])
    assert rows[-1]["impl"] == "read K/V once (memory floor)" and rows[-1]["check"] == "floor"
    table = format_table(rows)
    assert "FlexAttention paged (eager)" in table and "vs_sdpa" in table
    assert "contiguous SDPA, enable_gqa=True" in table


def test_gpu_sweep_refuses_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        bench.gpu_sweep()


def test_bench_cli_parses(capsys, monkeypatch):
    monkeypatch.setattr(bench, "attention_report", lambda: "TABLE")
    assert cli.main(["attention"]) == 0
    assert capsys.readouterr().out == "TABLE\n"
    with pytest.raises(SystemExit):
        cli.main(["nothing"])
    with pytest.raises(SystemExit):
        cli.main(["attention", "--fast"])


def test_slot_status_and_pictures_of_chapter_05():
    from paged_lib.course.demos.decode_batch import demo_batch
    from paged_lib.course.viz import gpu
    from paged_lib.device import interpreter_on

    assert gpu.decode_intensity(8) == 8.0 and gpu.decode_intensity(1, dtype_bytes=4) == 0.5
    assert gpu.prefill_intensity(512, 4) == 2048.0
    for fig in (gpu.plot_roofline(), viz_kernel.plot_gqa_tile(3, 80, 16, 5),
                viz_kernel.plot_slot_mapping([2, 0], [5, 3], 4, 3),
                viz_kernel.plot_prefill_mask(5, 3, 4)):
        assert isinstance(fig, Figure)
    if not interpreter_on():
        return
    case, _ = demo_batch(seq_lens=(5, 17, 9), fork_at=0, num_heads=2, num_kv_heads=1,
                         head_dim=16, block_size=8, num_blocks=8)
    status = viz_kernel.traced_slot_status(case, tile_n=16)
    assert sorted(status) == [(0, 0), (1, 0), (2, 0)]
    for (seq, _), entry in status.items():
        n = int(case.seq_lens[seq])
        assert entry["status"][:n] == [viz_kernel.READ] * n
        assert viz_kernel.READ_PAST_END not in entry["status"] and entry["outside"] == 0
    assert isinstance(viz_kernel.plot_slot_status(status, 8, case.seq_lens), Figure)
