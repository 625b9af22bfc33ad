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
