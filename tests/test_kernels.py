"""The paged-attention kernels against the float64 reference, in vLLM's test style.

Every batch comes from :mod:`paged_lib.kernels.cases`: every cache slot no sequence may
read is NaN, block tables are random with repeated entries (sequences share physical
blocks, like a shared prefix), and block-table entries past a sequence's last block are
padding that points at no block: a kernel that reads past a sequence's end, or follows
an unused entry, returns NaN or crashes.

On a CPU these run in Triton's interpreter (chapter 00 measures its cost per program:
batches are tiny); on a GPU the kernels get CUDA tensors (``DEVICE``) and the reference runs on
the CPU. Tests marked GPU-only (long contexts, a cache of more than 2**31 elements,
native bf16) skip on a CPU and run in ``make gpu-check``.
"""

from __future__ import annotations

# First, before triton is imported anywhere: sets TRITON_INTERPRET on a CPU.
import paged_lib  # noqa: F401

# isort: split

import pytest
import torch

from paged_lib.device import interpreter_on
from paged_lib.kernels import (
    choose_num_splits,
    cpu_decode,
    paged_attention,
    paged_prefill,
    reshape_and_cache,
    slot_mapping_from_positions,
)
from paged_lib.kernels import triton_decode as td
from paged_lib.kernels.cases import make_decode_case, make_prefill_case
from paged_lib.kernels.reference import gather_kv, ref_paged_attention, ref_paged_prefill
from paged_lib.kernels.triton_split import MAX_SPLITS


def ref_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The cache write, token by token (in place): token ``t`` goes to block
    ``slot // block_size``, offset ``slot % block_size``; slot ``-1`` writes nothing."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = key[t]
            v_cache[slot // block_size, slot % block_size] = value[t]


#: (num_heads, num_kv_heads), head_dim, block_size: every value vLLM's attention tests use
#: appears at least once. Heads: MHA, GQA 4:1, 5:1, 3:1, 5:1 with 8 KV heads, MQA 64:1
#: (4 head chunks), 71:1 (an odd group over 5 chunks). Head sizes: powers of two,
#: 80/96/112 (masked up to 128), 40 (not a multiple of 16), 256 (its own tile and warps).
#: Block sizes: 1, 12 (not a power of two), 8-32, 128 (larger than a tile).
SHAPES = [
    ((4, 4), 64, 16),
    ((8, 2), 128, 8),
    ((5, 1), 80, 32),
    ((12, 4), 96, 1),
    ((40, 8), 112, 12),
    ((64, 1), 40, 128),
    ((71, 1), 256, 16),
]
SHAPE_IDS = [f"{h[0]}q{h[1]}kv-d{d}-b{b}" for h, d, b in SHAPES]
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
FAR_OUT = 2**30  # an unused block-table entry no kernel may follow
DEVICE = paged_lib.default_device()
#: Decode backends: "cpu" (the compiled C kernel) runs on CPU tensors only, where it builds.
DECODE_BACKENDS = ["triton", "torch"] + (
    ["cpu"] if DEVICE == "cpu" and cpu_decode.available() else [])
ON_GPU = DEVICE == "cuda" and not interpreter_on()
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU compiling natively "
                              "(too large or not meaningful in the interpreter)")


def make_case(seq_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
              dtype=torch.float32, seed=0, device=DEVICE, **kwargs):
    """:func:`make_decode_case` on the test device."""
    return make_decode_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                            device, seed, **kwargs)


def lens_for(block_size, extra=()):
    """1 token, a full block, a block plus one, and a few blocks plus a bit (at most 40)."""
    return [1, block_size, block_size + 1, min(2 * block_size + 3, 40), *extra]


def assert_matches_reference(out, case, scale=None):
    args = [t.cpu() for t in case[:5]]
    expected = ref_paged_attention(*args, scale=case[5] if scale is None else scale)
    out = out.cpu()
    tol = TOL[out.dtype]
    assert not out.isnan().any(), "NaN in the output: a poisoned slot was read"
    torch.testing.assert_close(out.double(), expected.double(), atol=tol, rtol=tol)


