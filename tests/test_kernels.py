"""The paged-attention kernels against the float64 reference, in vLLM's test style.

Every cache slot no sequence may read is NaN, block tables are random with repeated
entries (sequences share physical blocks, like a shared prefix), and block-table
entries past a sequence's last block are -1 or far out of range: a kernel that reads
past a sequence's end, or follows an unused entry, returns NaN or crashes.

On a CPU these run in Triton's interpreter; each case launches a few programs. On a GPU
the kernels get CUDA tensors (``DEVICE``); the reference always runs on the CPU.
"""

from __future__ import annotations

# First, before triton is imported anywhere: sets TRITON_INTERPRET on a CPU.
import paged_lib  # noqa: F401

# isort: split

import itertools

import pytest
import torch

from paged_lib.kernels import (
    choose_num_splits,
    paged_attention,
    paged_prefill,
    reshape_and_cache,
)
from paged_lib.kernels.cache import slot_mapping_from_positions
from paged_lib.kernels.prefill import ref_paged_prefill
from paged_lib.kernels.reference import gather_kv, ref_paged_attention

GQA = [(4, 4), (8, 2), (5, 1)]  # (num_heads, num_kv_heads), as in vLLM's tests
HEAD_SIZES = [64, 128, 80]  # 80: not a power of two, masked up to 128
BLOCK_SIZES = [8, 16, 32]
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
FAR_OUT = 2**30  # an unused block-table entry no kernel may follow
DEVICE = paged_lib.default_device()


def cpu(*tensors):
    return tuple(t.cpu() for t in tensors)


def make_case(seq_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
              dtype=torch.float32, seed=0, share=True, repeat_within=True, poison=True,
              device=DEVICE):
    """A decode batch on a NaN-poisoned cache with a random, sharing block table."""
    g = torch.Generator().manual_seed(seed)
    used = [-(-n // block_size) for n in seq_lens]
    num_seqs, max_blocks = len(seq_lens), max(used) + 1  # always an unused column
    num_blocks = sum(used) + 2  # and some blocks nobody reads
    if repeat_within:  # drawn with replacement: blocks repeat, within and across sequences
        block_tables = torch.randint(0, num_blocks, (num_seqs, max_blocks), generator=g)
    else:  # distinct within a sequence (FlexAttention's page table needs that)
        block_tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks]
                                    for _ in range(num_seqs)])
    if share and num_seqs > 1:
        block_tables[1, 0] = block_tables[0, 0]  # a shared prefix block
    for s, u in enumerate(used):
        block_tables[s, u:] = -1 if s % 2 else FAR_OUT
    block_tables = block_tables.to(torch.int32)
    read = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for s, n in enumerate(seq_lens):
        t = torch.arange(n)
        read[block_tables[s, t // block_size].long(), t % block_size] = True
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    if poison:
        k_cache[~read] = float("nan")
        v_cache[~read] = float("nan")
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g).to(dtype)
    case = q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32)
    return tuple(t.to(device) for t in case)


def lens_for(block_size, extra=()):
    """1 token, a full block, a block plus one, and a few blocks plus a bit."""
    return [1, block_size, block_size + 1, 2 * block_size + 3, *extra]


def assert_matches_reference(out, case, scale=None):
    expected = ref_paged_attention(*cpu(*case), scale=scale)
    out = out.cpu()
    tol = TOL[out.dtype]
    assert not out.isnan().any(), "NaN in the output: a poisoned slot was read"
    torch.testing.assert_close(out.double(), expected.double(), atol=tol, rtol=tol)


# ------------------------------------------------------------------ decode


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_SIZES)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_decode_matches_reference(heads, head_dim, block_size, dtype):
    case = make_case(lens_for(block_size), *heads, head_dim, block_size, dtype,
                     seed=head_dim + block_size)
    assert_matches_reference(paged_attention(*case), case)


# Split-KV forced: each GQA pair, head size and block size, both dtypes, without the
# full product (each value of each axis appears with both dtypes).
SPLIT_CASES = [(h, d, b, dt) for (h, d, b), dt in itertools.product(
    zip(GQA, HEAD_SIZES, BLOCK_SIZES, strict=True), DTYPES)]


@pytest.mark.parametrize("heads,head_dim,block_size,dtype", SPLIT_CASES,
                         ids=lambda x: str(x).replace("torch.", ""))
