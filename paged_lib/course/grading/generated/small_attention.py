"""Generated cases of 04.1 (merge two softmax states), 04.2 (attention through a block table),
05.6 (slot mapping), 05.7 (merge split-KV partials): each grader's only stage."""

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
from paged_lib.course.grading.slips import LN2, SLIPS, rounded
from paged_lib.kernels import slot_mapping_from_positions
from paged_lib.kernels.reference import ref_paged_attention
from paged_lib.util import cdiv

_DT = {"fp32": torch.float32, "fp64": torch.float64}
#: scale -> (the head size it is taken over, as a multiple of HEAD_DIM; what has it)
SCALES = {"head": (1.0, "1 / sqrt(HEAD_DIM)"),
          "gemma": (1.125, "1 / sqrt(1.125 x HEAD_DIM), as Gemma 2 27B's"),
          "mla": (1.5, "1 / sqrt(1.5 x HEAD_DIM), as MLA's (DeepSeek-V2)")}


def rng(seed: int) -> Callable[[list | tuple], Any]:
    g = torch.Generator().manual_seed(seed)
    return lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]


BELOW_HINT = ("it fails when every score is far below 0: start the running max at -inf, not 0 "
              "(exp(score - 0) underflows to 0, and l with it)")


def below(q: torch.Tensor, k: torch.Tensor, scale: float, level: float) -> tuple[torch.Tensor, ...]:
    """``q`` made positive, ``k`` pushed against it: every score about ``-level`` (BELOW_HINT)."""
    q = q.abs() + 1
    return q, 0.3 * k - level / (scale * float(q.sum(-1).mean()))