# ------------------------------------------------------------------ decode


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,head_dim,block_size", SHAPES, ids=SHAPE_IDS)
def test_decode_matches_reference(heads, head_dim, block_size, dtype, backend):
    case = make_case(lens_for(block_size), *heads, head_dim, block_size, dtype,
                     seed=head_dim + block_size)
    assert_matches_reference(paged_attention(*case, backend=backend), case)


@pytest.mark.parametrize("heads,head_dim,block_size", SHAPES, ids=SHAPE_IDS)
def test_split_kv_mixed_lengths_with_an_empty_sequence(heads, head_dim, block_size):
    """Forced split-KV over lengths 0..100: segments sized per sequence, some empty."""
    dtype = DTYPES[head_dim % 2 == 0 and block_size % 2]  # both dtypes over the shapes
    num_splits = 2 + block_size % 2
    case = make_case([0, 1, block_size + 1, 100], *heads, head_dim, block_size, dtype, seed=3)
    out, launch = td.paged_attention_triton(*case[:5], case.scale, num_splits=num_splits,
                                            return_launch=True)
    assert launch.num_splits == num_splits
    assert (out[0].cpu() == 0).all(), "a sequence of length 0 must give zeros"
    assert_matches_reference(out, case)


def test_split_kv_really_splits(monkeypatch):
    """The forced split reaches the kernel as 3 segments and a merge."""
    seen = []
    real_merge = td.merge_splits
    monkeypatch.setattr(td, "merge_splits",
                        lambda partial, lse, out: seen.append(partial.shape[2])
                        or real_merge(partial, lse, out))
    case = make_case([1, 17, 97, 150], 8, 2, 128, 16, seed=4)
    assert_matches_reference(paged_attention(*case, num_splits=3), case)
    assert seen == [3]


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("num_splits", [None, 2])
def test_length_zero_sequences_give_zeros_and_change_nothing_else(backend, num_splits):
    """CUDA-graph batches pad with length-0 rows: zeros for them, the rest as without."""
    case = make_case([0, 19, 0, 40], 8, 2, 64, 8, seed=8)
    out = paged_attention(*case, backend=backend, num_splits=num_splits).cpu()
    assert (out[[0, 2]] == 0).all()
    assert_matches_reference(out, case)
    alone = paged_attention(case.q[[1, 3]], *case[1:3], case.block_tables[[1, 3]],
                            case.seq_lens[[1, 3]], backend=backend, num_splits=num_splits)
    torch.testing.assert_close(out[[1, 3]], alone.cpu(), atol=1e-6, rtol=1e-6)
    empty = paged_attention(*case[:4], torch.zeros_like(case.seq_lens), backend=backend,
                            num_splits=num_splits)
    assert (empty.cpu() == 0).all()