def test_split_kv_matches_reference(heads, head_dim, block_size, dtype):
    case = make_case([1, block_size + 1, 97, 150], *heads, head_dim, block_size, dtype, seed=3)
    for num_splits in (2, 3):
        assert_matches_reference(paged_attention(*case, num_splits=num_splits), case)


def test_split_kv_really_splits(monkeypatch):
    """The forced split reaches the kernel as 3 segments and a merge."""
    import paged_lib.kernels.triton_decode as td

    seen = []
    real_merge = td.merge_splits
    monkeypatch.setattr(td, "merge_splits",
                        lambda partial, lse, out: seen.append(partial.shape[2])
                        or real_merge(partial, lse, out))
    case = make_case([1, 17, 97, 150], 8, 2, 128, 16, seed=4)
    assert_matches_reference(paged_attention(*case, num_splits=3), case)
    assert seen == [3]


def test_gpu_autotune_plumbing():
    """The GPU path's autotuner, run in the interpreter with a stand-in benchmark."""
    import paged_lib.kernels.triton_decode as td

    timings = iter(range(100, 0, -1))  # each config "runs faster" than the last

    def fake_bench(kernel_call, quantiles):
        kernel_call()
        t = float(next(timings))
        return [t, t, t]

    tuned = td.make_autotuned_decode_kernel(do_bench=fake_bench)
    old, td._autotuned_kernel = td._autotuned_kernel, tuned
    try:
        case = make_case([1, 16, 17, 150], 8, 2, 64, 16, seed=6)
        for num_splits in (1, 2):
            out = td.paged_attention_triton(*case, scale=64 ** -0.5, num_splits=num_splits,
                                            autotune=True)
            assert_matches_reference(out, case)
        assert tuned.best_config.kwargs["TILE_N"] == td.GPU_CONFIGS[-1][0]
    finally:
        td._autotuned_kernel = old


def test_split_kv_with_empty_segments_and_tiles_across_blocks():
    """More segments than a short sequence fills; tiles smaller and larger than blocks."""
    from paged_lib.kernels.triton_decode import paged_attention_triton

    case = make_case([3, 130, 129, 1], 8, 2, 64, 128, seed=5)  # block 128 > tile
    for num_splits, tile_n in ((1, 16), (8, 16), (4, 32), (2, 256)):
        out = paged_attention_triton(*case, scale=64 ** -0.5, num_splits=num_splits,
                                     tile_n=tile_n)
        assert_matches_reference(out, case)


def test_split_merge_kernel_matches_torch_merge():
    from paged_lib.kernels.triton_split import merge_splits, merge_splits_torch

    g = torch.Generator().manual_seed(0)
    partial = torch.randn(3, 4, 5, 80, generator=g)
    lse = torch.randn(3, 4, 5, generator=g) * 4
    lse[0, :, 3:] = float("-inf")  # empty segments
    out = merge_splits(partial.to(DEVICE), lse.to(DEVICE), torch.empty(3, 4, 80, device=DEVICE))
    torch.testing.assert_close(out.cpu(), merge_splits_torch(partial, lse), atol=1e-5, rtol=1e-5)


def test_choose_num_splits_heuristic():
    # CPU / interpreter: never split on its own.
    assert choose_num_splits(1, 8, 100_000, None) == 1
    # Enough programs to fill the GPU, or short contexts: no split.
    assert choose_num_splits(64, 8, 4096, 132) == 1
    assert choose_num_splits(2, 8, 300, 132) == 1
    # Few long sequences: split, bounded by MAX_SPLITS and by the tokens per segment.
    assert choose_num_splits(1, 8, 32_768, 132) == 16
    assert choose_num_splits(4, 8, 1024, 132) == 4
    assert choose_num_splits(2, 8, 8192, 132) == 16
    assert choose_num_splits(8, 8, 8192, 132) == 5


def test_bf16_upcasts_in_the_interpreter():
    case = make_case(lens_for(16), 8, 2, 64, 16, torch.bfloat16, seed=7)
    assert_matches_reference(paged_attention(*case), case)
    assert_matches_reference(paged_attention(*case, num_splits=2), case)


