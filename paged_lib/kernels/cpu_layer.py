"""A decoder layer's small steps as C loops, one pass each: ``backend="cpu"`` steps.

Between its linear maps, a Llama layer normalises rows (RMSNorm), rotates queries and
keys (RoPE), writes K and V into the paged cache and multiplies SwiGLU's two halves. In
PyTorch each is a handful of operations, each writing a temporary; with one row per
sequence the arithmetic is nothing, and what costs is the passes over memory that the
linear maps have just flushed from the caches (SmolLM2 at batch 8: an RMSNorm took about
40 us inside the model, 9 us alone). :func:`rms_norm`, :func:`add_rms_norm`,
:func:`rope_and_write` and :func:`silu_mul` do each step in one pass, in C
(``csrc/layer_ops.c``, built with :mod:`paged_lib.kernels.cpu_decode`'s kernel into one
library), with PyTorch's float32 arithmetic per element (sums over a row may differ
in the last bit: the tests hold each to torch's within 1e-6). A prefill's many rows are
shared out between PyTorch's threads for the norms and the activation (each row alone,
so the same numbers on any number of threads).

In a decode step, :func:`decode_layers` runs every layer (its four linear maps, these steps
and the attention) in one C call on PyTorch's thread team, so no Python runs between them
(``csrc/decode_layer.c``).

The model takes them (:meth:`paged_lib.model.TinyLlama.forward` runs each layer's
:meth:`~paged_lib.model.DecoderLayer.forward_fused`) where :func:`applies`:
``backend="cpu"``, no gradients, float32 CPU rows, and a step whose slots the model
runner has checked (``validate=False``). Everything else, and every learner-facing
chapter, runs the PyTorch operations of :mod:`paged_lib.model`.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch

from paged_lib.kernels import cpu_decode

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = cpu_decode.library()
    for name, args in (("rms_norm_rows", [_P, _P, _P, _I, _I, _F, _I]),
                       ("add_rms_norm_rows", [_P] * 5 + [_I, _I, _F, _I]),
                       ("rope_write_rows", [_P] * 7 + [_I] * 4),
                       ("silu_mul_rows", [_P, _P, _I, _I, _I]),
                       ("decode_layers", [_I, _P, _P, _P, _P] + [_I] * 6 + [_P] * 5
                        + [ctypes.c_int64, _I, _F, _I, _I])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, args
    lib.decode_layer_scratch.restype = ctypes.c_int64
    lib.decode_layer_scratch.argtypes = [_I] * 6
    return lib


@functools.cache
def available() -> bool:
    """Can the C library be built and loaded here (a C compiler, see ``cpu_decode``)?"""
    return cpu_decode.available()


def applies(x: torch.Tensor, backend: str, validate: bool) -> bool:
    """Does the model take these loops for rows ``x``: ``backend="cpu"``, a step the
    runner checked (``validate=False``), no autograd, contiguous float32 rows on the CPU,
    and the library built?"""
    return (backend == "cpu" and not validate and not torch.is_grad_enabled()
            and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.is_contiguous() and available())


def fits(k_cache, v_cache) -> bool:
    """Are the caches ones :func:`rope_and_write` writes: contiguous float32 CPU tensors
    (not the int8 blocks of chapter 11, not a device's)?"""
    return all(isinstance(c, torch.Tensor) and c.device.type == "cpu"
               and c.dtype == torch.float32 and c.is_contiguous() for c in (k_cache, v_cache))


def _check_weight(weight: torch.Tensor, dim: int) -> None:
    if weight.shape != (dim,) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"need a contiguous float32 weight of {dim}, got "
                         f"{tuple(weight.shape)} {weight.dtype}")