@pytest.mark.parametrize("num_splits", [None, 2])
def test_large_scores_on_the_triton_path(num_splits):
    """Scores of several thousand: the online softmax must subtract its running max."""
    case = make_case([5, 40, 23], 8, 2, 64, 16, seed=12)
    q = case.q * 100
    out = paged_attention(q, *case[1:5], 1.0, num_splits=num_splits)
    scores = torch.einsum("shd,bthd->sbth", q.double().cpu()[:, :2],
                          case.k_cache.double().cpu()[..., :1, :]).nan_to_num()
    assert scores.abs().max() > 1000  # exp() of these overflows without the max
    assert torch.isfinite(out.cpu()).all()
    expected = ref_paged_attention(q.cpu(), *(t.cpu() for t in case[1:5]), 1.0)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_validate_false_reads_nothing_back(monkeypatch):
    """``validate=False`` skips every check that would copy values to the host."""
    import paged_lib.kernels as kernels

    case = make_case([3, 30], 4, 2, 64, 16, seed=14)
    expected = paged_attention(*case)

    def no_sync(*a, **k):
        raise AssertionError("read values back from the device")

    monkeypatch.setattr(kernels, "_check_seq_lens", no_sync)
    monkeypatch.setattr(kernels, "_check_query_lens", no_sync)
    for name in ("item", "tolist", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    out = paged_attention(*case, validate=False)
    monkeypatch.undo()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    with pytest.raises(AssertionError, match="read values back"):
        monkeypatch.setattr(kernels, "_check_seq_lens", no_sync)
        paged_attention(*case)


def test_gpu_autotune_plumbing():
    """The GPU path's autotuner, run in the interpreter with a stand-in benchmark."""
    timings = iter(range(100, 0, -1))  # each config "runs faster" than the last

    def fake_bench(kernel_call, quantiles):
        kernel_call()
        t = float(next(timings))
        return [t, t, t]

    tuned = td.make_autotuned_decode_kernel(64, torch.float32, do_bench=fake_bench)
    key = (64, torch.float32, td.smem_limit(torch.device(DEVICE)))
    old = td._autotuned.get(key)
    td._autotuned[key] = tuned
    try:
        case = make_case([17, 40], 4, 1, 64, 16, seed=6)  # 2 programs per launch
        for num_splits in (1, 2):
            out = td.paged_attention_triton(*case, num_splits=num_splits, autotune=True)
            assert_matches_reference(out, case)
        assert tuned.best_config.kwargs["TILE_N"] == td.gpu_configs(64, torch.float32)[-1][0]
    finally:
        td._autotuned.pop(key)
        if old is not None:
            td._autotuned[key] = old


def test_autotune_is_opt_in(monkeypatch):
    monkeypatch.delenv("PAGED_LIB_AUTOTUNE", raising=False)
    assert not td.use_autotune(torch.device("cuda"))
    assert not td.use_autotune(torch.device("cpu"))
    monkeypatch.setenv("PAGED_LIB_AUTOTUNE", "1")
    assert td.use_autotune(torch.device("cuda")) == (not interpreter_on())


def test_split_kv_with_empty_segments_and_tiles_across_blocks():
    """More segments than a short sequence fills; tiles smaller and larger than blocks."""
    case = make_case([3, 130, 129, 1], 8, 2, 64, 128, seed=5)  # block 128 > tile
    for num_splits, tile_n, stages in ((8, 16, 3), (4, 32, 3), (2, 256, 1)):
        out = td.paged_attention_triton(*case, num_splits=num_splits, tile_n=tile_n,
                                        num_stages=stages)
        assert_matches_reference(out, case)


@pytest.mark.parametrize("tile_n,stages,dtype,match", [
    (8, 3, torch.float16, "power of two >= 16"),
    (48, 2, torch.float16, "power of two >= 16"),
    (256, 3, torch.float32, "384 KB of shared memory"),
    (128, 2, torch.float32, "256 KB of shared memory"),
])
def test_bad_tile_sizes_are_refused_before_launch(tile_n, stages, dtype, match):
    case = make_case([5], 4, 2, 128 if tile_n == 128 else 64, 16, dtype)
    with pytest.raises(ValueError, match=match):
        td.paged_attention_triton(*case, tile_n=tile_n, num_stages=stages)


def test_hand_configs_and_tuning_space_fit_in_shared_memory():
    for head_dim in (40, 64, 80, 128, 256):
        for dtype in (torch.float32, torch.float16):
            cfg = td.launch_config(head_dim, dtype)
            td.check_config(cfg["TILE_N"], cfg["num_stages"], head_dim, dtype)
            assert td.gpu_configs(head_dim, dtype), (head_dim, dtype)
    # 64-token fp32 tiles of head size 256 need 256-384 KB: pruned.
    assert td.gpu_configs(256, torch.float32) == [(16, 4, 3), (32, 4, 2), (32, 4, 3)]


def test_alignment_hint():
    assert td.alignment(40 * 8 * 16, 40 * 8, 40) == 8
    assert td.alignment(128 * 8 * 16, 128 * 8, 128) == 16
    assert td.alignment(3 * 16, 3, 1) == 1


def test_split_merge_kernel_matches_the_one_merge():
    """The Triton merge kernel (exp2 inside) equals merge_partials on natural-log lse."""
    from paged_lib.attention import merge_partials
    from paged_lib.kernels.triton_split import merge_splits

    g = torch.Generator().manual_seed(0)
    partial = torch.randn(3, 20, 5, 80, generator=g)
    lse = torch.randn(3, 20, 5, generator=g) * 4
    lse[0, :, 3:] = float("-inf")  # empty segments
    lse[2] = float("-inf")  # a sequence of length 0: every segment empty
    out = merge_splits(partial.to(DEVICE), lse.to(DEVICE), torch.empty(3, 20, 80, device=DEVICE))
    expected = merge_partials(partial.permute(2, 0, 1, 3), lse.permute(2, 0, 1))
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    assert (out[2] == 0).all()


def test_choose_num_splits_heuristic():
    # CPU / interpreter: never split on its own.
    assert choose_num_splits(1, 8, 100_000, None) == 1
    # Enough programs to fill the GPU several times, or short contexts: no split.
    assert choose_num_splits(128, 8, 4096, 132) == 1
    assert choose_num_splits(2, 8, 300, 132) == 1
    # 512 programs on 132 SMs: under 4 per SM, so 2 segments each.
    assert choose_num_splits(64, 8, 4096, 132) == 2
    # Few long sequences: split in powers of two, bounded by MAX_SPLITS and the length.
    assert choose_num_splits(1, 8, 32_768, 132) == 64
    assert choose_num_splits(1, 8, 100_000, 132) == MAX_SPLITS
    assert choose_num_splits(4, 8, 1024, 132) == 4
    assert choose_num_splits(8, 8, 8192, 132) == 8
    assert choose_num_splits(16, 8, 8192, 132) == 4
    assert choose_num_splits(32, 8, 8192, 132, head_chunks=4) == 1


def test_bf16_upcasts_in_the_interpreter():
    case = make_case(lens_for(16), 8, 2, 64, 16, torch.bfloat16, seed=7)
    assert_matches_reference(paged_attention(*case), case)
    assert_matches_reference(paged_attention(*case, num_splits=2), case)


def test_strided_caches_and_query():
    """vLLM's Triton layout [num_blocks, 2, block_size, heads, dim]: K and V are views."""
    q, k_cache, v_cache, block_tables, seq_lens, scale = make_case(lens_for(16), 8, 2, 64, 16,
                                                                   seed=9)
    kv = torch.stack([k_cache, v_cache], dim=1)
    q_wide = torch.zeros(q.shape[0], q.shape[1], 96, device=q.device)
    q_wide[..., :64] = q
    case = (q_wide[..., :64], kv[:, 0], kv[:, 1], block_tables, seq_lens, scale)
    assert not case[1].is_contiguous() and not case[0].is_contiguous()
    assert_matches_reference(paged_attention(*case), case)


def test_explicit_scale():
    case = make_case(lens_for(8), 4, 4, 64, 8, seed=11)
    assert_matches_reference(paged_attention(*case[:5], scale=0.3), case, scale=0.3)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size",
                         [(8, 2, 64, 16), (5, 1, 80, 8)])
