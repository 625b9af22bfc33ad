"""Generated inputs for 05.5, the paged decode kernel (the stage's harness:
:mod:`~paged_lib.course.grading.generated.numeric`).

A case is a decode batch of one to three sequences in Triton's interpreter, so kept small
(at most 48 program-iterations): GQA groups of 1 to 7 (``GROUP_PAD``
above ``GROUP``), one or two KV heads, head sizes and block sizes from 1 to 32 (powers of
two, as ``tl.arange`` needs), lengths of 1 and at block boundaries, scales that are not
``1 / sqrt(HEAD_DIM)`` (Gemma 2's ``query_pre_attn_scalar``, MLA's q . k over more numbers
than V holds), scores from tiny to extreme, and tied scores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from paged_lib.course.grading.generated.numeric import Contrast, fewer, shorter
from paged_lib.kernels.cases import NAN_BLOCK, make_decode_case
from paged_lib.util import cdiv

__all__ = ["DECODE_CONTRASTS", "RAMP_CONTRASTS", "Attention", "Decode", "Gather", "Softmax",
           "Tile", "decode_cases", "ramp_cases"]

#: scale -> (head size it is taken over, as a multiple of HEAD_DIM; what has it)
_SCALES = {"head": (1.0, "1 / sqrt(HEAD_DIM)"),
           "gemma": (1.125, "1 / sqrt(1.125 x HEAD_DIM), as Gemma 2 27B's "
                     "query_pre_attn_scalar 144 at heads of 128"),
           "mla": (1.5, "1 / sqrt(1.5 x HEAD_DIM), as MLA's q . k over 192 numbers with "
                   "V of 128 (DeepSeek-V2)")}


@dataclass(frozen=True)
class Decode:
    """One generated case of 05.5."""

    seed: int
    lens: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    scale: str
    loud: float
    ties: bool = False

    def build(self):
        """The DecodeCase (NaN-poisoned cache, padding through an all-NaN block 0)."""
        case = make_decode_case(self.lens, self.heads, self.kv_heads, self.head_dim,
                                self.block_size, seed=self.seed, shared=False, pad=NAN_BLOCK)
        k = case.k_cache
        if self.ties:  # every key the same: the scores of a head tie
            live = ~k.isnan()
            row = k[live].reshape(-1, self.kv_heads, self.head_dim)[0]
            k = torch.where(live, row.expand_as(k), k)
        return case._replace(q=case.q * self.loud, k_cache=k, scale=(
            _SCALES[self.scale][0] * self.head_dim) ** -0.5)

    def what(self) -> str:
        return (f"seq_lens {list(self.lens)}, heads {self.heads}/{self.kv_heads}, head_dim "
                f"{self.head_dim}, block_size {self.block_size}")

    def describe(self) -> str:
        group = self.heads // self.kv_heads
        ends = [n for n in self.lens if n % self.block_size == 0 and self.block_size > 1]
        return (f"seq_lens {list(self.lens)}" + (f" ({ends} on a block boundary)" if ends
                                                  else "")
                + f", blocks of {self.block_size}, {self.heads} query heads on "
                f"{self.kv_heads} KV head(s) (GROUP {group}, GROUP_PAD "
                f"{1 << (group - 1).bit_length()}), HEAD_DIM {self.head_dim}, scale "
                f"{_SCALES[self.scale][1]}, q x {self.loud:g}"
                + (" (scores in the hundreds)" if self.loud > 1 else " (tiny scores)"
                   if self.loud < 1 else "") + (", every score of a head tied"
                                                if self.ties else ""))

    def states(self) -> list[str]:
        """The states of this case that no fixed case of 05.5 has."""
        group = self.heads // self.kv_heads
        out = [f"GROUP {group}"] if group not in (2, 3) else []
        out += ["one KV head"] if self.kv_heads == 1 else []
        out += [f"HEAD_DIM {self.head_dim}"] if self.head_dim != 16 else []
        out += [f"block size {self.block_size}"] if self.block_size not in (4, 8) else []
        out += ["a scale that is not 1 / sqrt(HEAD_DIM)"] if self.scale != "head" else []
        out += ["tiny scores"] if self.loud < 1 else []
        out += ["tied scores"] if self.ties else []
        return out

    def smaller(self) -> Iterator[Decode]:
        for i in range(len(self.lens)):
            if len(self.lens) > 1:
                yield dataclasses.replace(self, lens=self.lens[:i] + self.lens[i + 1:])
            for n in shorter(self.lens[i]):
                yield dataclasses.replace(self, lens=self.lens[:i] + (n,) + self.lens[i + 1:])
        if self.kv_heads > 1:
            yield dataclasses.replace(self, heads=self.heads // self.kv_heads, kv_heads=1)
        yield from fewer(self, heads=[h for h in (self.kv_heads, 2 * self.kv_heads)
                                       if h < self.heads],
                          head_dim=[d for d in (4, 8) if d < self.head_dim],
                          ties=[False], loud=[1.0], scale=["head"],
                          block_size=[b for b in (1, 2, 4) if b < self.block_size])


_MODELS = [(4, 1), (6, 1), (5, 1), (7, 1), (8, 2), (2, 2), (6, 2), (3, 1)]


def _draw(seed: int) -> Decode:
    g = torch.Generator().manual_seed(550 + seed)

    def pick(xs: list | tuple):
        return xs[int(torch.randint(len(xs), (1,), generator=g))]

    bs, (heads, kv) = pick([1, 2, 4, 8, 16]), pick(_MODELS)
    lens: list[int] = []
    for _ in range(pick([1, 2, 3])):
        n = pick([1, bs, bs + 1, 2 * bs - 1, 2 * bs, 3 * bs + 1, 5, 11, 23])
        if kv * sum(cdiv(x, bs) for x in lens + [n]) <= 48:
            lens.append(n)
    return Decode(seed, tuple(lens or [1]), heads, kv, pick([4, 8, 16, 32]), bs,
                  ("gemma", "head", "mla")[seed % 3], (40.0, 1e-3, 1.0, 40.0, 1.0, 1e-3)[seed % 6],
                  seed % 4 == 3)


def decode_cases(count: int = 24) -> list[Decode]:
    """05.5's generated cases (seeds 0, 1, ...)."""
    return [_draw(seed) for seed in range(count)]


