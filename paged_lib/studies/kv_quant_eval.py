"""Measuring quantised KV blocks (chapter 11): what 8 bits cost in accuracy and save in bytes.

* :func:`attention_error` - attention over a quantised paged cache against the same
  attention over an fp32 cache (random K/V: :func:`random_qkv`; the shipped model's own
  queries, keys and values: :func:`model_qkv`);
* :func:`teacher_forced` - the model over held-out text (:func:`held_out_windows`) with
  quantised caches, token by token like decode: next-token agreement with ``"auto"`` and
  bits per byte;
* :func:`kv_bytes_per_token_quant` - bytes per token, scales included;
* :func:`greedy_agreement` - greedy tokens of the engine with and without quantised blocks;
* :func:`outlier_stats`, :func:`axis_quant_error` and :func:`kivi_attention_error` - why
  KIVI (arXiv:2402.02750) quantises keys per channel and values per token: the spread of
  per-channel and per-token magnitudes, the error of each grouping at 8, 4 and 2 bits, and
  the attention output's error for each choice.

Everything returns plain dataclasses or dicts of floats and lists, for printing and plots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_lib.accounting import ModelSpec, kv_bytes_per_token
from paged_lib.data.held_out import held_out_files
from paged_lib.engine.model_runner import allocate_kv_caches, build_metadata, check_metadata
from paged_lib.kernels import paged_prefill, reshape_and_cache
from paged_lib.kernels.cpu_linear import linear, stacked_weights
from paged_lib.kernels.kv_quant import (
    allocate_quantized_kv_caches,
    check_kv_cache_dtype,
    dequantize_blocks,
    is_quantized,
)
from paged_lib.model import TinyLlama, apply_rope
from paged_lib.tokenizer import BOS_ID

# ---------------------------------------------------------------- (a) attention error


@dataclass
class AttentionError:
    """Attention output over a quantised cache vs over fp32: ``max_abs`` and ``rel`` (the
    Frobenius norm of the difference over that of the fp32 output), and the caches' own
    relative errors ``k_rel`` and ``v_rel``."""

    kv_cache_dtype: str
    backend: str
    max_abs: float
    rel: float
    k_rel: float
    v_rel: float


def random_qkv(num_tokens: int, num_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 32,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standard normal ``q [n, heads, d]``, ``k, v [n, kv_heads, d]`` (fp32, seeded)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, num_heads, head_dim, generator=g),
            torch.randn(num_tokens, num_kv_heads, head_dim, generator=g),
            torch.randn(num_tokens, num_kv_heads, head_dim, generator=g))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _paged(k: torch.Tensor, v: torch.Tensor, kv_cache_dtype: str, block_size: int,
           write_chunk: int, seed: int):
    """k, v written into a paged cache of that dtype, ``write_chunk`` tokens per write, in
    shuffled physical blocks; returns ``(k_cache, v_cache, block_table [1, nb])``."""
    n = k.shape[0]
    nb = -(-n // block_size)
    shape = (nb + 1, block_size, *k.shape[1:])
    if kv_cache_dtype == "auto":
        kc, vc = (torch.full(shape, float("nan"), device=k.device) for _ in range(2))
    else:
        (kc, vc), = allocate_quantized_kv_caches(kv_cache_dtype, 1, shape, k.device)
    perm = torch.randperm(nb + 1, generator=torch.Generator().manual_seed(seed))[:nb]
    table = perm.to(torch.int32)[None, :]
    slots = (table[0].long()[torch.arange(n) // block_size] * block_size
             + torch.arange(n) % block_size)
    for s in range(0, n, write_chunk):
        reshape_and_cache(k[s:s + write_chunk], v[s:s + write_chunk], kc, vc,
                          slots[s:s + write_chunk], backend="torch")
    return kc, vc, table


def attention_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache_dtype: str,
                    backend: str = "torch", block_size: int = 16, write_chunk: int = 1,
                    seed: int = 0) -> AttentionError:
    """Causal attention of every query of one sequence (``q [n, heads, d]``, ``k, v
    [n, kv_heads, d]``, fp32) over a ``kv_cache_dtype`` paged cache, against fp32.

    K/V are written ``write_chunk`` tokens at a time (1: as decode writes them, so int8
    block scales grow token by token; ``block_size``: whole blocks, as a prefill does).
    """
    check_kv_cache_dtype(kv_cache_dtype)
    n = q.shape[0]
    lens = torch.tensor([n], dtype=torch.int32)
    kf, vf, table = _paged(k, v, "auto", block_size, n, seed)
    ref = paged_prefill(q, kf, vf, table, lens, lens, backend="torch")
    kq, vq, table = _paged(k, v, kv_cache_dtype, block_size, write_chunk, seed)
    out = paged_prefill(q, kq, vq, table, lens, lens, backend=backend)
    k_back, v_back = _read_back(kq, table, n), _read_back(vq, table, n)
    return AttentionError(kv_cache_dtype, backend, float((out - ref).abs().max()),
                          _rel(out, ref), _rel(k_back, k), _rel(v_back, v))


def _read_back(cache, table: torch.Tensor, n: int) -> torch.Tensor:
    blocks = table[0].long()
    data = dequantize_blocks(cache, blocks) if is_quantized(cache) else cache[blocks]
    return data.reshape(-1, *data.shape[2:])[:n]


@torch.no_grad()
def model_qkv(model: TinyLlama, token_ids: list[int]
              ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The model's own ``(q, k, v)`` per layer for one text (after RoPE, fp32), as its
    attention layers compute them in a plain fp32 run."""
    captured = []

    def grab(module, args):  # the layer's own stacked map, as its forward takes it
        x, cos, sin = args[:3]
        cfg, n = module.cfg, x.shape[0]
        w = stacked_weights(module, "qkv", [module.q_proj.weight, module.k_proj.weight,
                                            module.v_proj.weight])
        q, k, v = w.split(linear(x, w))
        q = apply_rope(q.reshape(n, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.reshape(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        captured.append((q.float(), k.float(),
                         v.reshape(n, cfg.num_kv_heads, cfg.head_dim).float()))

    hooks = [layer.self_attn.register_forward_pre_hook(grab) for layer in model.layers]
    try:
        _run_chunks(model, [list(token_ids)], "auto", "torch", 16, len(token_ids))
    finally:
        for h in hooks:
            h.remove()
    return captured


# ---------------------------------------------------------------- (b) the model, end to end


@torch.no_grad()
def _run_chunks(model: TinyLlama, texts: list[list[int]], kv_cache_dtype: str, backend: str,
                block_size: int, chunk: int) -> torch.Tensor:
    """Logits ``[num_texts, n, vocab]`` of every position of equally long texts, fed
    ``chunk`` tokens per step through paged caches of ``kv_cache_dtype``."""
    n = len(texts[0])
    if any(len(t) != n for t in texts):
        raise ValueError("all texts must have the same length")
    nb = -(-n // block_size)
    caches = allocate_kv_caches(model, nb * len(texts), block_size, model.device,
                                kv_cache_dtype)
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(len(texts))]
    ids = torch.tensor(texts, dtype=torch.int64, device=model.device)
    logits = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        meta = build_metadata(tables, [end] * len(texts), [end - start] * len(texts),
                              block_size)
        check_metadata(meta, nb * len(texts), block_size)
        hidden = model(ids[:, start:end].reshape(-1), caches, meta, backend=backend,
                       validate=False)
        logits.append(model.compute_logits(hidden).view(len(texts), end - start, -1))
    return torch.cat(logits, 1)


def held_out_windows(num_windows: int = 4, window: int = 256) -> list[list[int]]:
    """BOS + the first ``window - 1`` bytes of the first ``num_windows`` held-out files of
    the shipped model's training (Python's standard library, split by
    :func:`paged_lib.data.held_out.is_held_out`): text the model never saw."""
    out = []
    for data in held_out_files():
        if len(data) >= window:
            out.append([BOS_ID, *data[:window - 1]])
            if len(out) == num_windows:
                return out
    raise ValueError(f"only {len(out)} held-out files hold {window} bytes")


@dataclass
class TeacherForced:
    """The model over ``num_tokens`` predictions with ``kv_cache_dtype`` caches:
    ``agreement`` is the share whose argmax equals ``"auto"``'s, ``bits_per_byte`` the
    mean -log2 p(next byte) (``auto_bits_per_byte``: the same with ``"auto"``),
    ``max_logit_error`` the largest logit difference from ``"auto"``."""

    kv_cache_dtype: str
    backend: str
    num_tokens: int
    agreement: float
    bits_per_byte: float
    auto_bits_per_byte: float
    max_logit_error: float


@torch.no_grad()
def teacher_forced(model: TinyLlama, texts: list[list[int]],
                   kv_cache_dtypes: tuple[str, ...] = ("int8", "fp8_e4m3"),
                   backend: str = "torch", block_size: int = 16, chunk: int = 1
                   ) -> list[TeacherForced]:
    """Feed ``texts`` (equally long token lists) through the model with paged caches of
    each dtype, ``chunk`` tokens per step (1: every token written and read back as decode
    does), and compare every next-token prediction with one ``"auto"`` run of the same
    steps. One :class:`TeacherForced` per dtype, in order."""
    for dt in kv_cache_dtypes:
        check_kv_cache_dtype(dt)
    ref = _run_chunks(model, texts, "auto", backend, block_size, chunk)
    targets = torch.tensor(texts, dtype=torch.int64)[:, 1:]

    def bpb(logits: torch.Tensor) -> float:
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, targets[..., None])
        return float(-lp.mean() / torch.log(torch.tensor(2.0)))

    results = []
    for dt in kv_cache_dtypes:
        got = ref if dt == "auto" else _run_chunks(model, texts, dt, backend, block_size, chunk)
        agree = (got[:, :-1].argmax(-1) == ref[:, :-1].argmax(-1)).float().mean()
        results.append(TeacherForced(dt, backend, targets.numel(), float(agree), bpb(got),
                                     bpb(ref), float((got - ref).abs().max())))
    return results


@dataclass
class GreedyAgreement:
    """Greedy generation through :class:`~paged_lib.engine.LLMEngine` with
    ``kv_cache_dtype`` vs ``"auto"``: ``agreement`` is the share of generated positions
    holding the same token, ``first_divergence`` per prompt the index of the first token
    that differs (``max_tokens`` if none does)."""

    kv_cache_dtype: str
    backend: str
    agreement: float
    first_divergence: list[int]


def greedy_agreement(model: TinyLlama, prompts: list[list[int]], kv_cache_dtype: str,
                     max_tokens: int = 16, backend: str = "torch", num_blocks: int = 64,
                     block_size: int = 16, auto_outputs: list[list[int]] | None = None
                     ) -> GreedyAgreement:
    """Serve ``prompts`` greedily (``ignore_eos``) with and without quantised blocks.
    ``auto_outputs``: the ``"auto"`` run's tokens, if already known."""
    from paged_lib.engine import LLMEngine, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)

    def run(dt: str) -> list[list[int]]:
        engine = LLMEngine(model, num_blocks, block_size, attention_backend=backend,
                           kv_cache_dtype=dt)
        return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]

    ref = auto_outputs if auto_outputs is not None else run("auto")
    got = run(kv_cache_dtype)
    same = [[a == b for a, b in zip(g, r, strict=True)] for g, r in zip(got, ref, strict=True)]
    first = [s.index(False) if False in s else max_tokens for s in same]
    return GreedyAgreement(kv_cache_dtype, backend, sum(map(sum, same)) / sum(map(len, same)),
                           first)


