"""The shared case builder: its batches really catch the mistakes they exist to catch."""

from __future__ import annotations

# First, before triton is imported anywhere: sets TRITON_INTERPRET on a CPU.
import paged_lib  # noqa: F401

# isort: split

import pytest
import torch

from paged_lib.kernels import paged_attention, paged_prefill
from paged_lib.kernels.cases import (
    NAN_BLOCK,
    DecodeCase,
    make_decode_case,
    make_prefill_case,
    read_slots,
)
from paged_lib.kernels.reference import ref_paged_attention, ref_paged_prefill


def test_unpacks_into_the_api_and_the_reference():
    case = make_decode_case([1, 17, 40], num_heads=4, num_kv_heads=2, head_dim=64,
                            block_size=16, device=paged_lib.default_device())
    assert isinstance(case, DecodeCase) and case.scale == 64 ** -0.5
    expected = ref_paged_attention(*case)
    assert not expected.isnan().any()
    for backend in ("torch", "triton"):
        out = paged_attention(*case, backend=backend)
        torch.testing.assert_close(out.double(), expected.double(), atol=1e-5, rtol=1e-5)


def test_poison_covers_exactly_the_unread_slots():
    case = make_decode_case([3, 16, 21], 4, 2, 16, 8, seed=1)
    read = read_slots(case.block_tables, case.seq_lens, case.k_cache.shape[0], 8)
    assert read.sum() < read.numel()  # something is poisoned
    assert case.k_cache[~read].isnan().all() and case.v_cache[~read].isnan().all()
    assert not case.k_cache[read].isnan().any()
    # With distinct blocks, one slot past sequence 0's end (3 tokens) is NaN.
    case = make_decode_case([3, 16, 21], 4, 2, 16, 8, seed=1, shared=False)
    longer = case.seq_lens.clone()
    longer[0] = 4
    assert ref_paged_attention(*case[:4], longer)[0].isnan().all()
    assert not ref_paged_attention(*case)[0].isnan().any()


@pytest.mark.parametrize("shared", [True, False])
def test_tables_padding_and_sharing(shared):
    lens = [1, 16, 17, 50]
    case = make_decode_case(lens, 4, 2, 16, 16, shared=shared, seed=2)
    used = [(n + 15) // 16 for n in lens]
    tables = case.block_tables
    assert tables.dtype == torch.int32 and tables.shape == (4, max(used) + 1)
    for s, u in enumerate(used):
        assert (tables[s, u:] == -1).all()
        assert ((tables[s, :u] >= 0) & (tables[s, :u] < case.k_cache.shape[0])).all()
    ids = torch.cat([tables[s, :u] for s, u in enumerate(used)])
    if shared:
        assert tables[1, 0] == tables[0, 0]
    else:
        assert len(set(ids.tolist())) == len(ids)  # a free list: every block once


def test_nan_block_padding_points_at_an_unused_all_nan_block():
    case = make_decode_case([5, 9], 4, 2, 16, 4, pad=NAN_BLOCK)
    assert (case.block_tables[0, 2:] == 0).all() and (case.block_tables[1, 3:] == 0).all()
    assert case.k_cache[0].isnan().all()
    assert not (case.block_tables[0, :2] == 0).any() and not (case.block_tables[1, :3] == 0).any()


def test_seeded_dtype_device_and_empty_sequences():
    a = make_decode_case([0, 7], 4, 2, 16, 8, torch.float16, seed=3)
    b = make_decode_case([0, 7], 4, 2, 16, 8, torch.float16, seed=3)
    c = make_decode_case([0, 7], 4, 2, 16, 8, torch.float16, seed=4)
    assert all(x.dtype == torch.float16 for x in a[:3])
    assert all(torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in zip(a[:5], b[:5],
                                                                          strict=True))
    assert not torch.equal(a.q, c.q)
    assert (a.block_tables[0] == -1).all() and a.seq_lens.tolist() == [0, 7]
    assert a.to("cpu").q.device.type == "cpu"


def test_a_large_cache_spreads_the_blocks():
    case = make_decode_case([40, 40], 2, 1, 16, 4, shared=False, num_blocks=1000, poison=False)
    assert case.k_cache.shape[0] == 1000 and int(case.block_tables.max()) > 100


def test_bad_builder_arguments():
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        make_decode_case([3, -1])
    with pytest.raises(ValueError, match="distinct blocks"):
        make_decode_case([64], block_size=16, shared=False, num_blocks=3)
    with pytest.raises(ValueError, match="pad must be"):
        make_decode_case([3], pad="zero")


def test_prefill_case_unpacks_into_paged_prefill():
    case = make_prefill_case([0, 9], [5, 2], 4, 2, 16, 8, seed=5)
    assert case.q.shape == (7, 4, 16) and case.seq_lens.tolist() == [5, 11]
    out = paged_prefill(*case, backend="torch")
    torch.testing.assert_close(out.double(), ref_paged_prefill(*case).double(), atol=1e-5,
                               rtol=1e-5)


def test_compiled_triton_refuses_cpu_tensors_with_a_clear_error(monkeypatch):
    """Where Triton compiles (a GPU, no interpreter), CPU tensors would fail inside Triton's
    launcher ("Pointer argument cannot be accessed"): the API says what to do instead."""
    case = make_decode_case([3, 9], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="tensors are on the CPU: move them to 'cuda'"):
        paged_attention(*case, backend="triton")
    pf = make_prefill_case((2,), (3,), 2, 1, 16, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="move them to 'cuda'"):
        paged_prefill(*pf, backend="triton")
    out = paged_attention(*case, backend="torch")  # the CPU backends still take them
    assert out.shape == case.q.shape