def _rows(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    rows, dim = x.shape
    _check_weight(weight, dim)
    return rows, dim


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` per row (``F.rms_norm`` over the last dimension)."""
    rows, dim = _rows(x, weight)
    out = torch.empty_like(x)
    _lib().rms_norm_rows(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim, eps,
                         torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual step in one pass: ``x + h`` and its RMSNorm (both returned)."""
    rows, dim = _rows(x, weight)
    if h.shape != x.shape or h.dtype != x.dtype or not h.is_contiguous():
        raise ValueError(f"h must be contiguous {tuple(x.shape)} {x.dtype}, got "
                         f"{tuple(h.shape)} {h.dtype}")
    total, out = torch.empty_like(x), torch.empty_like(x)
    _lib().add_rms_norm_rows(x.data_ptr(), h.data_ptr(), weight.data_ptr(), total.data_ptr(),
                             out.data_ptr(), rows, dim, eps, torch.get_num_threads())
    return total, out


def _check_step_rows(cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, n: int,
                     d: int) -> None:
    """The rotation angles ``[n, d]`` and the slots ``[n]`` of a step's ``n`` new tokens."""
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (n, d) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 [{n}, {d}], got "
                             f"{tuple(t.shape)} {t.dtype}")
    if slots.shape != (n,) or slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError(f"slots must be contiguous int64 [{n}], got {tuple(slots.shape)} "
                         f"{slots.dtype}")


def rope_and_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   heads: int, kv_heads: int) -> torch.Tensor:
    """Rotate the queries and keys of ``qkv`` (``[n, (heads + 2 kv_heads) * d]``: Q, K,
    V heads side by side), write the keys and values into ``slots`` of the caches
    (``[blocks, block_size, kv_heads, d]``) and return the queries ``[n, heads, d]``.

    The caller vouches for ``slots`` (every one a slot of the pool: the model runner's
    check, ``validate=False``); the shapes and dtypes are checked here."""
    n = qkv.shape[0]
    d = k_cache.shape[-1]
    if (qkv.dtype != torch.float32 or not qkv.is_contiguous()
            or qkv.shape[1] != (heads + 2 * kv_heads) * d):
        raise ValueError(f"qkv must be contiguous float32 [n, {(heads + 2 * kv_heads) * d}], "
                         f"got {tuple(qkv.shape)} {qkv.dtype}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dtype != torch.float32 or not c.is_contiguous() or c.shape[2:] != (kv_heads, d):
            raise ValueError(f"{name} must be contiguous float32 [blocks, block_size, "
                             f"{kv_heads}, {d}], got {tuple(c.shape)} {c.dtype}")
    _check_step_rows(cos, sin, slots, n, d)
    q = qkv.new_empty(n, heads, d)
    _lib().rope_write_rows(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                           q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), n, heads,
                           kv_heads, d)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` where ``gate_up`` is ``[n, 2 inter]`` (gate, then up)."""
    if gate_up.dtype != torch.float32 or gate_up.dim() != 2 or not gate_up.is_contiguous() \
            or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be contiguous float32 [n, 2 * inter], got "
                         f"{tuple(gate_up.shape)} {gate_up.dtype}")
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(n, inter)
    _lib().silu_mul_rows(gate_up.data_ptr(), out.data_ptr(), n, inter, torch.get_num_threads())
    return out



class _LayerArgs(ctypes.Structure):
    """``struct decode_layer_args`` of ``csrc/decode_layer.c``: one layer's arrays."""

    _fields_ = [(name, _P) for name in ("w_qkv", "w_o", "w_gate_up", "w_down", "norm2",
                                        "next_norm", "k_cache", "v_cache")] + [
        ("eps2", _F), ("eps_next", _F)]


class DecodeLayers:
    """A model's decoder layers as :func:`decode_layers` reads them, checked and laid out
    once (kept by the model until a weight or a norm changes). ``layers`` holds, per
    layer, its stacked :class:`~paged_lib.kernels.cpu_linear.LinearWeights` (QKV, o,
    gate-up, down) and its two norms (the post-attention one and the next layer's input
    norm, or the model's final one: modules with ``weight`` and ``eps``). ``runs`` is
    False where a map is not packed for the C kernel (the caller then runs each layer's
    steps); maps or norms that do not fit the shapes raise ``ValueError``."""

    def __init__(self, layers: list, hidden: int, heads: int, kv_heads: int):
        self.layers, self.hidden, self.heads, self.kv_heads = layers, hidden, heads, kv_heads
        self.runs = bool(layers) and all(m.tiles is not None for maps, _ in layers
                                         for m in maps)
        if not self.runs:
            return
        qkv = layers[0][0][0].plain.shape[0]
        self.head_dim = d = qkv // (heads + 2 * kv_heads)
        self.inter = inter = layers[0][0][3].plain.shape[1]
        shapes = (((heads + 2 * kv_heads) * d, hidden), (hidden, heads * d),
                  (2 * inter, hidden), (hidden, inter))
        for i, (maps, norms) in enumerate(layers):
            got = tuple(tuple(m.plain.shape) for m in maps)
            if got != shapes:
                raise ValueError(f"decode_layers: layer {i}'s maps {list(got)} do not fit "
                                 f"hidden={hidden}, {heads} heads and {kv_heads} KV heads")
            for norm in norms:
                _check_weight(norm.weight, hidden)
        # the caches' addresses are filled in at each call, from the caches it is given
        self.args = (_LayerArgs * len(layers))(*(_LayerArgs(
            *(m.tiles.data_ptr() for m in maps), norm2.weight.data_ptr(),
            next_norm.weight.data_ptr(), 0, 0, norm2.eps, next_norm.eps)
            for maps, (norm2, next_norm) in layers))


#: each model's last plan (:func:`decode_plan`), outside the model so that a copy or a
#: pickle of it never carries one
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: How many parameters and submodules any module in this process has registered (PyTorch's
#: global registration hooks count them): a weight replaced by another or a layer swapped
#: for another moves it, so a plan can tell it is stale without walking the model's modules
#: every step (on a 2-core AMD EPYC, 2026-12-07, the walk took 0.34 ms of a 10.4 ms SmolLM2
#: step at batch 8, this check 0.13).
_registrations = [0]


def _count_registration(module, name, value) -> None:
    _registrations[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
torch.nn.modules.module.register_module_module_registration_hook(_count_registration)


def _parameters(module, out: list) -> list:
    """Every parameter under ``module``, by a walk of the modules' own dictionaries (a few
    times faster than ``module.parameters()``, which also removes duplicates)."""
    out.extend(p for p in module._parameters.values() if p is not None)
    for child in module._modules.values():
        if child is not None:
            _parameters(child, out)
    return out


def _contents(params: tuple[list, list]) -> tuple[list, list]:
    """Where each parameter's values are, and how often they were changed in place: for
    ``params`` as (those with a version, inference tensors, which have none)."""
    versioned, inference = params
    return [(p.data_ptr(), p._version) for p in versioned], [p.data_ptr() for p in inference]


def decode_plan(model, norms: list) -> DecodeLayers:
    """A :class:`~paged_lib.model.TinyLlama`'s layers as :func:`decode_layers` reads them,
    with ``norms`` (each layer's next norm: the next layer's input norm, the model's final
    one last): the last step's plan unless a parameter or submodule was registered anywhere
    since (a weight replaced, a layer swapped: :data:`_registrations`), a parameter's
    values were changed in place or moved, or a norm's eps changed. A weight deleted or set
    to ``None`` goes past PyTorch's hooks and is not seen."""
    last = _PLANS.get(model)
    if last is not None:
        registrations, params, contents, eps, plan = last
        if (registrations == _registrations[0] and eps == [n.eps for n in norms]
                and contents == _contents(params)):
            return plan
    registrations, every = _registrations[0], _parameters(model, [])
    params = ([p for p in every if not p.is_inference()], [p for p in every if p.is_inference()])
    cfg = model.config
    plan = DecodeLayers([((*layer.self_attn.maps(), *layer.mlp.maps()),
                          (layer.post_attention_layernorm, next_norm))
                         for layer, next_norm in zip(model.layers, norms, strict=True)],
                        cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads)
    _PLANS[model] = registrations, params, _contents(params), [n.eps for n in norms], plan
    return plan


def decode_layers(x: torch.Tensor, normed: torch.Tensor, plan: DecodeLayers, kv_caches,
                  cos: torch.Tensor, sin: torch.Tensor, meta
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A decode step's decoder layers (``plan``, with ``kv_caches``: a ``(k_cache,
    v_cache)`` per layer) in one C call on PyTorch's thread team (``csrc/decode_layer.c``):
    the same steps as each layer's :meth:`~paged_lib.model.DecoderLayer.forward_fused`,
    with the same bits, without a return to Python between them. ``x`` and ``normed`` (the
    first layer's input norm) are updated in place and returned: the residual stream after
    the last layer and its final norm.

    Returns ``None`` where the step is not one it runs (the caller then takes the steps one
    by one): a step with a prefill, caches that :func:`fits` refuses, or a plan that does
    not run. The caller vouches for ``meta`` (checked once a step by the runner)."""
    rows, hidden = x.shape
    if (not plan.runs or not meta.is_decode or len(kv_caches) != len(plan.layers)
            or not all(fits(*kv) for kv in kv_caches)):
        return None
    d, heads, kv_heads = plan.head_dim, plan.heads, plan.kv_heads
    block_size = kv_caches[0][0].shape[1]
    if any(c.shape[1:] != (block_size, kv_heads, d) for kv in kv_caches for c in kv):
        raise ValueError(f"decode_layers: caches must be [blocks, block_size, {kv_heads}, "
                         f"{d}] with one block size, got "
                         f"{sorted({tuple(c.shape) for kv in kv_caches for c in kv})}")
    if hidden != plan.hidden or normed.shape != x.shape or not normed.is_contiguous():
        raise ValueError(f"x and normed must be contiguous [rows, {plan.hidden}], got "
                         f"{tuple(x.shape)} and {tuple(normed.shape)}")
    slots = meta.slot_mapping
    _check_step_rows(cos, sin, slots, rows, d)
    args = type(plan.args).from_buffer_copy(plan.args)  # this call's own: a plan is shared
    for layer, (k_cache, v_cache) in zip(args, kv_caches, strict=True):
        layer.k_cache, layer.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
    tables, lens, _ = cpu_decode._step_metadata(meta.block_tables, meta.seq_lens)
    lib, threads = _lib(), torch.get_num_threads()
    scratch = torch.empty(lib.decode_layer_scratch(rows, hidden, heads, kv_heads, d,
                                                   plan.inter))
    lib.decode_layers(len(plan.layers), args, x.data_ptr(), normed.data_ptr(),
                      scratch.data_ptr(), rows, hidden, heads, kv_heads, d, plan.inter,
                      cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                      lens.data_ptr(), tables.shape[1], block_size, d ** -0.5,
                      cpu_decode.kv_heads_per_item(rows, kv_heads, threads), threads)
    return x, normed
