"""Chapter 05's graders, pictures and benchmark helpers."""

from __future__ import annotations

# First, before triton is imported anywhere: sets TRITON_INTERPRET on a CPU.
import paged_lib  # noqa: F401

# isort: split

import math

import pytest
import torch
import triton
import triton.language as tl
from matplotlib.figure import Figure

from paged_lib import bench
from paged_lib.grading import ch05
from paged_lib.viz import kernel as viz_kernel


@triton.jit
def good_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                scale, num_heads, num_kv_heads, max_blocks,
                BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (num_heads // num_kv_heads)
    seq_len = tl.load(seq_lens_ptr + seq)
    t = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (seq * num_heads + head) * HEAD_DIM + d)
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for i in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * max_blocks + i).to(tl.int64)
        valid = i * BLOCK_SIZE + t < seq_len
        offsets = ((block * BLOCK_SIZE + t) * num_kv_heads + kv_head)[:, None] * HEAD_DIM \
            + d[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=valid[:, None], other=0.0)
        s = tl.where(valid, tl.sum(q[None, :] * k, axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    tl.store(out_ptr + (seq * num_heads + head) * HEAD_DIM + d, acc / l_i)


@triton.jit
def unmasked_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                    scale, num_heads, num_kv_heads, max_blocks,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Forgets the partial last block: reads poisoned slots."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (num_heads // num_kv_heads)
    seq_len = tl.load(seq_lens_ptr + seq)
    t = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (seq * num_heads + head) * HEAD_DIM + d)
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for i in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * max_blocks + i).to(tl.int64)
        offsets = ((block * BLOCK_SIZE + t) * num_kv_heads + kv_head)[:, None] * HEAD_DIM \
            + d[None, :]
        k = tl.load(k_cache_ptr + offsets)
        v = tl.load(v_cache_ptr + offsets)
        s = tl.sum(q[None, :] * k, axis=1) * scale
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    tl.store(out_ptr + (seq * num_heads + head) * HEAD_DIM + d, acc / l_i)


@triton.jit
def stub_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                scale, num_heads, num_kv_heads, max_blocks,
                BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq = tl.program_id(0)
    seq_len = tl.load(seq_lens_ptr + seq)
    for _i in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        # YOUR CODE HERE
        raise NotImplementedError()


def test_poisoned_case_poisons_exactly_the_unread_slots():
    case = ch05.poisoned_decode_case()
    assert case["block_tables"][0, 0] == case["block_tables"][1, 0]  # a shared block
    assert case["k_cache"][0].isnan().all()  # the block unused entries point at
    from paged_lib.kernels.reference import ref_paged_attention
    assert not ref_paged_attention(**{k: case[k] for k in case}).isnan().any()


def test_decode_kernel_grader(capsys):
    ch05.check_paged_decode_kernel(good_kernel)
    ch05.check_paged_decode_kernel(unmasked_kernel)
    ch05.check_paged_decode_kernel(stub_kernel)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "✅ [05.1] Paged decode kernel: correct"
    assert lines[1].startswith("❌ [05.1]") and "NaN in the output for sequence 2" in lines[1]
    assert lines[2].startswith("   hint:")
    assert lines[3].startswith("⏳ [05.1]")


def _slots(block_tables, seq_ids, positions, block_size):
    blocks = block_tables.long()[seq_ids, positions.clamp(min=0) // block_size]
    return torch.where(positions >= 0, blocks * block_size + positions % block_size, -1)


def test_slot_mapping_grader(capsys):
    ch05.check_slot_mapping(_slots)
    ch05.check_slot_mapping(lambda bt, s, p, bs: bt.long()[s, p // bs] * bs + p % bs)  # no -1
    ch05.check_slot_mapping(lambda *a: (_ for _ in ()).throw(NotImplementedError()))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "✅ [05.2] Slot mapping: correct"
    assert out[1].startswith("❌ [05.2] Slot mapping: slot_mapping: expected")
    assert out[-1].startswith("⏳ [05.2]")


def _merge(out, lse):
    w = torch.exp(lse - lse.max())
    return (w[:, None] * out).sum(0) / w.sum()


def test_merge_grader(capsys):
    ch05.check_merge_partials(_merge)
    ch05.check_merge_partials(lambda out, lse: out.mean(0))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "✅ [05.3] Merge split-KV partials: correct"
    assert out[1].startswith("❌ [05.3]")


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
    assert len(colours) == 1 + 5  # grey + (seq 0: 2 segments, seq 1: 1, seq 2: 2)


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
    assert bench.peak_bandwidth_gbs(name) == peak


def test_bench_case_and_bytes():
    case = bench.make_decode_case([20, 33], num_heads=4, num_kv_heads=2, head_dim=16,
                                  block_size=16)
    assert case["block_tables"].tolist()[0][:2] != case["block_tables"].tolist()[1][:2]
    ids = sorted(case["block_tables"][0, :2].tolist() + case["block_tables"][1].tolist())
    assert ids == list(range(5))  # every block used once, scattered
    assert bench.decode_bytes(case) == 53 * 2 * 2 * 16 * 4 + 2 * 2 * 4 * 16 * 4
    from paged_lib.kernels.reference import ref_paged_attention
    args = [case[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens")]
    got = bench.sdpa_per_sequence(case["q"], bench.contiguous_kv(case), case["scale"])
    torch.testing.assert_close(got, ref_paged_attention(*args), atol=1e-5, rtol=1e-5)
    got_gqa = bench.sdpa_per_sequence_gqa(case["q"], bench.contiguous_kv(case), case["scale"])
    torch.testing.assert_close(got_gqa, ref_paged_attention(*args), atol=1e-5, rtol=1e-5)


def test_cpu_ratios_rows_and_table():
    rows = bench.cpu_ratios(num_seqs=2, num_heads=4, num_kv_heads=2, head_dim=16, min_len=20,
                            max_len=40, repeats=1, flex_repeats=1)
    assert [r["impl"].split(" (")[0] for r in rows][0] == "contiguous SDPA"
    assert rows[0]["vs_sdpa"] == 1.0
    assert all(math.isfinite(r["ms"]) or "not available" in r["impl"] for r in rows)
    table = bench.format_table(rows)
    assert "FlexAttention paged (eager)" in table and "vs_sdpa" in table
    assert "contiguous SDPA, enable_gqa=True" in table


def test_gpu_sweep_refuses_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        bench.gpu_sweep()


def test_bench_cli_parses(capsys, monkeypatch):
    monkeypatch.setattr(bench, "attention_report", lambda: "TABLE")
    assert bench.main(["attention"]) == 0
    assert capsys.readouterr().out == "TABLE\n"
    with pytest.raises(SystemExit):
        bench.main(["nothing"])