# ---------------------------------------------------------------- (c) bytes


@dataclass
class KVBytes:
    """Bytes per token of K and V over all layers: 8-bit data plus the scales' share
    (int8: one fp32 per block, KV head, K and V, shared by ``block_size`` tokens; fp8:
    two fp32 per layer for the whole cache, counted as 0 per token), and the saving
    against ``"auto"`` (the spec's ``dtype_bytes``)."""

    kv_cache_dtype: str
    data_bytes: float
    scale_bytes: float
    bytes_per_token: float
    auto_bytes: int
    saving: float


def kv_bytes_per_token_quant(spec: ModelSpec, kv_cache_dtype: str,
                             block_size: int = 16) -> KVBytes:
    """:func:`paged_lib.accounting.kv_bytes_per_token` for a quantised cache."""
    check_kv_cache_dtype(kv_cache_dtype)
    auto = kv_bytes_per_token(spec)
    if kv_cache_dtype == "auto":
        return KVBytes("auto", float(auto), 0.0, float(auto), auto, 0.0)
    data = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 1
    scales = (2 * spec.num_layers * spec.num_kv_heads * 4 / block_size
              if kv_cache_dtype == "int8" else 0.0)
    total = data + scales
    return KVBytes(kv_cache_dtype, float(data), scales, total, auto, 1 - total / auto)