def poisoned_cache(g: torch.Generator, num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int, tables: list[list[int]], lens: list[int],
                   dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V caches whose slots not holding any sequence's token are NaN."""
    k, v = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g,
                        dtype=dtype) for _ in "kv")
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for table, n in zip(tables, lens, strict=True):
        for t in range(n):
            written[table[t // block_size], t % block_size] = True
    k[~written], v[~written] = math.nan, math.nan
    return k, v


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
        shape, dt = (2, r // 2) if self.two_dims else (r,), _DT[self.dtype]
        s, v = s.reshape(*shape, n).to(dt), v.reshape(*shape, n, self.d).to(dt)
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
        return numeric.reached(("b masked, a real", "b" in kinds), ("masked and real rows together",
                   "none" in kinds and len(kinds) > 1), ("float32", self.dtype == "fp32"),
                   ("tied maxima", self.ties), ("tiny scores", self.loud < 0.01))

    def smaller(self) -> Iterator[Merge]:
        if self.two_dims:
            yield dataclasses.replace(self, two_dims=False)
        if len(self.rows) > 1 and not self.two_dims:
            for i in range(len(self.rows)):
                yield dataclasses.replace(self, rows=self.rows[:i] + self.rows[i + 1:])
        yield from fewer(self, n_a=shorter(self.n_a), n_b=shorter(self.n_b), d=shorter(self.d),
                         loud=[1.0] if self.loud != 1.0 else [], offset=[0.0], ties=[False],
                         dtype=["fp64"])


def merge_cases(count: int = 40) -> list[Merge]:
    out = []
    for seed in range(count):
        pick = rng(4101 + seed)
        r = pick([1, 2, 3, 4, 6])
        rows = tuple(pick(["real", "real", "a", "b", "none"]) for _ in range(r))
        loud, offset = pick([(1e-3, 0.0), (3.0, 0.0), (3.0, 1000.0), (300.0, 0.0),
                             (3.0, -800.0)])
        out.append(Merge(seed, rows, r % 2 == 0 and pick([False, True]), pick([1, 3, 5, 8]),
                         pick([1, 2, 7]), pick([1, 3, 4, 16]), loud, offset,
                         pick([False, True]), pick(["fp64", "fp64", "fp32"])))
    return out


_MERGE_HINT = ("m = max(m_a, m_b) element by element; each side's weight is exp(m_side - m), "
               "0 in place of an m of -inf, chosen per element (torch.where)")


def _merge_slip(got: Any, a: tuple, b: tuple, tol: float) -> str | None:
    """The hint of the typical wrong merge that returns ``got`` for ``a`` and ``b``."""
    (ma, la, acca), (mb, lb, accb) = a, b
    m, lo = torch.maximum(ma, mb), torch.minimum(ma, mb)

    def w(x: torch.Tensor, top: torch.Tensor) -> torch.Tensor:  # 0 in place of an inf top
        return torch.exp(x - torch.where(torch.isinf(top), torch.zeros_like(top), top))

    wa, wb, one = w(ma, m), w(mb, m), torch.ones_like(ma)
    # (merged m, weights of l_a and l_b, weights of acc_a and acc_b, what it got wrong)
    slips = [(m, (one, one), (one, one), "no rescale: multiply each side's l and acc by "
              "exp(m_side - m) before adding"),
             (m, (wa, wb), (one, one), "l was rescaled but acc was not"),
             (m, (one, one), (wa, wb), "acc was rescaled but l was not"),
             (lo, (w(ma, lo), w(mb, lo)), (w(ma, lo), w(mb, lo)), "the common m is the larger "
              "max, max(m_a, m_b)"),
             (m, (1 / wa, 1 / wb), (1 / wa, 1 / wb), "the factor is exp(m_side - m), not "
              "exp(m - m_side)"),
             (m, (wb, wa), (wb, wa), "each side's factor goes with its own l and acc"),
             (ma, (wa, wb), (wa, wb), "the merged m is max(m_a, m_b), not m_a")]
    if not all(isinstance(t, torch.Tensor) for t in got):  # a tuple of 3: checked before
        return None
    for top, (xa, xb), (ya, yb), hint in slips:
        wrong = (top, xa * la + xb * lb, ya[..., None] * acca + yb[..., None] * accb)
        if all(g.shape == x.shape and torch.allclose(g.double(), x.double(), rtol=tol,
                                                     atol=tol, equal_nan=True)
               for g, x in zip(got, wrong, strict=True)):
            return hint
    return None


def run_merge(merge_states: Callable, p: Merge) -> None:
    a, b = p.build()
    want = tuple(A.merge(A.SoftmaxState(*a), A.SoftmaxState(*b)))
    got = merge_states(tuple(t.clone() for t in a), tuple(t.clone() for t in b))
    grading.expect_true(isinstance(got, tuple | list) and len(got) == 3,
                        f"expected a tuple (m, l, acc), got {type(got).__name__}",
                        hint="return m, l, acc")
    tol = 1e-9 if p.dtype == "fp64" else 1e-5
    hint = _merge_slip(got, a, b, tol) or _MERGE_HINT
    for name, g, e in zip(("m", "l", "acc"), got, want, strict=True):
        if isinstance(g, torch.Tensor) and g.shape == e.shape and (g.isnan() & ~e.isnan()).any():
            bad = g.isnan() & ~e.isnan()
            row = int((bad.any(-1) if name == "acc" else bad).reshape(-1).nonzero()[0, 0])
            grading.fail(f"{name} contains NaN (row {row} of the flattened batch: "
                         f"{_ROW[p.rows[row]]})", hint)
        grading.expect_tensor_close(g, e, name, tol, tol, hint=rounded(g, e, name) or hint)


MERGE_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, rows=tuple("real" for _ in p.rows))
             if set(p.rows) != {"real"} else None,
             "it passes when every row holds keys: a fully masked block (m = -inf) may be in "
             "any row, on either side; decide per element with torch.where, not with one if"),
    Contrast(lambda p: dataclasses.replace(p, offset=0.0, loud=min(p.loud, 3.0))
             if p.offset or p.loud > 3 else None,
             "it passes with scores a few units from 0 and fails far from 0 (exp(1000) is "
             "inf): take exp only of differences like m_a - m"),
    Contrast(lambda p: dataclasses.replace(p, dtype="fp64") if p.dtype == "fp32" else None,
             "it passes in float64 and fails in float32: compute in the states' own dtype "
             "(no float64 or default-dtype constants mixed in)"),
)


# ------------------------------------------------------------------ 04.2 paged_decode

#: (query heads, KV heads, head size) scaled down from real models: Llama 3 (groups of
#: 4), Qwen2 7B (7), Falcon (MQA), Phi-3 (head 96), Gemma (head 256)
_MODELS = [(8, 2, 12), (7, 1, 8), (4, 1, 20), (3, 3, 24), (6, 3, 5), (14, 2, 6)]


