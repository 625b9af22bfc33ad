"""Prepacked, stacked linear maps: the same numbers as F.linear, rebuilt when weights change."""

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
    """One row: the plain product on one thread (BLAS's), oneDNN's on more (BLAS's
    matrix-vector product stays on one thread); the same numbers to 1e-6 either way."""
    g = torch.Generator().manual_seed(5)
    ws = [torch.randn(64, 96, generator=g) * 0.05]
    w, x = LinearWeights(ws, min_prepack_bytes=0), torch.randn(1, 96, generator=g)
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


def test_prepacked_where_onednn_works_and_plain_elsewhere(monkeypatch):
    w = torch.randn(16, 8)
    assert (LinearWeights([w], 0).packed is not None) == cpu_linear.prepack_available(w)
    assert LinearWeights([w]).packed is None  # 512 bytes: left plain (cache-resident)
    big = torch.randn(cpu_linear.MIN_PREPACK_BYTES // 4 // 64, 64)
    assert (LinearWeights([big]).packed is not None) == cpu_linear.prepack_available(big)
    assert LinearWeights([w.double()], 0).packed is None  # fp32 only
    monkeypatch.setattr(cpu_linear, "prepack_available", lambda weight: False)
    plain = LinearWeights([w], 0)
    x = torch.randn(4, 8)
    assert plain.packed is None and torch.equal(linear(x, plain), F.linear(x, w))


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
