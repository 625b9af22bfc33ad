"""vLLM's padded block tables and FlashInfer's CSR pages describe the same sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_lib.blocks import BlockAllocator, BlockTable
from paged_lib.studies.block_formats import csr_to_padded, padded_to_csr, to_padded

FAST = settings(max_examples=150, derandomize=True, deadline=None)


@st.composite
def batches(draw):
    """A batch: block size, per-sequence blocks (shared ids allowed, as after a fork)."""
    block_size = draw(st.sampled_from([1, 2, 3, 16]))
    seq_lens = draw(st.lists(st.integers(0, 40), min_size=1, max_size=6))
    tables = [draw(st.lists(st.integers(0, 99), min_size=-(-n // block_size),
                            max_size=-(-n // block_size))) for n in seq_lens]
    return tables, seq_lens, block_size


# Python-list views of the two layouts: the tests' way to build and read them back (the
# library's kernels and chapter 03 only need to_padded, padded_to_csr and csr_to_padded).


def to_csr(block_tables, seq_lens, block_size):
    """Python lists to FlashInfer's CSR triple, through the padded layout."""
    return padded_to_csr(*to_padded(block_tables, seq_lens, block_size), block_size)


def from_padded(block_tables, seq_lens, block_size):
    """vLLM's padded tensors back to Python lists, dropping the padding."""
    lens = seq_lens.tolist()
    return [row[:-(-n // block_size)] for row, n in zip(block_tables.tolist(), lens,
                                                         strict=True)], lens


def from_csr(kv_indptr, kv_page_indices, kv_last_page_len, block_size):
    """FlashInfer's CSR triple back to Python lists."""
    indptr, pages = kv_indptr.tolist(), kv_page_indices.tolist()
    blocks = [pages[start:end] for start, end in zip(indptr, indptr[1:], strict=False)]
    seq_lens = [(len(b) - 1) * block_size + last if b else 0
                for b, last in zip(blocks, kv_last_page_len.tolist(), strict=True)]
    return blocks, seq_lens


def slots_padded(block_tables, seq_lens, block_size):
    return [[(int(block_tables[i, t // block_size]), t % block_size)
             for t in range(int(seq_lens[i]))] for i in range(len(seq_lens))]


def slots_csr(kv_indptr, kv_page_indices, kv_last_page_len, block_size):
    out = []
    for i in range(len(kv_last_page_len)):
        start, end = int(kv_indptr[i]), int(kv_indptr[i + 1])
        n = (end - start - 1) * block_size + int(kv_last_page_len[i]) if end > start else 0
        out.append([(int(kv_page_indices[start + t // block_size]), t % block_size)
                    for t in range(n)])
    return out


def test_worked_example_in_both_layouts():
    # Two sequences: 40 tokens in blocks 5, 2, 9 and 20 tokens in blocks 0, 7 (size 16).
    tables, lens = [[5, 2, 9], [0, 7]], [40, 20]
    block_tables, seq_lens = to_padded(tables, lens, 16, pad=-1)
    assert block_tables.tolist() == [[5, 2, 9], [0, 7, -1]]
    assert block_tables.dtype == seq_lens.dtype == torch.int32
    kv_indptr, kv_page_indices, kv_last_page_len = to_csr(tables, lens, 16)
    assert kv_indptr.tolist() == [0, 3, 5]
    assert kv_page_indices.tolist() == [5, 2, 9, 0, 7]
    assert kv_last_page_len.tolist() == [8, 4]
    assert {t.dtype for t in (kv_indptr, kv_page_indices, kv_last_page_len)} == {torch.int32}


def test_fixed_width_like_vllm():
    block_tables, _ = to_padded([[3]], [5], 16, max_blocks=4)
    assert block_tables.tolist() == [[3, 0, 0, 0]]
    with pytest.raises(ValueError, match="more than max_blocks=1"):
        to_padded([[3, 4]], [17], 16, max_blocks=1)
    csr = to_csr([[3, 4]], [17], 16)
    with pytest.raises(ValueError, match="more than max_blocks=1"):
        csr_to_padded(*csr, 16, max_blocks=1)


def test_tables_must_match_lengths():
    with pytest.raises(ValueError, match=r"sequence 0: 17 tokens in blocks of 16 need "
                                         r"2 block\(s\), its table has 1"):
        to_padded([[3]], [17], 16)
    with pytest.raises(ValueError, match="2 block tables but 1 seq_lens"):
        to_csr([[1], [2]], [1], 16)


def test_real_block_tables_convert():
    allocator = BlockAllocator(16)
    a = BlockTable(allocator, 4)
    for _ in range(6):
        a.append_token()
    b = a.fork()
    b.append_token()  # copy-on-write of a's last block
    tables, lens = [a.blocks, b.blocks], [a.num_tokens, b.num_tokens]
    csr = to_csr(tables, lens, 4)
    assert csr[1].tolist() == [0, 1, 0, 2] and csr[2].tolist() == [2, 3]
    assert from_csr(*csr, 4) == (tables, lens)


@FAST
@given(batches())
def test_lists_round_trip_through_both_layouts(batch):
    tables, lens, bs = batch
    assert from_padded(*to_padded(tables, lens, bs), bs) == (tables, lens)
    assert from_csr(*to_csr(tables, lens, bs), bs) == (tables, lens)


@FAST
@given(batches(), st.integers(-1, 3))
def test_converters_are_inverse_and_describe_the_same_slots(batch, extra_width):
    tables, lens, bs = batch
    width = max(len(t) for t in tables) + extra_width if extra_width >= 0 else None
    padded = to_padded(tables, lens, bs, max_blocks=width, pad=-1)
    csr = padded_to_csr(*padded, bs)
    assert all(a.equal(b) for a, b in zip(csr, to_csr(tables, lens, bs), strict=True))
    back = csr_to_padded(*csr, bs, max_blocks=width, pad=-1)
    assert back[0].equal(padded[0]) and back[1].equal(padded[1])
    assert slots_padded(*padded, bs) == slots_csr(*csr, bs)
    last = csr[2].tolist()
    assert all((1 <= x <= bs) if n else x == 0 for x, n in zip(last, lens, strict=True))


def test_demo_batch_is_built_from_real_block_tables():
    import paged_lib  # noqa: F401
    from paged_lib.course.demos.decode_batch import demo_batch
    from paged_lib.kernels import paged_attention
    from paged_lib.kernels.reference import ref_paged_attention

    case, tables = demo_batch(seq_lens=(20, 25, 37), fork_at=16, num_heads=4, head_dim=16)
    assert case.block_tables.tolist() == [[*t.blocks, *[-1] * (3 - len(t.blocks))]
                                          for t in tables]
    alloc = tables[0].allocator
    shared = set(tables[0].blocks) & set(tables[1].blocks)
    assert shared == {tables[0].blocks[0]} and alloc.refcount(tables[0].blocks[0]) == 2
    for t, n in zip(tables, case.seq_lens.tolist(), strict=True):
        assert t.num_tokens == n
        if n % 16:  # a partly filled last block is never shared
            assert alloc.refcount(t.blocks[-1]) == 1
    written = sum(int(n) for n in case.seq_lens) - 16  # the shared block is written once
    assert int((~case.k_cache.isnan().any(-1).any(-1)).sum()) == written
    ref = ref_paged_attention(case.q, case.k_cache, case.v_cache,
                              case.block_tables.clamp(min=0), case.seq_lens)
    torch.testing.assert_close(paged_attention(*case, backend="torch"), ref)


def test_demo_batch_refuses_a_fork_inside_a_block():
    from paged_lib.course.demos.decode_batch import demo_batch

    with pytest.raises(ValueError, match="multiple of block_size"):
        demo_batch(fork_at=10)
