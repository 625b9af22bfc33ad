"""Prepacked, stacked linear maps (the C kernel's panels, or oneDNN's): the same numbers as
F.linear, rebuilt when weights change."""

import copy

import pytest
import torch
from torch.nn import functional as F

import paged_lib  # noqa: F401  # isort: split
from paged_lib.kernels import cpu_linear
from paged_lib.kernels.cpu_linear import LinearWeights, linear, stacked_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("rows", [1, 2, 8, 33])
def test_stacked_maps_equal_f_linear_to_1e6_relative(rows):
    g = torch.Generator().manual_seed(rows)
    ws = [torch.randn(n, 96, generator=g) * 0.05 for n in (96, 32, 32)]
    x = torch.randn(rows, 96, generator=g)
    w = LinearWeights(ws, min_prepack_bytes=0)  # prepacked, small as they are
    for got, want in zip(w.split(linear(x, w)), (F.linear(x, wi) for wi in ws), strict=True):
        assert got.shape == want.shape
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-6


def test_one_row_on_two_threads_takes_the_prepacked_map_and_agrees(monkeypatch):
    """Without the C kernel, one row: the plain product on one thread (BLAS's), oneDNN's
    on more (BLAS's matrix-vector product stays on one thread); the same numbers to 1e-6
    either way."""
    g = torch.Generator().manual_seed(5)
    ws = [torch.randn(64, 96, generator=g) * 0.05]
    w, x = LinearWeights(ws, 0, c_kernel=False), torch.randn(1, 96, generator=g)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.append(1) or real(*a), raising=False)
    one = linear(x, w)
    assert calls == []
    torch.set_num_threads(2)  # the one_torch_thread fixture puts 1 back
    two = linear(x, w)
    assert calls == ([1] if w.packed is not None else [])
    assert ((one - two).abs().max() / one.abs().max()).item() < 1e-6


