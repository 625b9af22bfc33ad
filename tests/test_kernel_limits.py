"""What the interpreter does not check but a GPU pays for: block-table reads per step.

Runs without a GPU: launches are traced in Triton's interpreter
(:mod:`paged_lib.instruments.load_trace`) and kept to a few programs.
"""

from __future__ import annotations

# First, before triton is imported anywhere: sets TRITON_INTERPRET on a CPU.
import paged_lib  # noqa: F401

# isort: split

import numpy as np
import pytest
import torch

from paged_lib.device import interpreter_on
from paged_lib.instruments.load_trace import trace_loads
from paged_lib.kernels import paged_prefill
from paged_lib.kernels.cases import make_decode_case, make_prefill_case
from paged_lib.kernels.reference import ref_paged_attention
from paged_lib.kernels.triton_decode import paged_attention_triton
from paged_lib.util import cdiv

interpreter_only = pytest.mark.skipif(not interpreter_on(), reason="the load trace needs "
                                      "Triton's interpreter")


def table_reads(trace, block_tables: torch.Tensor) -> dict[tuple, list[int]]:
    """Per program: the block-table entries (flat index) it read, one per enabled lane."""
    out: dict[tuple, list[int]] = {}
    width = block_tables.shape[1]
    for read in trace.reads_of(block_tables):
        hit = read.index[read.mask]
        out.setdefault(read.program, []).extend((hit[:, 0] * width + hit[:, 1]).tolist())
    return out


@interpreter_only
@pytest.mark.parametrize("block_size, tile_n", [(16, 32), (1, 32), (128, 32), (64, 64),
                                                (12, 32), (48, 32)])
def test_decode_reads_each_block_table_entry_once_per_block(block_size, tile_n):
    lens = [3 * block_size + 5, 1, 0]
    case = make_decode_case(lens, num_heads=2, num_kv_heads=1, head_dim=16,
                            block_size=block_size, seed=1)
    with trace_loads() as trace:
        out = paged_attention_triton(*case, num_splits=1, tile_n=tile_n)
    ref = ref_paged_attention(*case)
    torch.testing.assert_close(out, ref.to(out.dtype), atol=1e-5, rtol=1e-5)
    reads = table_reads(trace, case.block_tables)
    for seq, n in enumerate(lens):
        got = reads.get((seq, 0, 0), [])
        used = [seq * case.block_tables.shape[1] + b for b in range(cdiv(n, block_size))]
        assert sorted(set(got)) == used, f"sequence {seq} read entries {got}"
        if tile_n % block_size == 0 or block_size % tile_n == 0:
            assert len(got) == len(used), f"sequence {seq}: {len(got)} reads of {len(used)}"
        else:  # a block that straddles two tiles is read by both, no more
            assert len(got) <= len(used) + cdiv(n, tile_n), got


@interpreter_only
def test_split_segments_read_their_blocks_once():
    """Split-KV: a segment that starts inside a block still reads that block's entry."""
    case = make_decode_case([300, 130], num_heads=2, num_kv_heads=1, head_dim=16,
                            block_size=128, seed=2)
    with trace_loads() as trace:
        out = paged_attention_triton(*case, num_splits=4, tile_n=32)
    torch.testing.assert_close(out, ref_paged_attention(*case).to(out.dtype), atol=1e-5,
                               rtol=1e-5)
    reads = table_reads(trace, case.block_tables)
    width = case.block_tables.shape[1]
    # 300 tokens in 4 segments of 96: segments start at 0, 96, 192, 288.
    assert sorted(reads[(0, 0, 0)]) == [0] and sorted(reads[(0, 0, 1)]) == [0, 1]
    assert sorted(reads[(0, 0, 2)]) == [1, 2] and sorted(reads[(0, 0, 3)]) == [2]
    # 130 tokens in segments of 64: the third segment holds 2 tokens of block 1.
    assert sorted(reads[(1, 0, 2)]) == [width + 1] and (1, 0, 3) not in reads