DECODE_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, scale="head") if p.scale != "head" else None,
             "it passes with scale = 1 / sqrt(HEAD_DIM) and fails with another: multiply the "
             "scores by the kernel's scale argument; models choose their own (Gemma 2's "
             "query_pre_attn_scalar, MLA's q . k over more numbers than V holds)"),
    Contrast(lambda p: dataclasses.replace(p, loud=1.0) if p.loud > 1 else None,
             "it passes with scores a few units apart and fails with scores in the "
             "hundreds: keep a running max m, exponentiate s - m_new, and rescale l and acc "
             "by exp(m_old - m_new) when m grows"),
)


# ------------------------------------------------------------------ 05.1-05.4 the ramp
#
# The ramp's fixed cases launch at most two programs along an axis, with BLOCK_M ==
# BLOCK_N or a single row of programs, rows a few units from 0 and scale 1 / sqrt(D).
# Here: up to five programs along an axis, tiles of 1 to 16 (tall, wide, square) over
# sizes that are not powers of two, row ids repeated (blocks shared), rows of a softmax
# from -1000 to +500 or tied, scores all far below (or above) 0, rising or falling from
# tile to tile, one spike, and the scales of Gemma 2 and MLA.


def _gen(base: int, seed: int) -> tuple[torch.Generator, Callable]:
    g = torch.Generator().manual_seed(base + seed)
    return g, lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]


