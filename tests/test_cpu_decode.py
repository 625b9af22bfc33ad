"""The compiled CPU decode kernel (``backend="cpu"``) against the float64 reference.

Its batches come from :func:`~paged_lib.kernels.cases.make_decode_case`: every slot no
sequence may read is NaN and padding table entries are -1, so a kernel that reads past a
sequence's end returns NaN or garbage, not a near miss. Skipped, with the reason, on a
machine with no C compiler.
"""

import os

import pytest
import torch

import paged_lib  # noqa: F401  # isort: split
from paged_lib.engine import LLMEngine, SamplingParams
from paged_lib.kernels import (
    cpu_decode,
    paged_attention,
    paged_prefill,
    reshape_and_cache,
    slot_mapping_from_positions,
)
from paged_lib.kernels.cases import make_decode_case, make_prefill_case
from paged_lib.kernels.kv_quant import allocate_quantized_kv_caches
from paged_lib.kernels.reference import ref_paged_attention, ref_paged_prefill
from paged_lib.model import TinyLlama

try:
    cpu_decode.library()
except cpu_decode.KernelUnavailable as err:  # pragma: no cover - machines without cc
    pytest.skip(str(err), allow_module_level=True)

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("lens,heads,kv_heads,head_dim,block_size", [
    ((1, 17, 40, 0, 33), 4, 2, 64, 16),      # GQA 2, an empty sequence, part-filled blocks
    ((5, 100, 7), 8, 1, 40, 12),             # MQA, odd head size and block size
    ((64, 3), 4, 4, 128, 1),                 # MHA, one token per block
    ((300,), 16, 2, 32, 16),                 # group of 8, many blocks
    ((130, 1, 16), 9, 3, 64, 16),            # group of 3 (SmolLM2's heads)
    ((20, 9), 12, 2, 32, 16),                # group of 6: no case of its own in the kernel
])
def test_equals_the_float64_reference(dtype, lens, heads, kv_heads, head_dim, block_size):
    case = make_decode_case(list(lens), heads, kv_heads, head_dim, block_size, dtype=dtype)
    got = paged_attention(*case, backend="cpu")
    assert got.dtype == dtype and got.shape == case.q.shape
    assert not got.isnan().any(), "read a slot no sequence owns (NaN-poisoned)"
    torch.testing.assert_close(got.double(), ref_paged_attention(*case).double(),
                               atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("contexts,query_lens,heads,kv_heads,head_dim,block_size", [
    ((0, 0), (40, 7), 9, 3, 64, 16),          # whole prompts, SmolLM2's heads
    ((30, 0, 5), (1, 17, 12), 4, 2, 40, 12),  # a decode row, a prompt, a chunk after context
    ((100,), (33,), 8, 1, 128, 8),            # a chunk over many blocks, MQA
    ((3, 9), (1, 4), 4, 4, 32, 1),            # MHA, blocks of one token
])
def test_prefill_equals_the_float64_reference(dtype, contexts, query_lens, heads, kv_heads,
                                              head_dim, block_size):
    """Each new token sees its own position and those before it, nothing after (the later
    tokens' K/V are in the cache too, so a row that reads past its position is wrong, and
    the NaN-poisoned slots past each sequence's end show any read beyond it)."""
    case = make_prefill_case(list(contexts), list(query_lens), heads, kv_heads, head_dim,
                             block_size, dtype=dtype)
    got = paged_prefill(*case, backend="cpu")
    assert got.dtype == dtype and got.shape == case.q.shape
    assert not got.isnan().any(), "read a slot no sequence owns (NaN-poisoned)"
    torch.testing.assert_close(got.double(), ref_paged_prefill(*case).double(),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_empty_sequence_gets_zeros():
    case = make_decode_case([0, 9], 4, 2, 64, 4)
    assert paged_attention(*case, backend="cpu")[0].eq(0).all()


def test_scores_in_the_hundreds_do_not_overflow():
    case = make_decode_case([50, 80], 4, 2, 64, 16)
    q = case.q * 40  # scores of several hundred: a softmax without its running max overflows
    got = paged_attention(q, *case[1:], backend="cpu")
    torch.testing.assert_close(got.double(), ref_paged_attention(q, *case[1:]).double(),
                               atol=1e-4, rtol=1e-4)


def test_lengths_changed_in_place_between_calls_are_read_again():
    """The tables and lengths are converted once for the layers of a step (the same tensors
    passed again): changed in place, they must be converted again, not reused. (int64
    lengths, which the kernel's own function takes and converts into a copy.)"""
    case = make_decode_case([40, 25], 4, 2, 64, 8, poison=False)
    lens = case.seq_lens.long()
    scale = case.q.shape[-1] ** -0.5
    first = cpu_decode.paged_attention_cpu(case.q, case.k_cache, case.v_cache,
                                           case.block_tables, lens, scale)
    lens[0] = 9  # in place: the same tensor object, a new version
    got = cpu_decode.paged_attention_cpu(case.q, case.k_cache, case.v_cache,
                                         case.block_tables, lens, scale)
    want = ref_paged_attention(case.q, case.k_cache, case.v_cache, case.block_tables, lens)
    torch.testing.assert_close(got.double(), want.double(), atol=2e-5, rtol=2e-5)
    assert not torch.allclose(got[0], first[0])


def test_strided_caches_one_layer_of_a_stack():
    """The engine's caches may be views (a layer of a stacked tensor): strides are used."""
    case = make_decode_case([30, 7], 4, 2, 64, 8)
    stack = torch.stack([case.k_cache, case.v_cache], dim=1)  # [blocks, 2, bs, kvh, d]
    k, v = stack[:, 0], stack[:, 1]
    assert not k.is_contiguous()
    got = paged_attention(case.q, k, v, *case[3:], backend="cpu")
    torch.testing.assert_close(got, paged_attention(*case, backend="torch"),
                               atol=2e-5, rtol=2e-5)


def test_one_thread_and_many_agree_bit_for_bit():
    case = make_decode_case([100, 3, 250, 64, 1], 8, 2, 64, 16)
    one = cpu_decode.paged_attention_cpu(*case, num_threads=1)
    many = cpu_decode.paged_attention_cpu(*case, num_threads=4)
    assert torch.equal(one, many)  # each (sequence, KV head) is one thread's work


@pytest.mark.skipif(not cpu_decode._torch_libgomp(), reason="PyTorch is not on GNU libgomp")
def test_threads_are_pytorchs_openmp_team_and_one_runtime_is_loaded():
    # Python threads beside PyTorch's spinning OpenMP threads fought them for the cores:
    # the attention gained nothing from --threads 2 on two cores.
    assert cpu_decode.build_info()["threads"] == "PyTorch's OpenMP team"
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) == 1, runtimes  # the kernel was handed PyTorch's own libgomp
    case = make_decode_case([300, 7, 530, 64], 9, 3, 64, 16)  # 1.4 MB of K/V
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        team = cpu_decode.paged_attention_cpu(*case)  # enough K/V for both threads
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(team, cpu_decode.paged_attention_cpu(*case, num_threads=1))


def test_int8_cache_equals_the_torch_backend():
    case = make_decode_case([40, 21], 4, 2, 64, 16)
    [(k, v)] = allocate_quantized_kv_caches("int8", 1, tuple(case.k_cache.shape), "cpu")
    for s, n in enumerate(case.seq_lens.tolist()):
        pos = torch.arange(n)
        slots = slot_mapping_from_positions(case.block_tables, torch.full((n,), s), pos, 16)
        blocks, offs = slots // 16, slots % 16
        reshape_and_cache(case.k_cache[blocks, offs], case.v_cache[blocks, offs], k, v, slots,
                          backend="cpu")
    got = paged_attention(case.q, k, v, *case[3:], backend="cpu")
    torch.testing.assert_close(got, paged_attention(case.q, k, v, *case[3:], backend="torch"),
                               atol=1e-5, rtol=1e-5)


def test_bad_input_is_refused_with_a_reason():
    case = make_decode_case([5], 4, 2, 64, 4)
    with pytest.raises(ValueError, match="one dtype"):
        cpu_decode.paged_attention_cpu(case.q, case.k_cache, case.v_cache.half(), *case[3:])
    with pytest.raises(ValueError, match="unknown backend"):
        paged_attention(*case, backend="c")


def test_an_unwritable_home_falls_back_to_a_temporary_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGED_LIB_CACHE", raising=False)
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o500)
    monkeypatch.setattr(cpu_decode.Path, "home", lambda: home)
    monkeypatch.setattr(cpu_decode.tempfile, "gettempdir", lambda: str(tmp_path))
    if os.access(home, os.W_OK):  # root writes anywhere: make the home a file instead
        home.chmod(0o700)
        home.rmdir()
        home.write_text("")
    assert cpu_decode._cache_dir() == tmp_path / f"paged_lib-{os.getuid()}"


def test_no_compiler_is_named(monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(cpu_decode.KernelUnavailable, match="no C compiler"):
        cpu_decode._compiler()


def test_engine_on_the_cpu_backend_equals_transformers(tiny_hf_llama, greedy_reference):
    """Greedy tokens equal transformers' through swap preemption, and log-probs equal the
    torch backend's: the engine's caches start NaN, so a stray read would show."""
    torch.manual_seed(3)
    prompts = [torch.randint(0, 97, (n,)).tolist() for n in (3, 9, 14, 22)]
    model = TinyLlama.from_hf(tiny_hf_llama)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = {}
    for backend in ("cpu", "torch"):
        engine = LLMEngine(model, num_blocks=14, block_size=4, num_cpu_blocks=32,
                           preemption="swap", attention_backend=backend)
        outs[backend] = engine.generate(prompts, params)
        assert engine.stats.swapped_blocks > 0  # the pool is small enough to preempt
    expected = greedy_reference(tiny_hf_llama, prompts, 12)
    for out, ref, base in zip(outs["cpu"], expected, outs["torch"], strict=True):
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].cumulative_logprob == pytest.approx(
            base.outputs[0].cumulative_logprob, abs=1e-4)