@interpreter_only
@pytest.mark.parametrize("block_size", [8, 12])
def test_prefill_reads_block_table_entries_per_block(block_size):
    case = make_prefill_case([20], [10], num_heads=2, num_kv_heads=1, head_dim=16,
                             block_size=block_size, seed=3)
    with trace_loads() as trace:
        out = paged_prefill(*case)
    assert not torch.isnan(out).any()
    reads = [i for r in table_reads(trace, case.block_tables).values() for i in r]
    blocks = cdiv(20 + 10, block_size)  # seq_len counts the new tokens
    assert sorted(set(reads)) == list(range(blocks))
    assert len(reads) <= 2 * blocks, reads  # was one read per token seen (30 or more)
    assert np.all(np.asarray(reads) < blocks)


# ------------------------------------------------ shared memory per block, by GPU

from paged_lib.kernels import triton_decode as td  # noqa: E402

HEAD_DIMS = (40, 64, 72, 80, 96, 112, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@pytest.mark.parametrize("arch, kb", [(80, 163), (86, 99), (89, 99), (90, 227)])
def test_every_chosen_config_fits_the_gpus_shared_memory(arch, kb):
    smem = td.smem_limit(arch=arch)
    assert smem == kb * 1024
    for head_dim in HEAD_DIMS:
        for dtype in DTYPES:
            cfg = td.launch_config(head_dim, dtype, smem)
            td.check_config(cfg["TILE_N"], cfg["num_stages"], head_dim, dtype, smem)
            assert cfg["num_stages"] >= 1
            configs = td.gpu_configs(head_dim, dtype, smem)
            assert configs, (arch, head_dim, dtype)
            for tile_n, _, stages in configs:
                assert td.kv_smem_bytes(tile_n, head_dim, dtype, stages) <= smem


def test_a_smaller_gpu_gets_fewer_stages_and_configs():
    """sm_86's 99 KB and sm_80's 163 KB refuse tiles that sm_90's 227 KB takes."""
    small, mid, big = td.smem_limit(arch=86), td.smem_limit(arch=80), td.smem_limit(arch=90)
    assert (64, 4, 3) in td.gpu_configs(256, torch.float16, big)  # 192 KB
    assert (64, 4, 3) not in td.gpu_configs(256, torch.float16, mid)
    assert td.launch_config(256, torch.float16, 96 * 1024)["num_stages"] == 3  # 96 KB
    assert td.launch_config(256, torch.float16, 95 * 1024)["num_stages"] == 2
    assert (128, 8, 2) in td.gpu_configs(128, torch.float16, big)
    assert (128, 8, 2) not in td.gpu_configs(128, torch.float16, small)
    td.check_config(64, 3, 128, torch.float16, small)  # 96 KB: fits in 99
    with pytest.raises(ValueError, match="192 KB of shared memory.*a GPU block has 99 KB"):
        td.check_config(64, 3, 128, torch.float32, small)
    td.check_config(64, 3, 128, torch.float32, big)
    with pytest.raises(ValueError, match="a GPU block has 99 KB"):
        td.check_config(128, 2, 128, torch.float16, small)
    with pytest.raises(ValueError, match="no shared-memory limit known for sm_75"):
        td.smem_limit(arch=75)


def test_a_gpu_is_asked_for_its_own_limit(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(td, "interpreter_on", lambda: False)
    props = SimpleNamespace(shared_memory_per_block_optin=101376, major=8, minor=6)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert td.smem_limit(torch.device("cuda", 0)) == 101376
    props.shared_memory_per_block_optin = 0  # an older torch: fall back to the table
    props.major, props.minor = 8, 0
    assert td.smem_limit(torch.device("cuda", 0)) == 163 * 1024
    assert td.smem_limit(torch.device("cpu")) == td.smem_limit(arch=90)


# ------------------------------------------------ split-KV from the real lengths


def test_short_sequences_in_a_wide_table_are_not_split(monkeypatch):
    """A table 64 blocks wide (1024 tokens) holding 20- and 30-token sequences: the
    capacity says "split in 4", the real lengths say "no split"."""
    monkeypatch.setattr(td, "num_sms", lambda device: 132)  # as on an H100
    case = make_decode_case([20, 30], num_heads=2, num_kv_heads=1, head_dim=16,
                            block_size=16, seed=4)
    wide = torch.zeros(2, 64, dtype=torch.int32)
    wide[:, :2] = case.block_tables[:, :2]
    args = (case.q, case.k_cache, case.v_cache, wide, case.seq_lens, case.scale)
    assert choose_num_splits_for(wide, 16) == 4  # what the old fallback chose
    for kwargs in ({}, {"max_seq_len": 30}):
        out, launch = td.paged_attention_triton(*args, return_launch=True, **kwargs)
        assert launch.num_splits == 1, kwargs
        torch.testing.assert_close(out, ref_paged_attention(*args).to(out.dtype), atol=1e-5,
                                   rtol=1e-5)
    # A long sequence in the same table still splits: 600 tokens, 2 segments of 300.
    long = make_decode_case([600, 30], num_heads=2, num_kv_heads=1, head_dim=16,
                            block_size=16, seed=5)
    _, launch = td.paged_attention_triton(*long, return_launch=True, max_seq_len=600)
    assert launch.num_splits == 2


def choose_num_splits_for(block_tables: torch.Tensor, block_size: int) -> int:
    from paged_lib.kernels import choose_num_splits

    return choose_num_splits(block_tables.shape[0], 1, block_tables.shape[1] * block_size, 132)


# ------------------------------------------------ rows of the query tile


@interpreter_only
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mha_decode_computes_one_row_per_head_without_tl_dot(num_splits, dtype):
    """MHA: one query head per KV head, a 1-row tile and no 16-row tl.dot (15 rows of it
    were padding); GQA 4:1 still uses tl.dot with 16 rows."""
    case = make_decode_case([0, 1, 45, 70], num_heads=3, num_kv_heads=3, head_dim=40,
                            block_size=12, dtype=dtype, seed=6)
    with trace_loads() as trace:
        out, launch = paged_attention_triton(*case, num_splits=num_splits, return_launch=True)
    assert trace.dots == [], "MHA decode should not call tl.dot"
    assert launch.head_chunks == 3 // 3
    q_rows = {tuple(sorted(set(r.index[r.mask][:, 1].tolist())))
              for r in trace.reads_of(case.q, enabled_only=True)}
    assert q_rows == {(0,), (1,), (2,)}, "each program loads exactly its one query head"
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    expected = ref_paged_attention(*case)
    torch.testing.assert_close(out.double(), expected.double(), atol=tol, rtol=tol)
    assert (out[0] == 0).all()

    gqa = make_decode_case([20], num_heads=8, num_kv_heads=2, head_dim=16, block_size=16)
    with trace_loads() as trace:
        paged_attention_triton(*gqa, num_splits=1)
    assert trace.dots and all(d.a_shape[0] == 16 for d in trace.dots)


def test_decode_group_tile():
    assert td.group_tile(1) == 1  # MHA: no padding rows
    assert [td.group_tile(g) for g in (2, 4, 5, 16, 64)] == [16] * 5


@pytest.mark.parametrize("group, tile, tokens", [(1, 1, 64), (3, 3, 21), (5, 5, 12),
                                                 (9, 9, 7), (16, 16, 4), (24, 12, 5),
                                                 (71, 15, 4)])
def test_prefill_tiles_fill_the_64_rows(group, tile, tokens):
    from paged_lib.kernels.triton_prefill import BLOCK_M, prefill_tiles

    assert prefill_tiles(group) == (tile, tokens)
    assert tile * tokens <= BLOCK_M and tile <= 16 and cdiv(group, tile) == cdiv(group, 16)
    assert tile * tokens > BLOCK_M - tile  # no room for one more token


@interpreter_only
@pytest.mark.parametrize("num_heads, num_kv_heads", [(5, 1), (6, 2), (24, 1)])
def test_prefill_with_groups_that_are_not_powers_of_two(num_heads, num_kv_heads):
    """Group 5: 12 tokens x 5 heads per program (was 8 x 8, 3 of every 8 rows padding), so
    24 new tokens take 2 token tiles instead of 3; group 24 is 2 chunks of 12 heads."""
    from paged_lib.kernels.reference import ref_paged_prefill

    case = make_prefill_case([0, 7], [24, 5], num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=16, block_size=8, seed=7)
    with trace_loads() as trace:
        out = paged_prefill(*case)
    torch.testing.assert_close(out.double(), ref_paged_prefill(*case).double(), atol=1e-5,
                               rtol=1e-5)
    working = {r.program for r in trace.reads_of(case.q) if r.mask.any()}
    group = num_heads // num_kv_heads
    tile = cdiv(group, cdiv(group, 16))
    assert len(working) == num_kv_heads * cdiv(group, tile) * (cdiv(24, 64 // tile) + 1)