# ---------------------------------------------------------------- (d) KIVI's observation


def outlier_stats(x: torch.Tensor) -> dict:
    """How uneven ``x [tokens, kv_heads, head_dim]`` is along each axis: per-channel
    absmax (over tokens) and per-token absmax (over channels), each head apart.
    ``channel_spread`` / ``token_spread``: largest over median of those maxima, averaged
    over heads (1: flat; large: a few outliers set the scale of a shared group)."""
    x = x.float()
    per_channel = x.abs().amax(0)              # [heads, dim]
    per_token = x.abs().amax(-1)               # [tokens, heads]
    ch = per_channel.amax(-1) / per_channel.median(-1).values
    tok = per_token.amax(0) / per_token.median(0).values
    return {"channel_spread": float(ch.mean()), "token_spread": float(tok.mean()),
            "per_channel_absmax": per_channel.tolist(),
            "per_token_absmax": per_token.tolist()}


def fake_quantize(x: torch.Tensor, bits: int, axis: str, group_size: int = 16) -> torch.Tensor:
    """``x [tokens, kv_heads, head_dim]`` quantised and dequantised, asymmetric (min-max
    with a zero point, as KIVI does), ``2**bits`` levels per group.

    ``axis="token"``: a group is one token's channels in one head (one scale per token);
    ``axis="channel"``: a group is one channel over ``group_size`` consecutive tokens
    (one scale per channel per group, e.g. per block of 16 tokens).
    """
    if axis not in ("token", "channel"):
        raise ValueError(f"axis must be 'token' or 'channel', got {axis!r}")
    if not isinstance(bits, int) or not 1 <= bits <= 16:
        raise ValueError(f"bits must be an int in 1..16, got {bits!r}")
    x = x.float()
    if axis == "token":
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    else:
        n = x.shape[0]
        pad = -n % group_size
        xp = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])]) if pad else x
        g = xp.view(-1, group_size, *x.shape[1:])
        lo = g.amin(1, keepdim=True).expand_as(g).reshape(xp.shape)[:n]
        hi = g.amax(1, keepdim=True).expand_as(g).reshape(xp.shape)[:n]
    scale = ((hi - lo) / (2 ** bits - 1)).clamp(min=1e-30)
    return ((x - lo) / scale).round() * scale + lo


