"""Generated inputs for 04.1 (merge two softmax states) and 04.2 (attention through a
block table); 05.6 and 05.7 are in :mod:`~paged_lib.course.grading.generated.small_around`.

The fixed cases are float64 states whose fully masked rows are all on one side, a scale
of ``1 / sqrt(head_dim)`` and one ``-1`` after a table's last block. Here: masked rows in
any position beside real ones, float32, ties, scores from tiny to extreme (around +1000
and -800), scales of Gemma 2 and MLA, GQA groups of 1 to 7, block sizes that are not
powers of two, tables padded with several ``-1``; each compared with the library's answer
through :mod:`~paged_lib.course.grading.generated.numeric` (shrunk, told in one line).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from paged_lib import attention as A
from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.generated.numeric import Contrast, fewer, shorter
from paged_lib.kernels.reference import ref_paged_attention
from paged_lib.util import cdiv

__all__ = ["Merge", "Paged", "merge_cases", "merge_stage", "paged_cases", "paged_stage", "rng"]

_DT = {"fp32": torch.float32, "fp64": torch.float64}


def rng(seed: int) -> Callable[[list | tuple], Any]:
    g = torch.Generator().manual_seed(seed)
    return lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]


# ------------------------------------------------------------------ 04.1 merge_states

#: a row's two blocks: both hold keys, a (or b) fully masked, both fully masked
_ROW = {"real": "both real", "a": "a masked", "b": "b masked", "none": "both masked"}


@dataclass(frozen=True)
class Merge:
    """One generated case of 04.1: ``rows`` (one kind per head, batch shape ``(len,)`` or
    ``(2, len // 2)``) merged from blocks of ``n_a`` and ``n_b`` scores."""

    seed: int
    rows: tuple[str, ...]
    two_dims: bool
    n_a: int
    n_b: int
    d: int
    loud: float
    offset: float
    ties: bool
    dtype: str

    def build(self) -> tuple[tuple, tuple]:
        g = torch.Generator().manual_seed(4100 + self.seed)
        r, n = len(self.rows), self.n_a + self.n_b
        s = torch.randn(r, n, generator=g, dtype=torch.float64) * self.loud + self.offset
        if self.ties:  # both blocks' maxima equal
            s[:, self.n_a + int(s[0, self.n_a:].argmax())] = s[:, :self.n_a].amax(1)
        for i, kind in enumerate(self.rows):
            if kind in ("a", "none"):
                s[i, :self.n_a] = -math.inf
            if kind in ("b", "none"):
                s[i, self.n_a:] = -math.inf
        v = torch.randn(r, n, self.d, generator=g, dtype=torch.float64)
        shape = (2, r // 2) if self.two_dims else (r,)
        s, v = s.reshape(*shape, n).to(_DT[self.dtype]), v.reshape(*shape, n, self.d)
        v = v.to(_DT[self.dtype])
        return (tuple(A.block_state(s[..., :self.n_a], v[..., :self.n_a, :])),
                tuple(A.block_state(s[..., self.n_a:], v[..., self.n_a:, :])))

    def describe(self) -> str:
        shape = (2, len(self.rows) // 2) if self.two_dims else (len(self.rows),)
        return (f"batch shape {shape}, rows [{', '.join(_ROW[k] for k in self.rows)}], "
                f"blocks of {self.n_a} and {self.n_b} scores, d {self.d}, scores x "
                f"{self.loud:g}" + (f" + {self.offset:g}" if self.offset else "")
                + (", both blocks' maxima tied" if self.ties else "")
                + f", {'float32' if self.dtype == 'fp32' else 'float64'}")

    def states(self) -> list[str]:
        kinds = set(self.rows)
        out = ["b masked, a real"] if "b" in kinds else []
        out += ["masked and real rows together"] if "none" in kinds and len(kinds) > 1 else []
        out += ["float32"] if self.dtype == "fp32" else []
        out += ["tied maxima"] if self.ties else []
        out += ["tiny scores"] if self.loud < 0.01 else []
        return out

    def smaller(self) -> Iterator[Merge]:
        if self.two_dims:
            yield dataclasses.replace(self, two_dims=False)
        if len(self.rows) > 1 and not self.two_dims:
            for i in range(len(self.rows)):
                yield dataclasses.replace(self, rows=self.rows[:i] + self.rows[i + 1:])
        yield from fewer(self, n_a=shorter(self.n_a), n_b=shorter(self.n_b), d=shorter(self.d),
                         loud=[1.0] if self.loud != 1.0 else [], offset=[0.0], ties=[False],
                         dtype=["fp64"])


def _draw_merge(seed: int) -> Merge:
    pick = rng(4101 + seed)
    r = pick([1, 2, 3, 4, 6])
    rows = tuple(pick(["real", "real", "a", "b", "none"]) for _ in range(r))
    loud, offset = pick([(1e-3, 0.0), (3.0, 0.0), (3.0, 1000.0), (300.0, 0.0), (3.0, -800.0)])
    return Merge(seed, rows, r % 2 == 0 and pick([False, True]), pick([1, 3, 5, 8]),
                 pick([1, 2, 7]), pick([1, 3, 4, 16]), loud, offset, pick([False, True]),
                 pick(["fp64", "fp64", "fp32"]))


def merge_cases(count: int = 40) -> list[Merge]:
    return [_draw_merge(seed) for seed in range(count)]


_MERGE_HINT = ("m = max(m_a, m_b) element by element; each side's weight is exp(m_side - m) "
               "with 0 in place of m where it is -inf, chosen per element (torch.where), so "
               "one row's fully masked blocks give m=-inf, l=0, acc=0 beside rows that merge "
               "normally")


def run_merge(merge_states: Callable, p: Merge) -> None:
    a, b = p.build()
    want = tuple(A.merge(A.SoftmaxState(*a), A.SoftmaxState(*b)))
    got = merge_states(tuple(t.clone() for t in a), tuple(t.clone() for t in b))
    grading.expect_true(isinstance(got, tuple | list) and len(got) == 3,
                        f"expected a tuple (m, l, acc), got {type(got).__name__}",
                        hint="return m, l, acc")
    tol = 1e-9 if p.dtype == "fp64" else 1e-5
    for name, g, e in zip(("m", "l", "acc"), got, want, strict=True):
        if isinstance(g, torch.Tensor) and g.shape == e.shape and (g.isnan() & ~e.isnan()).any():
            bad = g.isnan() & ~e.isnan()
            row = int((bad.any(-1) if name == "acc" else bad).reshape(-1).nonzero()[0, 0])
            grading.fail(f"{name} contains NaN (row {row} of the flattened batch: "
                         f"{_ROW[p.rows[row]]})", _MERGE_HINT)
        grading.expect_tensor_close(g, e, name, atol=tol, rtol=tol, hint=_MERGE_HINT)


MERGE_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, rows=tuple("real" for _ in p.rows))
             if set(p.rows) != {"real"} else None,
             "it passes when every row holds keys: a fully masked block (m = -inf) must work "
             "in any row and on either side, next to rows that merge normally; decide per "
             "element with torch.where, not with one if over the whole tensor"),
    Contrast(lambda p: dataclasses.replace(p, offset=0.0, loud=min(p.loud, 3.0))
             if p.offset or p.loud > 3 else None,
             "it passes with scores a few units from 0 and fails far from 0 (exp(1000) is "
             "inf): never compute exp(m) or exp of a score, only exp of differences like "
             "m_a - m"),
    Contrast(lambda p: dataclasses.replace(p, dtype="fp64") if p.dtype == "fp32" else None,
             "it passes in float64 and fails in float32: compute in the states' own dtype "
             "(no float64 or default-dtype constants mixed in)"),
)


def merge_stage(merge_states: Callable) -> None:
    """04.1's generated stage."""
    numeric.check("04.1", merge_cases(), lambda p: run_merge(merge_states, p), MERGE_CONTRASTS)


# ------------------------------------------------------------------ 04.2 paged_decode

#: scale -> (the head size it is taken over, as a multiple of head_dim; who has it)
_SCALES = {"head": (1.0, "1 / sqrt(head_dim)"),
           "gemma": (1.125, "1 / sqrt(1.125 x head_dim), as Gemma 2 27B's "
                     "query_pre_attn_scalar"),
           "mla": (1.5, "1 / sqrt(1.5 x head_dim), as MLA's q . k over 192 numbers "
                   "with V of 128 (DeepSeek-V2)")}
#: (query heads, KV heads, head size) scaled down from real models: Llama 3 (groups of
#: 4), Qwen2 7B (7), Falcon (MQA), Phi-3 (head 96), Gemma (head 256)
_MODELS = [(8, 2, 12), (7, 1, 8), (4, 1, 20), (3, 3, 24), (6, 3, 5), (14, 2, 6)]


@dataclass(frozen=True)
class Paged:
    """One generated case of 04.2."""

    seed: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    seq_len: int
    pad: int
    scale: str
    loud: float

    def build(self) -> tuple:
        g = torch.Generator().manual_seed(4200 + self.seed)
        bs, n, used = self.block_size, self.seq_len, cdiv(self.seq_len, self.block_size)
        blocks = used + 3
        table = torch.randperm(blocks, generator=g)[:used].tolist()
        k = torch.randn(blocks, bs, self.kv_heads, self.head_dim, generator=g,
                        dtype=torch.float64)
        v = torch.randn(blocks, bs, self.kv_heads, self.head_dim, generator=g,
                        dtype=torch.float64)
        written = torch.zeros(blocks, bs, dtype=torch.bool)
        for t in range(n):
            written[table[t // bs], t % bs] = True
        k[~written], v[~written] = math.nan, math.nan
        q = torch.randn(self.heads, self.head_dim, generator=g, dtype=torch.float64) * self.loud
        scale = (_SCALES[self.scale][0] * self.head_dim) ** -0.5
        ref = ref_paged_attention(q[None], k, v, torch.tensor([table], dtype=torch.int32),
                                  torch.tensor([n], dtype=torch.int32), scale)[0]
        return q, k, v, table + [-1] * self.pad, n, scale, ref

    def describe(self) -> str:
        return (f"seq_len {self.seq_len}, blocks of {self.block_size}, block_table ending in "
                f"{self.pad} x -1, {self.heads} query heads on {self.kv_heads} KV heads, "
                f"head_dim {self.head_dim}, scale {_SCALES[self.scale][1]}, q x {self.loud:g}")

    def states(self) -> list[str]:
        out = ["a scale that is not 1 / sqrt(head_dim)"] if self.scale != "head" else []
        out += [f"{self.pad} padding entries"] if self.pad > 1 else []
        out += [f"GQA groups of {self.heads // self.kv_heads}"] \
            if self.heads // self.kv_heads in (3, 7) else []
        out += [f"block size {self.block_size}"] if self.block_size in (3, 5, 6) else []
        return out

    def smaller(self) -> Iterator[Paged]:
        yield from fewer(self, seq_len=shorter(self.seq_len), pad=shorter(self.pad))
        if self.kv_heads > 1:
            yield dataclasses.replace(self, heads=self.heads // self.kv_heads, kv_heads=1)
        yield from fewer(self, heads=[self.kv_heads] if self.heads > self.kv_heads else [],
                         head_dim=[x for x in (2, 4) if x < self.head_dim], loud=[1.0],
                         block_size=shorter(self.block_size))


def _draw_paged(seed: int) -> Paged:
    pick = rng(4201 + seed)
    heads, kv, d = pick(_MODELS)
    bs = pick([1, 3, 5, 6, 8])
    n = pick([1, bs, bs + 1, 2 * bs - 1, 3 * bs + 2, 13])
    return Paged(seed, heads, kv, d, bs, n, pick([1, 2, 3]),
                 ("head", "gemma", "mla")[seed % 3], pick([1e-3, 1.0, 1.0, 40.0]))


def paged_cases(count: int = 12) -> list[Paged]:
    return [_draw_paged(seed) for seed in range(count)]


def run_paged(paged_decode: Callable, run_case: Callable, p: Paged) -> None:
    """``run_case``: 04.2's per-case check (its grader's, which watches every block read)."""
    q, k, v, table, n, scale, ref = p.build()
    run_case(paged_decode, q.clone(), k, v, table, n, scale, ref, p.loud > 1)


PAGED_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, scale="head") if p.scale != "head" else None,
             "it passes with scale = 1 / sqrt(head_dim) and fails with another: use the scale "
             "argument you are given (Gemma 2 and MLA models pass other ones)"),
    Contrast(lambda p: dataclasses.replace(p, pad=1) if p.pad > 1 else None,
             "it passes with one -1 after the last block and fails with several: read the "
             "cdiv(seq_len, block_size) blocks the sequence uses, whatever follows them"),
)


def paged_stage(paged_decode: Callable, run_case: Callable) -> None:
    """04.2's generated stage."""
    numeric.check("04.2", paged_cases(), lambda p: run_paged(paged_decode, run_case, p),
          PAGED_CONTRASTS)