def _span(pick: Callable, programs: int, block: int) -> int:
    """A length that needs ``programs`` programs of ``block``, its last one full or not."""
    return (programs - 1) * block + pick(sorted({1, block // 2 + 1, block}))


@dataclass(frozen=True)
class Tile:
    """One generated case of 05.1."""

    seed: int
    m: int
    n: int
    pad: int
    bm: int
    bn: int

    def build(self) -> tuple:
        x = torch.randn(self.m, self.n, generator=torch.Generator().manual_seed(self.seed))
        return x, self.n + self.pad, self.bm, self.bn

    def describe(self) -> str:
        return (f"M={self.m}, N={self.n}, stride_x={self.n + self.pad}, BLOCK_M={self.bm}, "
                f"BLOCK_N={self.bn} (a {cdiv(self.m, self.bm)} x {cdiv(self.n, self.bn)} grid)")

    def states(self) -> list[str]:
        out = ["more than two programs along an axis"] \
            if max(cdiv(self.m, self.bm), cdiv(self.n, self.bn)) > 2 else []
        return out + ["BLOCK_M != BLOCK_N over several rows of programs"] \
            if self.bm != self.bn and self.m > self.bm else out

    def smaller(self) -> Iterator[Tile]:
        yield from fewer(self, m=shorter(self.m), n=shorter(self.n), pad=shorter(self.pad, 0),
                         bm=[b for b in (1, 2, 4) if b < self.bm],
                         bn=[b for b in (1, 2, 4) if b < self.bn])


def _draw_tile(seed: int) -> Tile:
    _, pick = _gen(5100, seed)
    bm, bn, pm = pick([1, 2, 4, 8, 16]), pick([1, 2, 4, 8, 16]), pick([1, 2, 3, 4, 5])
    return Tile(seed, _span(pick, pm, bm), _span(pick, pick(range(1, 12 // pm + 1)), bn),
                pick([0, 1, 3, 5]), bm, bn)


TILE_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, bn=p.bm) if p.bn != p.bm else None,
             "it passes with square tiles and fails when BLOCK_M != BLOCK_N: rows step by "
             "BLOCK_M (pid_m * BLOCK_M + arange(BLOCK_M)), columns by BLOCK_N"),
    Contrast(lambda p: dataclasses.replace(p, bm=1) if p.bm > 1 else None,
             "it passes with BLOCK_M = 1 and fails with taller tiles: program pid_m's first "
             "row is pid_m * BLOCK_M, not pid_m"),
    Contrast(lambda p: dataclasses.replace(p, bn=1) if p.bn > 1 else None,
             "it passes with BLOCK_N = 1 and fails with wider tiles: program pid_n's first "
             "column is pid_n * BLOCK_N, not pid_n"),
)


@dataclass(frozen=True)
class Gather:
    """One generated case of 05.2 (``shared``: row ids repeat, as shared blocks do)."""

    seed: int
    num_rows: int
    n: int
    d: int
    block: int
    shared: bool

    def build(self) -> tuple:
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.num_rows, self.d, generator=g)
        idx = torch.randint(self.num_rows, (self.n,), generator=g) if self.shared else \
            torch.randperm(self.num_rows, generator=g)[:self.n]
        return x, idx.to(torch.int32), self.block

    def describe(self) -> str:
        return (f"{self.num_rows} rows of {self.d}, n={self.n}, BLOCK_I={self.block} "
                f"({cdiv(self.n, self.block)} programs)"
                + (", some row ids repeated" if self.shared else ""))

    def states(self) -> list[str]:
        out = ["more than two programs"] if cdiv(self.n, self.block) > 2 else []
        return out + ["repeated row ids"] if self.shared else out

    def smaller(self) -> Iterator[Gather]:
        yield from fewer(self, n=shorter(self.n), shared=[False],
                         d=[x for x in (1, 2) if x < self.d],
                         block=[b for b in (1, 2) if b < self.block])
        if self.num_rows > self.n:
            yield dataclasses.replace(self, num_rows=self.n)


def _draw_gather(seed: int) -> Gather:
    _, pick = _gen(5200, seed)
    block = pick([1, 2, 4, 8])
    n = _span(pick, pick([1, 2, 3, 4, 5]), block)
    return Gather(seed, n + pick([0, 1, 7]), n, pick([1, 2, 4, 8, 32]), block,
                  pick([False, True]))


GATHER_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, block=1) if p.block > 1 else None,
             "it passes with BLOCK_I = 1 and fails with larger blocks: program pid covers "
             "rows pid * BLOCK_I + arange(BLOCK_I) of out, not pid + arange(BLOCK_I)"),
)