def axis_quant_error(k: torch.Tensor, v: torch.Tensor, bits_list: tuple[int, ...] = (8, 4, 2),
                     group_size: int = 16) -> dict:
    """Relative error (Frobenius) of per-token and per-channel quantisation of ``k`` and
    ``v``: ``{bits: {"k": {"per_token": e, "per_channel": e}, "v": {...}}}``."""
    return {b: {name: {f"per_{axis}": _rel(fake_quantize(x, b, axis, group_size), x.float())
                       for axis in ("token", "channel")}
                for name, x in (("k", k), ("v", v))}
            for b in bits_list}


def kivi_attention_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bits: int = 2,
                         group_size: int = 16) -> dict:
    """Causal attention output error (relative, against unquantised K/V) when K and V are
    each quantised per token or per channel (:func:`fake_quantize`):
    ``{"k_per_channel_v_per_token": e, ...}`` for the four choices (KIVI's is the first)."""
    def attend(kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), is_causal=True,
            enable_gqa=q.shape[1] != k.shape[1])

    ref = attend(k.float(), v.float())
    out = {}
    for ka in ("channel", "token"):
        for va in ("token", "channel"):
            got = attend(fake_quantize(k, bits, ka, group_size),
                         fake_quantize(v, bits, va, group_size))
            out[f"k_per_{ka}_v_per_{va}"] = _rel(got, ref)
    return out