@dataclass(frozen=True)
class Paged:
    """One generated case of 04.2: one sequence in a cache of ``cdiv(seq_len, block_size)
    + 3`` blocks, every slot it does not use NaN."""

    seed: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    seq_len: int
    pad: int
    scale: str
    loud: float
    below: bool = False  # every score about -1000 (exp underflows in float64 below -745)

    def build(self) -> tuple:
        g = torch.Generator().manual_seed(4200 + self.seed)
        bs, n, used = self.block_size, self.seq_len, cdiv(self.seq_len, self.block_size)
        table = torch.randperm(used + 3, generator=g)[:used].tolist()
        k, v = poisoned_cache(g, used + 3, bs, self.kv_heads, self.head_dim, [table], [n])
        q = torch.randn(self.heads, self.head_dim, generator=g, dtype=torch.float64) * self.loud
        scale = (SCALES[self.scale][0] * self.head_dim) ** -0.5
        q, k = below(q, k, scale, 1e3) if self.below else (q, k)
        ref = ref_paged_attention(q[None], k, v, torch.tensor([table], dtype=torch.int32),
                                  torch.tensor([n], dtype=torch.int32), scale)[0]
        return q, k, v, table + [-1] * self.pad, n, scale, ref

    def describe(self) -> str:
        scale = SCALES[self.scale][1].replace("HEAD_DIM", "head_dim")
        return (f"seq_len {self.seq_len}, blocks of {self.block_size}, block_table ending in "
                f"{self.pad} x -1, {self.heads} query heads on {self.kv_heads} KV heads, "
                f"head_dim {self.head_dim}, scale {scale}, "
                + ("every score about -1000" if self.below else f"q x {self.loud:g}"))

    def states(self) -> list[str]:
        group = self.heads // self.kv_heads
        return numeric.reached(("a scale that is not 1 / sqrt(head_dim)", self.scale != "head"),
                   (f"{self.pad} padding entries", self.pad > 1),
                   (f"GQA groups of {group}", group in (3, 7)),
                   (f"block size {self.block_size}", self.block_size in (3, 5, 6)),
                   ("scores in the hundreds", self.loud > 100),
                   ("every score far below 0", self.below))

    def smaller(self) -> Iterator[Paged]:
        yield from fewer(self, seq_len=shorter(self.seq_len), pad=shorter(self.pad))
        if self.kv_heads > 1:
            yield dataclasses.replace(self, heads=self.heads // self.kv_heads, kv_heads=1)
        yield from fewer(self, heads=[self.kv_heads] if self.heads > self.kv_heads else [],
                         head_dim=[x for x in (2, 4) if x < self.head_dim], loud=[1.0],
                         block_size=shorter(self.block_size))


def paged_cases(count: int = 12) -> list[Paged]:
    out = []
    for seed in range(count):
        pick = rng(4201 + seed)
        heads, kv, d = pick(_MODELS)
        bs = pick([1, 3, 5, 6, 8])
        n = pick([1, bs, 2 * bs, 2 * bs - 1, 3 * bs + 2, 13])
        out.append(Paged(seed, heads, kv, d, bs, n, pick([1, 2, 3]),
                         ("head", "gemma", "mla")[seed % 3],
                         1.0 if seed % 4 == 3 else pick([1e-3, 1.0, 300.0, 40.0]), seed % 4 == 3))
    return out


PAGED_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, below=False) if p.below else None, BELOW_HINT),
    Contrast(lambda p: dataclasses.replace(p, scale="head") if p.scale != "head" else None,
             "it passes with scale = 1 / sqrt(head_dim) and fails with another: use the scale "
             "argument you are given"),
    Contrast(lambda p: dataclasses.replace(p, pad=1) if p.pad > 1 else None,
             "it passes with one -1 after the last block and fails with several: read only "
             "the cdiv(seq_len, block_size) blocks the sequence uses"),
)


# ------------------------------------------------------------------ 05.6 slot_mapping


