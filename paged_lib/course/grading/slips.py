"""Naming a learner's mistake by the typical wrong answer it reproduces: the wrong decode
attentions recomputed in float64 (:func:`name_slip`: the one far closer to the learner's
output than the right answer is), and exact answers (:func:`name_mistake`)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch

from paged_lib.course.grading.generated.numeric import Named
from paged_lib.util import cdiv


def _attend(q, k, v, scale, block_size, *, slip: str | None):
    m, l = torch.tensor([float("-inf"), 0.0], dtype=torch.float64)  # noqa: E741
    acc = torch.zeros(v.shape[1], dtype=torch.float64)
    for start in range(0, k.shape[0], block_size):
        s = k[start:start + block_size] @ q * {"no scale": 1, "exp2": scale * LN2}.get(slip, scale)
        m_new = torch.maximum(m, s.max())
        alpha = torch.ones(()) if slip in RESCALE else torch.exp(m - m_new)
        p = torch.exp(s - (s.max() if slip == "block max" else m_new))
        p_v = p.half().double() if slip == "fp16 p" else p
        l = l * (1 if slip == "l kept" else alpha) + p.sum()  # noqa: E741
        acc = acc * (1 if slip == "acc kept" else alpha) + p_v @ v[start:start + block_size]
        m = m_new
    return acc / l


LN2 = 0.6931471805599453  # ln 2: exp2(s) is exp(s * LN2)
SLIPS = {
    "mod": "query head h uses KV head h // GROUP (GROUP = num_heads // num_kv_heads, "
           "consecutive query heads share a KV head), not h % num_kv_heads",
    "no rescale": "l and acc were not rescaled when the running max grew: multiply them by "
                  "alpha = exp(m_old - m_new) before adding the new block",
    "block max": "each block's (m, l, acc) was added as it is: when the running max grows, "
                 "rescale l and acc by alpha = exp(m_old - m_new) before adding the new block",
    "fp16 p": Named("the probabilities were rounded to float16 before multiplying V: keep "
                    "p in float32 (the rounding costs about 1e-3)"),  # no contrast explains it
    **{f"{a} kept": f"{b} was rescaled but {a} was not, when the running max grew: multiply both "
       "by alpha = exp(m_old - m_new)" for a, b in (("l", "acc"), ("acc", "l"))},
    "no scale": "the scores are q . k times scale (1 / sqrt(head_dim)); it was left out",
    "exp2": "exp2 without its factor: exp2(s) is 2**s, so exp(s) = exp2(s * log2(e)); multiply "
            "what goes into exp2 by log2(e) = 1.4427 first, or use exp",
}

RESCALE = ("no rescale", "block max")  # p counted from the running max, or the block's own


def decode_slips(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: list[list[int]], lens: list[int], scale: float
                 ) -> dict[str, torch.Tensor]:
    """slip -> output [num_seqs, num_heads, head_dim] (float64) of that wrong attention."""
    num_seqs, num_heads, _ = q.shape
    _, block_size, kv_heads, head_dim = k_cache.shape
    group = num_heads // kv_heads
    out = {name: torch.zeros(num_seqs, num_heads, v_cache.shape[-1], dtype=torch.float64)
           for name in SLIPS}
    for s in range(num_seqs):
        blocks = [int(b) for b in tables[s][:cdiv(int(lens[s]), block_size)]]
        k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:int(lens[s])].double()
        v = v_cache[blocks].reshape(-1, kv_heads, v_cache.shape[-1])[:int(lens[s])].double()
        for h in range(num_heads):
            qh = q[s, h].double()
            for name in SLIPS:
                kv = h % kv_heads if name == "mod" else h // group
                out[name][s, h] = _attend(qh, k[:, kv], v[:, kv], scale, block_size,
                                          slip=None if name == "mod" else name)
    if group == 1:
        del out["mod"]  # h % num_kv_heads is h // 1: the same
    return out


def contiguous_slips(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     tile: int) -> dict[str, torch.Tensor]:
    """Like :func:`decode_slips` over contiguous K/V (``q [batch, d]``, ``k``/``v [batch, n,
    d]``, read ``tile`` keys at a time: 05.4)."""
    return {name: torch.stack([_attend(q[b].double(), k[b].double(), v[b].double(), scale,
                                       tile, slip=name) for b in range(q.shape[0])])
            for name in SLIPS if name != "mod"}


def name_slip(got: torch.Tensor, expected: torch.Tensor, slips: dict[str, torch.Tensor],
              hints: dict[str, str] | None = None) -> str | None:
    """The hint (from ``hints``, by default :data:`SLIPS`) of the slip that explains ``got``
    far better than ``expected`` does."""
    if got.shape != expected.shape or not got.isfinite().all():
        return None
    g = got.detach().cpu().double()
    right = (g - expected.double()).abs().max().item()
    best = None
    for name, wrong in slips.items():
        err = (g - wrong).abs().max().item()
        if err < right / 8 and (best is None or err < best[0]):
            best = (err, name)
    return (hints or SLIPS)[best[1]] if best else None


def expect_attention(got: torch.Tensor, want: torch.Tensor, what: str, tol: float,
                     slips: Callable[[], dict[str, torch.Tensor]], hint: str, *,
                     loud: str | None = None, poison: str | None = None) -> None:
    """``got`` next to the right attention ``want``: with ``loud`` (its hint), scores in the
    hundreds that gave NaN or inf fail first; with ``poison``, NaN (a slot past seq_len)
    that reached the output; then a wrong output is named by the slip that explains it
    (``slips()``: :func:`decode_slips` or :func:`contiguous_slips`), else ``hint``."""
    from paged_lib.course import grading

    same = got.shape == want.shape
    if loud and same and not got.isfinite().all():
        grading.fail(f"{what}: scores in the hundreds gave NaN or inf", loud)
    nan = got.isnan() & ~want.isnan() if same else torch.zeros(())
    if poison and nan.any():
        where = [int(i) for i in nan.nonzero()[0]]
        grading.fail(f"{what}: NaN at {where}: poison (a slot past seq_len, memory the code "
                     "must not use) reached the output, or a head summed no key (l = 0)", poison)
    named = None
    if same and not torch.allclose(got.double(), want.double(), atol=tol, rtol=tol):
        named = name_slip(got, want, slips()) or rounded(got, want, what)
    grading.expect_tensor_close(got, want, what, atol=tol, rtol=tol, hint=named or hint)


def rounded(got: Any, want: torch.Tensor, what: str = "out", wrong: dict | None = None
            ) -> Named | None:
    """The hint when ``got`` is ``want`` rounded on the way (to float32 of float64, or to 16
    bits), or the key of ``wrong`` (hint -> wrong answer) that explains it (:func:`name_slip`)."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return None
    if want.dtype == torch.float64 and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6):
        return Named(f"{what} is right only to about 1e-7 (float32's precision): a value was "
                     "computed in float32 and cast back afterwards; compute in the inputs' dtype")
    wrong = {**(wrong or {}), **{f"{what} came out rounded to {name}: a value was cast to a "
             "16-bit float on the way; keep float32 from load to store": want.to(dtype).double()
             for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16))}}
    hint = name_slip(got, want, wrong, dict(zip(wrong, wrong, strict=True)))
    return Named(hint) if hint else None


def name_mistake(case: Any, got: Any, want: Any, cases: Iterable, wrong: Callable[[Any], dict],
                 call: Callable[[Any], Any], default: str,
                 same: Callable[[Any, Any], bool] = operator.eq) -> str:
    """The hint of the typical mistake (``wrong(case)``: hint -> what that mistake returns)
    that gives ``got`` on ``case`` (right: ``want``), else ``default``. Where several agree on
    ``case``, the other ``cases`` decide: the learner's answers there (``call(c)``)."""
    def agrees(a: Any, b: Any) -> bool:
        try:
            return bool(same(a, b))
        except (TypeError, ValueError):
            return False

    named = [h for h, v in wrong(case).items() if agrees(got, v) and not agrees(v, want)]
    for other in cases:
        if len(named) < 2:
            break
        try:
            mine = call(other)
        except Exception:  # noqa: BLE001 - a crash elsewhere says nothing here
            continue
        seen = wrong(other)
        named = [h for h in named if h in seen and agrees(mine, seen[h])] or named
    return named[0] if named else default