def test_agrees_with_flex_attention_paged(backend, heads, kv_heads, head_dim, block_size):
    """PyTorch's FlexAttention PagedAttention (eager, CPU): an independent implementation.

    Not on a poisoned cache: eager FlexAttention computes scores over every slot and
    masks afterwards, so a NaN anywhere reaches its output (0 * NaN). Distinct blocks:
    its page table cannot map one block twice within a sequence.
    """
    import warnings

    from paged_lib.kernels.reference import flex_paged_attention

    case = make_case([1, block_size, block_size + 1, 45], heads, kv_heads, head_dim,
                     block_size, seed=13, shared=False, poison=False, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = flex_paged_attention(*case)()
    ours = paged_attention(*case.to(DEVICE), backend=backend).cpu()
    torch.testing.assert_close(ours, flex, atol=1e-5, rtol=1e-5)
    assert_matches_reference(flex, case)


def test_empty_batch():
    q, k, v, bt, _, _ = make_case([5], 4, 2, 64, 8)
    for backend in DECODE_BACKENDS:
        out = paged_attention(q[:0], k, v, bt[:0],
                              torch.zeros(0, dtype=torch.int32, device=DEVICE), backend=backend)
        assert out.shape == (0, 4, 64)


# ------------------------------------------------------------------ validation


def _bad(case, **change):
    names = ["q", "k_cache", "v_cache", "block_tables", "seq_lens"]
    args = dict(zip(names, case[:5], strict=True))
    kwargs = {k: change.pop(k) for k in ("backend", "num_splits") if k in change}
    args.update(change)
    return args, kwargs


BAD_INPUTS = {
    "heads not a multiple": (lambda c: {"q": torch.randn(4, 5, 64)}, "multiple of num_kv_heads"),
    "seq_len past capacity": (lambda c: {"seq_lens": torch.tensor([1, 8, 9, 33],
                                                                  dtype=torch.int32)},
                              "holds only"),
    "negative seq_len": (lambda c: {"seq_lens": torch.tensor([-1, 8, 9, 19],
                                                             dtype=torch.int32)},
                         "lengths are >= 0"),
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
    for pad in (-1, FAR_OUT):
        case = make_case([1, 8, 9], 4, 2, 64, 8, pad=pad)
        assert (case.block_tables == pad).any()
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
    k_ref, v_ref = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"),
                                                                             dtype=dtype)
    ref_reshape_and_cache(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))
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