@dataclass(frozen=True)
class Slots:
    """One generated case of 05.6: ``tokens`` new tokens of ``seqs`` sequences whose tables
    have ``width`` entries, ids drawn below ``pool`` (a pool past ``2**31 / block_size``
    blocks: their slots do not fit in 32 bits)."""

    seed: int
    block_size: int
    seqs: int
    width: int
    tokens: int
    pool: int
    pads: int

    def build(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(5600 + self.seed)
        ids = torch.randint(self.pool // 2, self.pool, (self.seqs, self.width), generator=g)
        used = torch.randint(1, self.width + 1, (self.seqs,), generator=g)
        for s in range(self.seqs):
            ids[s, int(used[s]):] = -1
        seq_ids = torch.randint(0, self.seqs, (self.tokens,), generator=g)
        pos = (torch.rand(self.tokens, generator=g) * used[seq_ids] * self.block_size).long()
        pad = torch.randperm(self.tokens, generator=g)[:self.pads]
        pos[pad] = -1
        return ids.to(torch.int32), seq_ids, pos

    def describe(self) -> str:
        bt, seq_ids, pos = self.build()
        return (f"block_size {self.block_size}, block_tables {bt.tolist()}, seq_ids "
                f"{seq_ids.tolist()}, positions {pos.tolist()}"
                + (f" (block ids up to {int(bt.max()):,}: slots past 2**31)"
                   if int(bt.max()) * self.block_size >= 2 ** 31 else ""))

    def states(self) -> list[str]:
        return numeric.reached(("slots past 2**31", self.pool * self.block_size > 2 ** 32),
                   ("padding tokens among the others", self.pads and self.tokens > 1),
                   (f"block size {self.block_size}", self.block_size not in (3, 4, 16)))

    def smaller(self) -> Iterator[Slots]:
        yield from fewer(self, tokens=shorter(self.tokens), seqs=shorter(self.seqs),
                         width=shorter(self.width), pads=shorter(self.pads, 0),
                         pool=[64] if self.pool > 64 else [],
                         block_size=shorter(self.block_size))


def slot_cases(count: int = 24) -> list[Slots]:
    picks = [rng(5601 + seed) for seed in range(count)]
    return [Slots(seed, pick([1, 3, 5, 12, 16, 32]), pick([1, 2, 3]), pick([1, 2, 4]),
                  pick([1, 4, 7]), (64, 2 ** 31 - 1)[seed % 2], pick([0, 1, 2]))
            for seed, pick in enumerate(picks)]


_SLOT_HINT = ("slot = block_tables[seq, pos // block_size] * block_size + pos % block_size "
              "(block_size not a constant); position -1 (padding) maps to -1")


def run_slots(slot_mapping: Callable, p: Slots) -> None:
    bt, seq_ids, pos = p.build()
    want = slot_mapping_from_positions(bt, seq_ids, pos, p.block_size).tolist()
    try:
        got = slot_mapping(bt.clone(), seq_ids.clone(), pos.clone(), p.block_size)
    except IndexError as err:
        grading.fail(f"your code raised IndexError: {err}", hint=_SLOT_HINT)
    grading.expect_true(isinstance(got, torch.Tensor),
                        f"expected a torch.Tensor, got {type(got).__name__}")
    grading.expect_true(got.dtype == torch.int64, f"expected dtype torch.int64, got {got.dtype}",
                        hint="slots can exceed 2**31: compute in int64 (.long())")
    wrong = {"the slot is in the token's block, not just the offset pos % block_size":
             torch.where(pos < 0, -1, pos % p.block_size).tolist(), "position 0 is a real "
             "token (its sequence's first): only -1 is padding; test positions >= 0, not > 0":
             torch.where(pos == 0, -1, torch.tensor(want)).tolist()}
    grading.expect_equal(got.tolist(), want, "slot_mapping", hint=next((numeric.Named(h) for h, w
                         in wrong.items() if got.tolist() == w != want), _SLOT_HINT))


def _block_size(c: int, hint: str) -> Contrast:
    return Contrast(lambda p: dataclasses.replace(p, block_size=c) if p.block_size != c
                    else None, f"it passes with block_size {c} and fails with others: {hint}")


SLOT_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, pool=64) if p.pool > 64 else None,
             "it passes with small block ids and fails with a pool of 2**31 - 1 blocks: "
             "block * block_size wraps in 32 bits; widen first (block_tables.long())"),
    Contrast(lambda p: dataclasses.replace(p, pads=0) if p.pads else None,
             "it passes without padding tokens: a padding token (position -1) must map to -1, "
             "not to a real slot (-1 // block_size silently indexes the table's last entry)"),
    Contrast(lambda p: dataclasses.replace(p, seqs=1) if p.seqs > 1 else None,
             "it passes with one sequence and fails with several: each token uses its own "
             "sequence's row, block_tables[seq_ids[i], ...]"),
    _block_size(1, "a block id is not a slot: multiply by block_size and add pos % block_size"),
    *(_block_size(c, f"use the block_size you are given, not a constant {c}") for c in (4, 16)),
)


