"""``copy_blocks``: copy-on-write's cache side, Triton and torch.

Every block that is not a destination is NaN-poisoned or holds other data and must come
out bit-for-bit unchanged; every destination must equal its source (taken from a clone
made before the copy, an outside reference that does not use ``copy_blocks``).
"""

from __future__ import annotations

import paged_lib

# isort: split

import pytest
import torch

from paged_lib.blocks import BlockAllocator, BlockTable
from paged_lib.kernels.copy_blocks import copy_blocks

BACKENDS = ["triton", "torch"]
DEVICE = paged_lib.default_device()


def make_caches(num_layers=2, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=16,
                dtype=torch.float32, seed=0, poison=()):
    """Per-layer K and V caches with random blocks; blocks in ``poison`` are NaN."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    ks = [torch.randn(shape, generator=g).to(dtype) for _ in range(num_layers)]
    vs = [torch.randn(shape, generator=g).to(dtype) for _ in range(num_layers)]
    for t in ks + vs:
        t[list(poison)] = float("nan")
    return [t.to(DEVICE) for t in ks], [t.to(DEVICE) for t in vs]


def expected_after(caches, pairs):
    out = [t.cpu().clone() for t in caches]
    for t, before in zip(out, caches, strict=True):
        for src, dst in pairs:
            t[dst] = before.cpu()[src]
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.uint8 if a.element_size() == 1 else
                                    {2: torch.int16, 4: torch.int32}[a.element_size()]),
                       b.cpu().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}
                                    [b.element_size()]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(4, 2, 16), (16, 1, 80),
                                                               (8, 3, 64)])
def test_copies_exactly_the_pairs_in_every_layer(backend, dtype, block_size, num_kv_heads,
                                                 head_dim):
    pairs = [(1, 7), (3, 2), (1, 8)]  # one source copied twice (two samples' CoW)
    ks, vs = make_caches(block_size=block_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, dtype=dtype, poison=(0, 9))
    want_k, want_v = expected_after(ks, pairs), expected_after(vs, pairs)
    copy_blocks(ks, vs, pairs, backend=backend)
    for got, want in zip(ks + vs, want_k + want_v, strict=True):
        assert same_bits(got, want)  # poisoned blocks 0 and 9 still NaN, the rest intact


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_bigger_than_one_program_chunk(backend):
    """block_size 32 x 4 heads x 16 = 2048 elements: two programs per pair."""
    ks, vs = make_caches(num_layers=1, num_blocks=4, block_size=32, num_kv_heads=4,
                         head_dim=16)
    want_k, want_v = expected_after(ks, [(0, 3)]), expected_after(vs, [(0, 3)])
    copy_blocks(ks[0], vs[0], torch.tensor([[0, 3]], dtype=torch.int32), backend=backend)
    assert torch.equal(ks[0].cpu(), want_k[0]) and torch.equal(vs[0].cpu(), want_v[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_slice_of_a_stacked_kv_cache(backend):
    """vLLM's FlashAttention layout [2, num_blocks, ...]: K and V are slices along axis 0."""
    kv = make_caches(num_layers=1)[0][0].unsqueeze(0).repeat(2, 1, 1, 1, 1)
    kv[1] += 100
    want = kv.cpu().clone()
    want[:, 5] = want[:, 2]
    copy_blocks(kv[0], kv[1], [(2, 5)], backend=backend)
    assert torch.equal(kv.cpu(), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_follows_the_block_table_copy_on_write(backend):
    """The Slot.copy a forked table returns, applied to the cache, keeps both readers right."""
    alloc = BlockAllocator(6)
    parent = BlockTable(alloc, block_size=4)
    slots = [parent.append_token() for _ in range(6)]  # blocks [0, 1], block 1 half full
    ks, vs = make_caches(num_layers=1, num_blocks=6, poison=range(6))  # all NaN
    for s in slots:  # token t's K is all t
        ks[0][s.block, s.offset] = float(slots.index(s))
    child = parent.fork()
    slot = child.append_token()
    assert slot.copy == (1, 2)
    copy_blocks(ks, vs, [slot.copy], backend=backend)
    ks[0][slot.block, slot.offset] = 99.0
    k = ks[0].cpu()
    assert k[parent.blocks[1], :2, 0, 0].tolist() == [4.0, 5.0]
    assert k[child.blocks[1], :3, 0, 0].tolist() == [4.0, 5.0, 99.0]
    assert torch.isnan(k[parent.blocks[1], 2:]).all()  # the parent's block was not written


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_pairs_is_a_no_op(backend):
    ks, vs = make_caches()
    before = [t.clone() for t in ks + vs]
    copy_blocks(ks, vs, [], backend=backend)
    copy_blocks(ks, vs, torch.empty(0, 2, dtype=torch.int64), backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(ks + vs, before, strict=True))


@pytest.mark.parametrize("pairs,message", [
    ([(3, 3)], "src == dst"),
    ([(1, 4), (2, 4)], "more than once"),
    ([(1, 10)], "outside the cache"),
    ([(-1, 4)], "outside the cache"),
    ([(1, 2), (2, 3)], "both a source and a destination"),
    ([(1, 2, 3)], r"\[num_pairs, 2\]"),
])
def test_bad_pairs_raise_before_copying_anything(pairs, message):
    ks, vs = make_caches()
    before = [t.clone() for t in ks + vs]
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=message):
            copy_blocks(ks, vs, pairs, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(ks + vs, before, strict=True))


def test_bad_caches_raise():
    ks, vs = make_caches()
    with pytest.raises(ValueError, match="2 K caches but 1 V caches"):
        copy_blocks(ks, vs[:1], [(0, 1)])
    with pytest.raises(ValueError, match="every layer's caches must match"):
        copy_blocks(ks, [vs[0], vs[1].half()], [(0, 1)])
    with pytest.raises(ValueError, match="num_blocks, block_size"):
        copy_blocks(ks[0][0], vs[0][0], [(0, 1)])
    with pytest.raises(ValueError, match="contiguous"):
        copy_blocks(ks[0].transpose(1, 2), vs[0].transpose(1, 2), [(0, 1)])
    with pytest.raises(ValueError, match="int32 or int64"):
        copy_blocks(ks, vs, torch.tensor([[0.0, 1.0]]))
    with pytest.raises(ValueError, match="unknown backend"):
        copy_blocks(ks, vs, [(0, 1)], backend="cuda")