@dataclass(frozen=True)
class Softmax:
    """One generated case of 05.3: one row per value of ``shifts`` (what it is centred
    on), values ``spread`` apart, or every value of a row tied."""

    seed: int
    n: int
    block: int
    shifts: tuple[float, ...]
    spread: float
    ties: bool

    def build(self) -> tuple:
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(len(self.shifts), self.n, generator=g) * self.spread
        if self.ties:
            x = x[:, :1].expand_as(x).clone()
        return x + torch.tensor(self.shifts)[:, None], self.block

    def describe(self) -> str:
        return (f"{len(self.shifts)} row(s) of N={self.n}, BLOCK_N={self.block}, values "
                f"around {', '.join(f'{s:g}' for s in self.shifts)}, "
                + ("every value of a row tied" if self.ties else f"spread {self.spread:g}"))

    def states(self) -> list[str]:
        out = ["a row far below 0 with lanes past N"] \
            if min(self.shifts) < -104 and self.n < self.block else []
        out += ["tied values"] if self.ties else []
        return out + ["tiny differences"] if self.spread < 0.01 else out

    def smaller(self) -> Iterator[Softmax]:
        for i in range(len(self.shifts) if len(self.shifts) > 1 else 0):
            yield dataclasses.replace(self, shifts=self.shifts[:i] + self.shifts[i + 1:])
        yield from fewer(self, n=shorter(self.n), block=[b for b in (1, 2, 4, 8)
                                                          if self.n <= b < self.block],
                         ties=[False], spread=[3.0])


def _draw_softmax(seed: int) -> Softmax:
    _, pick = _gen(5300, seed)
    n = pick([1, 2, 3, 5, 7, 8, 13, 16, 17, 31])
    block = 1 << (n - 1).bit_length() << pick([0, 0, 1])
    shifts = tuple(pick([0.0, 500.0, -50.0, -200.0, -1000.0, 90.0, -90.0])
                   for _ in range(pick([1, 2, 3])))
    return Softmax(seed, n, block, shifts, pick([3.0, 1e-3, 30.0]), pick([False] * 4 + [True]))


SOFTMAX_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, block=p.n) if p.block > p.n and
             p.n & (p.n - 1) == 0 else None,
             "it passes when N == BLOCK_N and fails with lanes past N: a padding lane must "
             "not raise the row's max (load it with other=-inf, not 0); in a row far below "
             "0, exp(x - 0) underflows to 0 in every lane and the sum is 0"),
    Contrast(lambda p: dataclasses.replace(p, shifts=tuple(0.0 for _ in p.shifts))
             if any(p.shifts) else None,
             "it passes with values near 0 and fails with rows far from 0: subtract the "
             "row's own max (over its N values) before tl.exp"),
)

#: profile -> the score it puts on every key (or its step from key to key)
_ATT_LEVELS = {"random": None, "below": -200.0, "above": 200.0, "rising": 3.0,
               "falling": -3.0, "spike": 30.0, "ties": None}