# ------------------------------------------------------------------ 05.7 merge_partials


@dataclass(frozen=True)
class Partials:
    """One generated case of 05.7: segments of ``segs`` keys (0: an empty segment);
    ``spike``: the segment whose scores are raised by 800 (log-sum-exps hundreds apart)."""

    seed: int
    segs: tuple[int, ...]
    d: int
    loud: float
    shift: float
    spike: int | None

    def build(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(5700 + self.seed)
        outs, lses = [], []
        for j, n in enumerate(self.segs):
            s = torch.randn(n, generator=g, dtype=torch.float64) * self.loud + self.shift
            s = s + (800.0 if j == self.spike else 0.0)
            v = torch.randn(n, self.d, generator=g, dtype=torch.float64)
            outs.append(torch.softmax(s, 0) @ v if n else torch.zeros(self.d,
                                                                      dtype=torch.float64))
            lses.append(torch.logsumexp(s, 0).item() if n else -math.inf)
        return torch.stack(outs), torch.tensor(lses, dtype=torch.float64)

    def describe(self) -> str:
        _, lse = self.build()
        where = [j for j, n in enumerate(self.segs) if n == 0]
        return (f"segments of {list(self.segs)} keys" + (f" (empty: {where})" if where else "")
                + f", head_dim {self.d}, log-sum-exps {[round(x, 3) for x in lse.tolist()]}")

    def states(self) -> list[str]:
        return numeric.reached(("an empty segment first", self.segs[0] == 0),
                   ("several empty segments", self.segs.count(0) > 1),
                   ("log-sum-exps hundreds apart", self.spike is not None),
                   ("tiny scores", self.loud < 0.01))

    def smaller(self) -> Iterator[Partials]:
        for j in range(len(self.segs)):
            rest = self.segs[:j] + self.segs[j + 1:]
            if any(rest) and j != self.spike:
                spike = None if self.spike is None else self.spike - (j < self.spike)
                yield dataclasses.replace(self, segs=rest, spike=spike)
        yield from fewer(self, segs=[tuple(min(n, 1) for n in self.segs)], d=shorter(self.d),
                         loud=[1.0], shift=[0.0], spike=[None])


def partials_cases(count: int = 30) -> list[Partials]:
    out = []
    for seed in range(count):
        pick = rng(5701 + seed)
        segs = tuple(pick([0, 0, 1, 3, 6]) for _ in range(pick([2, 3, 4, 5])))
        segs = segs if any(segs) else segs[:-1] + (4,)
        spike = pick([None, None] + [j for j, n in enumerate(segs) if n])
        loud, shift = pick([(3.0, 0.0), (1e-3, 0.0), (3.0, 1000.0), (3.0, -1000.0)])
        out.append(Partials(seed, segs, pick([1, 3, 4, 8]), loud, shift, spike))
    return out


_PARTIALS_HINT = ("weight each partial by exp(lse_j - M), M the max over all segments, and "
                  "divide by the sum of the weights")


def run_partials(merge_partials: Callable, p: Partials) -> None:
    out, lse = p.build()
    want = A.merge_partials(out, lse)
    got = merge_partials(out.clone(), lse.clone())
    grading.expect_true(isinstance(got, torch.Tensor),
                        f"expected a torch.Tensor, got {type(got).__name__}")
    if got.dtype != out.dtype:
        grading.fail(f"expected dtype {out.dtype} (the partials' dtype), got {got.dtype}",
                     hint="compute in the dtype of out and lse")
    if got.shape == want.shape and got.isnan().any():
        grading.fail("the merged output is NaN", _PARTIALS_HINT)
    grading.expect_tensor_close(got, want, "merged output", 1e-9, 1e-9, hint=rounded(got, want,
        "it", {SLIPS["exp2"]: A.merge_partials(out, lse * LN2)}) or _PARTIALS_HINT)


PARTIALS_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, segs=tuple(max(n, 1) for n in p.segs))
             if 0 in p.segs else None,
             "it passes when no segment is empty: an empty segment (lse = -inf) may come "
             "first or several in a row; subtract the max over all segments"),
    Contrast(lambda p: dataclasses.replace(p, spike=None) if p.spike is not None else None,
             "it passes with log-sum-exps a few units apart and fails when one is hundreds "
             "above the others: subtract the max over all segments"),
)