def cpu(*tensors):
    return tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in tensors)


def prefill_case(contexts, query_lens, num_heads, num_kv_heads, head_dim, block_size,
                 dtype=torch.float32, seed=0, device=DEVICE):
    return make_prefill_case(contexts, query_lens, num_heads, num_kv_heads, head_dim,
                             block_size, dtype, device, seed)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("heads,head_dim,block_size", SHAPES, ids=SHAPE_IDS)
def test_prefill_matches_reference(heads, head_dim, block_size, backend):
    # A fresh prompt (no context), a decode-like step, a chunk after a long context.
    dtype = DTYPES[block_size % 2 == 0 and head_dim % 32 == 0]
    case = prefill_case([0, 9, min(block_size + 3, 20)], [13, 1, 6], *heads, head_dim,
                        block_size, dtype, seed=21)
    out = paged_prefill(*case, backend=backend).cpu()
    expected = ref_paged_prefill(*cpu(*case))
    tol = TOL[dtype]
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected.double(), atol=tol, rtol=tol)


def test_prefill_without_validation_or_a_grid_hint():
    case = prefill_case([3, 0], [2, 7], 8, 2, 64, 8, seed=22)
    expected = paged_prefill(*case)
    torch.testing.assert_close(paged_prefill(*case, validate=False), expected, atol=0, rtol=0)