@dataclass(frozen=True)
class Attention:
    """One generated case of 05.4: ``profile`` shapes the scores along the keys (all
    around -200 or +200, rising or falling 3 a key, one spike of 30, tied, or random
    with q x ``loud``)."""

    seed: int
    batch: int
    n: int
    d: int
    tile: int
    profile: str
    loud: float
    scale: str

    def build(self) -> tuple:
        g = torch.Generator().manual_seed(self.seed)
        scale = (_SCALES[self.scale][0] * self.d) ** -0.5
        q = torch.randn(self.batch, self.d, generator=g, dtype=torch.float64)
        k = torch.randn(self.batch, self.n, self.d, generator=g, dtype=torch.float64)
        v = torch.randn(self.batch, self.n, self.d, generator=g, dtype=torch.float64)
        level, pos = _ATT_LEVELS[self.profile], torch.arange(self.n, dtype=torch.float64)
        if self.profile == "ties":
            k = k[:, :1].expand_as(k)
        elif level is not None:  # scores = level (per key) + a few units of noise
            per_key = pos * level if self.profile == "rising" else (self.n - pos) * -level \
                if self.profile == "falling" else (pos == self.n // 2) * level \
                if self.profile == "spike" else torch.full_like(pos, level)
            q = q.abs() + 1
            k = 0.3 * k + (per_key / scale)[None, :, None] * (q / (q * q).sum(1, True))[:, None]
        q = q * self.loud
        return q.float(), k.float(), v.float(), scale, self.tile

    def describe(self) -> str:
        what = {"random": f"random scores (q x {self.loud:g})",
                "below": "every score around -200", "above": "every score around +200",
                "rising": "scores rising 3 a key", "falling": "scores falling 3 a key (the "
                "max in the first tile)", "spike": "one key's score 30 above the rest",
                "ties": "every score tied"}[self.profile]
        return (f"batch {self.batch}, N={self.n}, D={self.d}, TILE={self.tile}, {what}, "
                f"scale {_SCALES[self.scale][1].replace('HEAD_DIM', 'D')}")

    def states(self) -> list[str]:
        out = ["every score far below 0"] if self.profile == "below" else []
        out += ["a scale that is not 1 / sqrt(D)"] if self.scale != "head" else []
        out += ["tied scores"] if self.profile == "ties" and self.n > 1 else []
        return out + ["N <= TILE"] if self.n <= self.tile else out

    def smaller(self) -> Iterator[Attention]:
        yield from fewer(self, batch=shorter(self.batch), n=shorter(self.n),
                         d=[x for x in (1, 2, 4) if x < self.d],
                         tile=[t for t in (1, 2, 4) if t < self.tile], scale=["head"],
                         profile=["random"] if self.profile != "below" else [], loud=[1.0])


def _draw_attention(seed: int) -> Attention:
    _, pick = _gen(5400, seed)
    tile, profile = pick([1, 2, 4, 8]), list(_ATT_LEVELS)[seed % len(_ATT_LEVELS)]
    batch = pick([1, 2, 3])
    n = _span(pick, pick(range(1, 12 // batch + 1)), tile)
    return Attention(seed, batch, n, pick([2, 4, 8, 16]), tile, profile,
                     pick([1e-3, 1.0, 40.0]) if profile == "random" else 1.0,
                     ("head", "gemma", "mla")[seed % 3])


ATTENTION_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, profile="above") if p.profile == "below"
             else None,
             "it passes when every score is far above 0 and fails when every score is far "
             "below 0: start the running max at -inf, not 0 (with m = 0, exp(s - m) "
             "underflows to 0 for every key, and l = 0)"),
    Contrast(lambda p: dataclasses.replace(p, scale="head") if p.scale != "head" else None,
             "it passes with scale = 1 / sqrt(D) and fails with another: multiply the scores "
             "by the kernel's scale argument (Gemma 2 and MLA pass their own)"),
    Contrast(lambda p: dataclasses.replace(p, loud=1.0) if p.loud > 1 else None,
             "it passes with scores a few units apart and fails with scores in the "
             "hundreds: keep a running max m, exponentiate s - m_new, and rescale l and acc "
             "by exp(m_old - m_new) when m grows"),
)


def ramp_cases(ex: str, count: int = 16) -> list:
    """05.1-05.4's generated cases (seeds 0, 1, ...)."""
    draw = {"05.1": _draw_tile, "05.2": _draw_gather, "05.3": _draw_softmax,
            "05.4": _draw_attention}[ex]
    return [draw(seed) for seed in range(count)]


RAMP_CONTRASTS = {"05.1": TILE_CONTRASTS, "05.2": GATHER_CONTRASTS,
                  "05.3": SOFTMAX_CONTRASTS, "05.4": ATTENTION_CONTRASTS}