def test_packed_for_the_c_kernel_else_onednn_else_plain(monkeypatch):
    w = torch.randn(16, 8)
    small = LinearWeights([w], 0)
    if cpu_linear.c_kernel_available(w):  # one packed copy, not two
        assert small.tiles is not None and small.packed is None
    else:
        assert small.tiles is None
        assert (small.packed is not None) == cpu_linear.prepack_available(w)
    left = LinearWeights([w])  # 512 bytes: packed for the C kernel only (cache-resident)
    assert left.packed is None and (left.tiles is not None) == cpu_linear.c_kernel_available(w)
    big = torch.randn(cpu_linear.MIN_PREPACK_BYTES // 4 // 64, 64)
    packed = LinearWeights([big])
    assert (packed.packed is not None or packed.tiles is not None) == (
        cpu_linear.c_kernel_available(big) or cpu_linear.prepack_available(big))
    double = LinearWeights([w.double()], 0)  # fp32 only
    assert double.packed is None and double.tiles is None
    monkeypatch.setattr(cpu_linear, "c_kernel_available", lambda weight: False)
    assert (LinearWeights([w], 0).packed is not None) == cpu_linear.prepack_available(w)
    monkeypatch.setattr(cpu_linear, "prepack_available", lambda weight: False)
    plain = LinearWeights([w], 0)
    x = torch.randn(4, 8)
    assert plain.packed is None and plain.tiles is None
    assert torch.equal(linear(x, plain), F.linear(x, w))


needs_c = pytest.mark.skipif(not cpu_linear.c_kernel_available(torch.ones(1, 1)),
                             reason="the C kernel is not built here (no C compiler, or "
                                    "PyTorch's OpenMP is not GNU libgomp)")


def _ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


@needs_c
@pytest.mark.parametrize("n", [1, 31, 32, 33, 95, 960])
@pytest.mark.parametrize("k", [1, 7, 64, 97, 576])
def test_c_kernel_equals_float64_at_every_panel_and_tile_edge(n, k):
    """Columns around the 32-wide panels (the last one part-filled), rows around the
    8-row tiles and past a block of rows (130), input sizes around the 64-row chunks:
    each output within float32 rounding of the float64 product, none left unwritten."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g) / k**0.5
    lw = LinearWeights([w], 0)
    assert lw.tiles is not None
    for rows in (0, 1, 2, 7, 8, 9, 16, 17, 33, 130):
        x = torch.randn(rows, k, generator=g)
        got, want = linear(x, lw), _ref(x, w)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_c
def test_c_kernel_reads_strided_rows_and_agrees_on_one_and_two_threads():
    """Rows with a stride (Q's columns of a stacked output) and a transposed input are read
    right; each output is one sum in order, so two threads give the same bits as one."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(100, 64, generator=g)
    lw = LinearWeights([w], 0)
    wide = torch.randn(12, 200, generator=g)
    x = wide[:, 10:74]  # stride(0) 200, not 64
    torch.testing.assert_close(linear(x, lw), _ref(x, w), rtol=1e-5, atol=1e-5)
    xt = torch.randn(64, 12, generator=g).T  # columns contiguous: copied first
    torch.testing.assert_close(linear(xt, lw), _ref(xt, w), rtol=1e-5, atol=1e-5)
    one = linear(x, lw)
    torch.set_num_threads(2)  # the one_torch_thread fixture puts 1 back
    assert torch.equal(linear(x, lw), one)


@needs_c
def test_c_kernel_gives_zeros_for_no_inputs():
    lw = LinearWeights([torch.ones(40, 0)], 0)
    assert torch.equal(linear(torch.ones(5, 0), lw), torch.zeros(5, 40))


@needs_c
def test_c_kernel_leaves_autograd_and_wrong_sizes_to_f_linear():
    w = torch.randn(40, 16)
    lw = LinearWeights([w], 0)
    x = torch.randn(3, 16, requires_grad=True)
    y = linear(x, lw)
    y.sum().backward()  # F.linear: gradients flow
    torch.testing.assert_close(x.grad, w.sum(0).expand(3, 16))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        linear(torch.randn(3, 17), lw)


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="same input size"):
        LinearWeights([torch.ones(4, 8), torch.ones(4, 9)])
    with pytest.raises(ValueError, match="2-D weights"):
        LinearWeights([])


def test_a_changed_or_replaced_weight_is_stacked_again():
    layer = torch.nn.Linear(8, 4, bias=False)
    first = stacked_weights(layer, "w", [layer.weight])
    assert stacked_weights(layer, "w", [layer.weight]) is first  # built once
    with torch.no_grad():
        layer.weight.mul_(2)  # in place: the version counter moves
    again = stacked_weights(layer, "w", [layer.weight])
    assert again is not first and torch.equal(again.plain, layer.weight)
    layer.weight = torch.nn.Parameter(torch.ones(4, 8))  # replaced
    assert torch.equal(stacked_weights(layer, "w", [layer.weight]).plain, torch.ones(4, 8))


def test_the_model_loads_new_weights_and_copies_after_prepacking(tiny_hf_llama):
    from paged_lib.model import TinyLlama

    tiny_model = TinyLlama.from_hf(tiny_hf_llama)  # its own: its weights change below
    x = torch.randint(0, tiny_model.config.vocab_size, (3,))
    hidden = tiny_model.embed_tokens(x)
    mlp = tiny_model.layers[0].mlp
    with torch.no_grad():
        before = mlp(hidden)
        expected = mlp.down_proj(F.silu(mlp.gate_proj(hidden)) * mlp.up_proj(hidden))
        assert ((before - expected).abs().max() / expected.abs().max()).item() < 1e-6
        other = TinyLlama.from_hf(tiny_hf_llama)
        for p in other.parameters():
            p.mul_(0.5)
        tiny_model.load_state_dict(other.state_dict())  # in place, into the same tensors
        halved = mlp(hidden)
    clone = copy.deepcopy(tiny_model)  # the packed weights live outside the module
    with torch.no_grad():
        assert torch.allclose(clone.layers[0].mlp(hidden), halved)
    assert not torch.allclose(halved, before)


def test_weights_made_in_inference_mode_are_stacked_too():
    with torch.inference_mode():
        layer = torch.nn.Linear(8, 4, bias=False)
        x = torch.randn(3, 8)
        w = stacked_weights(layer, "w", [layer.weight])
        assert stacked_weights(layer, "w", [layer.weight]) is w
        assert torch.allclose(linear(x, w), layer(x), rtol=1e-6, atol=1e-6)