def test_strided_caches_and_query():
    """vLLM's Triton layout [num_blocks, 2, block_size, heads, dim]: K and V are views."""
    q, k_cache, v_cache, block_tables, seq_lens = make_case(lens_for(16), 8, 2, 64, 16, seed=9)
    kv = torch.stack([k_cache, v_cache], dim=1)
    q_wide = torch.zeros(q.shape[0], q.shape[1], 96, device=q.device)
    q_wide[..., :64] = q
    case = (q_wide[..., :64], kv[:, 0], kv[:, 1], block_tables, seq_lens)
    assert not case[1].is_contiguous() and not case[0].is_contiguous()
    assert_matches_reference(paged_attention(*case), case)


def test_explicit_scale():
    case = make_case(lens_for(8), 4, 4, 64, 8, seed=11)
    assert_matches_reference(paged_attention(*case, scale=0.3), case, scale=0.3)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size",
                         [(8, 2, 64, 16), (5, 1, 80, 8)])
def test_agrees_with_flex_attention_paged(backend, heads, kv_heads, head_dim, block_size):
    """PyTorch's FlexAttention PagedAttention (eager, CPU): an independent implementation.

    Not on a poisoned cache: eager FlexAttention computes scores over every slot and
    masks afterwards, so a NaN anywhere reaches its output (0 * NaN).
    """
    import warnings

    from paged_lib.bench import flex_paged_attention

    case = make_case([1, block_size, block_size + 1, 45], heads, kv_heads, head_dim,
                     block_size, seed=13, repeat_within=False, poison=False, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = flex_paged_attention(*case, scale=head_dim ** -0.5)()
    ours = paged_attention(*(t.to(DEVICE) for t in case), backend=backend).cpu()
    torch.testing.assert_close(ours, flex, atol=1e-5, rtol=1e-5)
    assert_matches_reference(flex, case)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_torch_backend_through_the_dispatcher(heads, dtype):
    pytest.importorskip("paged_lib.kernels.torch_backend")
    case = make_case(lens_for(16), *heads, 80, 16, dtype, seed=17)
    assert_matches_reference(paged_attention(*case, backend="torch"), case)


def test_empty_batch():
    q, k, v, bt, _ = make_case([5], 4, 2, 64, 8)
    out = paged_attention(q[:0], k, v, bt[:0], torch.zeros(0, dtype=torch.int32, device=DEVICE))
    assert out.shape == (0, 4, 64)


# ------------------------------------------------------------------ validation


def _bad(case, **change):
    names = ["q", "k_cache", "v_cache", "block_tables", "seq_lens"]
    args = dict(zip(names, case, strict=True))
    kwargs = {k: change.pop(k) for k in ("backend", "num_splits") if k in change}
    args.update(change)
    return args, kwargs


BAD_INPUTS = {
    "heads not a multiple": (lambda c: {"q": torch.randn(4, 5, 64)}, "multiple of num_kv_heads"),
    "seq_len past capacity": (lambda c: {"seq_lens": torch.tensor([1, 8, 9, 33],
                                                                  dtype=torch.int32)},
                              "holds only"),
    "seq_len zero": (lambda c: {"seq_lens": torch.tensor([0, 8, 9, 19], dtype=torch.int32)},
                     "at least one token"),
    "int64 block_tables": (lambda c: {"block_tables": c[3].long()}, "block_tables must be int32"),
    "int64 seq_lens": (lambda c: {"seq_lens": c[4].long()}, "seq_lens must be int32"),
    "mixed float dtypes": (lambda c: {"q": c[0].half()}, "use one dtype"),
    "float64": (lambda c: {"q": c[0].double(), "k_cache": c[1].double(),
                           "v_cache": c[2].double()}, "float32, float16 or bfloat16"),
    "q is 2-D": (lambda c: {"q": c[0][0]}, "q must be"),
    "cache is 3-D": (lambda c: {"k_cache": c[1][0], "v_cache": c[2][0]}, "k_cache must be"),
    "head_dim mismatch": (lambda c: {"q": torch.randn(4, 4, 32)}, "head_dim"),
    "k/v shapes differ": (lambda c: {"v_cache": c[2][:-1]}, "same shape"),
    "seq count mismatch": (lambda c: {"seq_lens": c[4][:3]}, "one per sequence"),
    "block id out of range": (lambda c: {"block_tables": torch.where(
        torch.arange(c[3].shape[1]) == 0, 10_000, c[3]).to(torch.int32)}, "outside the cache"),
    "negative block id in use": (lambda c: {"block_tables": torch.where(
        torch.arange(c[3].shape[1]) == 0, -1, c[3]).to(torch.int32)}, "outside the cache"),
    "unknown backend": (lambda c: {"backend": "cuda"}, "unknown backend"),
    "bad num_splits": (lambda c: {"num_splits": 0}, "num_splits"),
    "different devices": (lambda c: {"seq_lens": c[4].to("meta")}, "one device"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_before_launch(name, monkeypatch):
    import paged_lib.kernels.triton_decode as td

    def no_launch(*a, **k):
        raise AssertionError("launched the kernel on bad input")

    monkeypatch.setattr(td, "paged_attention_triton", no_launch)
    case = make_case([1, 8, 9, 19], 4, 2, 64, 8, device="cpu")  # 3 blocks + 1 unused: 32 slots
    change, match = BAD_INPUTS[name]
    args, kwargs = _bad(case, **change(case))
    with pytest.raises(ValueError, match=match):
        paged_attention(**args, **kwargs)


def test_unused_block_table_entries_are_not_validated():
    """-1 and far-out-of-range entries past a sequence's last block are fine."""
    case = make_case([1, 8, 9], 4, 2, 64, 8)
    assert (case[3] == -1).any() and (case[3] == FAR_OUT).any()
    assert_matches_reference(paged_attention(*case), case)


# ------------------------------------------------------------------ reshape_and_cache


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_round_trip(backend, dtype):
    g = torch.Generator().manual_seed(0)
    block_size, num_kv_heads, head_dim = 8, 2, 80
    block_tables = torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32)
    seq_lens = [19, 12]
    seq_ids = torch.tensor([s for s, n in enumerate(seq_lens) for _ in range(n)] + [0, 1])
    positions = torch.tensor([p for n in seq_lens for p in range(n)] + [-1, -1])  # 2 padding
    slots = slot_mapping_from_positions(block_tables, seq_ids, positions, block_size)
    assert (slots[-2:] == -1).all()
    key = torch.randn(len(slots), num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(len(slots), num_kv_heads, head_dim, generator=g).to(dtype)
    shape = (6, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    on_device = [t.to(DEVICE) for t in (key, value, k_cache, v_cache, slots)]
    reshape_and_cache(*on_device, backend=backend)
    k_cache, v_cache = on_device[2].cpu(), on_device[3].cpu()
    start = 0
    for s, n in enumerate(seq_lens):
        assert torch.equal(gather_kv(k_cache, block_tables[s], n), key[start:start + n])
        assert torch.equal(gather_kv(v_cache, block_tables[s], n), value[start:start + n])
        start += n
    written = torch.zeros(6 * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    # Slot -1 wrote nothing: everything else is still NaN.
    assert k_cache.view(-1, num_kv_heads, head_dim)[~written].isnan().all()
    assert v_cache.view(-1, num_kv_heads, head_dim)[~written].isnan().all()


@pytest.mark.parametrize("change,match", [
    (dict(slot_mapping=torch.tensor([0, 48])), "outside the cache"),
    (dict(slot_mapping=torch.tensor([0, -2])), "outside the cache"),
    (dict(slot_mapping=torch.tensor([0])), "one slot per token"),
    (dict(slot_mapping=torch.tensor([0.0, 1.0])), "int64 or int32"),
    (dict(key=torch.randn(2, 2, 16).half()), "is torch.float16 but the cache"),
    (dict(value=torch.randn(2, 3, 16)), r"\[num_kv_heads, head_dim\]"),
    (dict(key=torch.randn(2, 32)), "must be"),
    (dict(backend="numpy"), "unknown backend"),
])
def test_reshape_and_cache_validates(change, match):
    args = dict(key=torch.randn(2, 2, 16), value=torch.randn(2, 2, 16),
                k_cache=torch.zeros(6, 8, 2, 16), v_cache=torch.zeros(6, 8, 2, 16),
                slot_mapping=torch.tensor([0, 9]))
    backend = change.pop("backend", "triton")
    args.update(change)
    with pytest.raises(ValueError, match=match):
        reshape_and_cache(**args, backend=backend)


# ------------------------------------------------------------------ prefill


def make_prefill_case(contexts, query_lens, num_heads, num_kv_heads, head_dim, block_size,
                      dtype, seed=0, device=DEVICE):
    seq_lens = [c + n for c, n in zip(contexts, query_lens, strict=True)]
    _, k_cache, v_cache, block_tables, sl = make_case(seq_lens, num_heads, num_kv_heads,
                                                      head_dim, block_size, dtype, seed,
                                                      device=device)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype)
    return (q.to(k_cache.device), k_cache, v_cache, block_tables, sl,
            torch.tensor(query_lens, dtype=torch.int32, device=k_cache.device))


PREFILL_CASES = [(h, d, b, dt) for (h, d, b), dt in itertools.product(
    zip(GQA, HEAD_SIZES, BLOCK_SIZES, strict=True), DTYPES)]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("heads,head_dim,block_size,dtype", PREFILL_CASES,
                         ids=lambda x: str(x).replace("torch.", ""))
def test_prefill_matches_reference(heads, head_dim, block_size, dtype, backend):
    # A fresh prompt (no context), a decode-like step, a chunk after a long context.
    case = make_prefill_case([0, 9, block_size + 3], [13, 1, 6], *heads, head_dim, block_size,
                             dtype, seed=21)
    out = paged_prefill(*case, backend=backend).cpu()
    expected = ref_paged_prefill(*cpu(*case))
    tol = TOL[dtype]
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected.double(), atol=tol, rtol=tol)


def test_prefill_with_one_token_each_is_decode():
    q, k, v, bt, sl, ql = make_prefill_case([0, 7, 16], [1, 1, 1], 8, 2, 64, 8,
                                            torch.float32, seed=23)
    torch.testing.assert_close(paged_prefill(q, k, v, bt, sl, ql).cpu(),
                               paged_attention(q, k, v, bt, sl).cpu(), atol=1e-6, rtol=1e-6)


def test_prefill_after_reshape_and_cache():
    """The engine's order: write the new tokens' K/V, then attend."""
    g = torch.Generator().manual_seed(0)
    block_size, heads, kv_heads, dim = 8, 4, 2, 64
    block_tables = torch.tensor([[2, 5, 1], [4, 0, 3]], dtype=torch.int32, device=DEVICE)
    contexts, query_lens = [5, 0], [7, 10]
    k_cache = torch.full((6, block_size, kv_heads, dim), float("nan"), device=DEVICE)
    v_cache = k_cache.clone()

    def write(seq_ids, positions):
        slots = slot_mapping_from_positions(block_tables, seq_ids.to(DEVICE),
                                            positions.to(DEVICE), block_size)
        kv = torch.randn(2, len(slots), kv_heads, dim, generator=g).to(DEVICE)
        reshape_and_cache(kv[0], kv[1], k_cache, v_cache, slots)
        return len(slots)

    for s, c in enumerate(contexts):  # the cached context
        write(torch.full((c,), s), torch.arange(c))
    n = write(torch.tensor([s for s, m in enumerate(query_lens) for _ in range(m)]),
              torch.cat([torch.arange(c, c + m)
                         for c, m in zip(contexts, query_lens, strict=True)]))
    q = torch.randn(n, heads, dim, generator=g).to(DEVICE)
    sl = torch.tensor([c + m for c, m in zip(contexts, query_lens, strict=True)],
                      dtype=torch.int32, device=DEVICE)
    ql = torch.tensor(query_lens, dtype=torch.int32, device=DEVICE)
    out = paged_prefill(q, k_cache, v_cache, block_tables, sl, ql).cpu()
    expected = ref_paged_prefill(*cpu(q, k_cache, v_cache, block_tables, sl, ql))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change,match", [
    (dict(query_lens=torch.tensor([2, 3], dtype=torch.int32)), "sum to"),
    (dict(query_lens=torch.tensor([9, 0], dtype=torch.int32)), ">= 1"),
    (dict(query_lens=torch.tensor([1, 3, 0], dtype=torch.int32)), "one per sequence"),
    (dict(query_lens=torch.tensor([1, 3])), "int32"),
    (dict(seq_lens=torch.tensor([3, 2], dtype=torch.int32)), "query_len 3 > seq_len 2"),
])
def test_prefill_validates(change, match):
    q, k, v, bt, sl, ql = make_prefill_case([2, 5], [1, 3], 4, 2, 64, 8, torch.float32,
                                            device="cpu")
    args = dict(q=q, k_cache=k, v_cache=v, block_tables=bt, seq_lens=sl, query_lens=ql)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        paged_prefill(**args)