def test_prefill_grid_keeps_long_prompts_on_the_first_axis(monkeypatch):
    """CUDA allows 65535 programs on grid axes 2 and 3: token tiles go on axis 1."""
    from paged_lib.kernels import triton_prefill as tp

    grids = []

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *a, **k: None

    monkeypatch.setattr(tp, "_paged_prefill_kernel", Spy())
    n = 300_000  # 75,000 tiles of 4 tokens with 16 heads per KV head
    meta = dict(device="meta")  # shapes only: the spy launches nothing
    q = torch.empty(n, 16, 16, **meta)
    cache = torch.empty(n // 16 + 1, 16, 1, 16, **meta)
    lens = torch.empty(1, dtype=torch.int32, **meta)
    tp.paged_prefill_triton(q, cache, cache, torch.empty(1, n // 16 + 1, dtype=torch.int32,
                                                         **meta),
                            lens, lens, 0.25, max_query_len=n)
    assert grids == [(75_000, 1, 1)]
    lens = torch.empty(70_000, dtype=torch.int32, **meta)
    with pytest.raises(ValueError, match="at most 65535"):
        tp.paged_prefill_triton(q[:70_000], cache, cache,
                                torch.empty(70_000, 1, dtype=torch.int32, **meta), lens, lens,
                                0.25)


def test_prefill_with_one_token_each_is_decode():
    q, k, v, bt, sl, ql, _ = prefill_case([0, 7, 16], [1, 1, 1], 8, 2, 64, 8, seed=23)
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
    q, k, v, bt, sl, ql, _ = prefill_case([2, 5], [1, 3], 4, 2, 64, 8, device="cpu")
    args = dict(q=q, k_cache=k, v_cache=v, block_tables=bt, seq_lens=sl, query_lens=ql)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        paged_prefill(**args)


# ------------------------------------------------------------------ GPU only (make gpu-check)


@gpu_only
@pytest.mark.parametrize("context", [32 * 1024, 128 * 1024])
def test_long_contexts_on_the_gpu(context):
    """One and two sequences of 32K/128K tokens, split-KV as chosen, vs the reference."""
    case = make_case([context, context // 3 + 5], 32, 8, 128, 16, torch.float16, seed=31,
                     shared=False)
    out, launch = td.paged_attention_triton(*case[:5], case.scale, return_launch=True)
    assert launch.num_splits > 1
    expected = ref_paged_attention(*case)  # float64, on the GPU
    torch.testing.assert_close(out.double(), expected.double(), atol=3e-3, rtol=3e-3)


@gpu_only
def test_a_cache_of_more_than_2_31_elements():
    """Block ids times strides past 2**31: offsets must be 64-bit in every kernel."""
    block_size, kv_heads, dim = 16, 1, 128
    num_blocks = 2**31 // (block_size * kv_heads * dim) + 64  # 4.3 GB per fp16 cache
    case = make_case([40, 70], 8, kv_heads, dim, block_size, torch.float16, seed=32,
                     shared=False, poison=False, num_blocks=num_blocks)
    tables = case.block_tables.clone()
    tables[0, :3] = torch.tensor([num_blocks - 1, num_blocks - 3, 5])
    tables[1, :5] = torch.arange(num_blocks - 9, num_blocks - 4)
    assert case.k_cache.numel() > 2**31
    # The write path at the very end of the cache, then attention reading it back.
    slots = slot_mapping_from_positions(tables, torch.tensor([0, 1], device=DEVICE),
                                        torch.tensor([39, 69], device=DEVICE), block_size)
    new = torch.randn(2, 2, kv_heads, dim, device=DEVICE, dtype=torch.float16)
    reshape_and_cache(new[0], new[1], case.k_cache, case.v_cache, slots)
    out = paged_attention(case.q, case.k_cache, case.v_cache, tables, case.seq_lens)
    used = tables[:, :5].clamp(min=0).unique()
    remap = torch.full((num_blocks,), -1, dtype=torch.int32, device=DEVICE)
    remap[used.long()] = torch.arange(len(used), dtype=torch.int32, device=DEVICE)
    small = (case.q, case.k_cache[used.long()], case.v_cache[used.long()],
             torch.where(tables >= 0, remap[tables.clamp(min=0).long()], -1), case.seq_lens)
    assert torch.equal(small[1][remap[tables[0, 2]].long(), 39 % block_size], new[0, 0])
    expected = ref_paged_attention(*cpu(*small))
    torch.testing.assert_close(out.cpu().double(), expected.double(), atol=3e-3, rtol=3e-3)


@gpu_only
@pytest.mark.parametrize("heads,head_dim,block_size", SHAPES, ids=SHAPE_IDS)
def test_bf16_natively_on_the_gpu(heads, head_dim, block_size):
    case = make_case(lens_for(block_size, (300,)), *heads, head_dim, block_size, torch.bfloat16,
                     seed=33)
    assert_matches_reference(paged_attention(*case), case)
    assert_matches_reference(paged_attention(*case, num_splits=4), case)
    pf = prefill_case([0, 30], [20, 3], *heads, head_dim, block_size, torch.bfloat16, seed=34)
    torch.testing.assert_close(paged_prefill(*pf).cpu().double(),
                               ref_paged_prefill(*cpu(*pf)).double(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2,
                    reason="needs two CUDA GPUs (launch on the tensors' own device)")
def test_launches_on_the_tensors_own_device():
    case = make_case(lens_for(16), 8, 2, 64, 16, torch.float16, seed=35, device="cuda:1")
    with torch.cuda.device(0):
        assert_matches_reference(paged_attention(*case), case)
        assert_matches_reference(paged_attention(*case, num_splits=2), case)
