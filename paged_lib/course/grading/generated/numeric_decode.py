"""Generated cases of chapter 05's kernels (05.1-05.5) for :func:`numeric.check`, small
enough for Triton's interpreter (up to five programs along an axis)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from paged_lib.course.grading.generated.numeric import Contrast, shorter
from paged_lib.course.grading.generated.small_attention import BELOW_HINT, SCALES, below, rng
from paged_lib.kernels.cases import NAN_BLOCK, make_decode_case
from paged_lib.util import cdiv

#: a field's simpler values, tried in turn by ``Ramp.smaller``
_SIMPLER: dict[str, Callable[[Any, Any], list]] = {
    "pad": lambda v, p: shorter(v, 0), "shared": lambda v, p: [False],
    "ties": lambda v, p: [False], "spread": lambda v, p: [3.0], "scale": lambda v, p: ["head"],
    "loud": lambda v, p: [1.0], "profile": lambda v, p: ["random"],
    "shifts": lambda v, p: [v[:i] + v[i + 1:] for i in range(len(v))] if len(v) > 1 else [],
    "lens": lambda v, p: [x for i in range(len(v)) for x in ([v[:i] + v[i + 1:]] if len(v) > 1
                          else []) + [v[:i] + (n,) + v[i + 1:] for n in shorter(v[i])]],
    "heads": lambda v, p: [h for h in (p.kv_heads, 2 * p.kv_heads) if h < v],
    "head_dim": lambda v, p: [d for d in (4, 8) if d < v], "kv_heads": lambda v, p: []}
_POW2 = ("bm", "bn", "block", "tile", "d", "block_size")
#: profile of 05.4 -> the score it puts on every key (or its step from key to key)
_LEVELS = {"random": None, "below": -200.0, "above": 200.0, "rising": 3.0, "falling": -3.0,
           "spike": 30.0, "ties": None}


@dataclass(frozen=True)
class Ramp:
    """One generated case of 05.1-05.4: the exercise, a seed, and its fields by name."""

    ex: str
    seed: int
    fields: tuple[tuple[str, Any], ...]

    def __getattr__(self, name: str) -> Any:
        for key, value in object.__getattribute__(self, "fields"):
            if key == name:
                return value
        raise AttributeError(name)

    def replace(self, **changes: Any) -> Ramp:
        return Ramp(self.ex, self.seed, tuple((k, changes.get(k, v)) for k, v in self.fields))

    def build(self) -> tuple:
        g = torch.Generator().manual_seed(self.seed)
        if self.ex == "05.1":
            return torch.randn(self.m, self.n, generator=g), self.n + self.pad, self.bm, self.bn
        if self.ex == "05.2":
            x = torch.randn(self.num_rows, self.d, generator=g)
            idx = torch.randint(self.num_rows, (self.n,), generator=g) if self.shared else \
                torch.randperm(self.num_rows, generator=g)[:self.n]
            return x, idx.to(torch.int32), self.block
        if self.ex == "05.3":
            x = torch.randn(len(self.shifts), self.n, generator=g) * self.spread
            x = x[:, :1].expand_as(x).clone() if self.ties else x
            return x + torch.tensor(self.shifts)[:, None], self.block
        if self.ex == "05.4":
            return self._attention(g)
        case = make_decode_case(self.lens, self.heads, self.kv_heads, self.head_dim,
                                self.block_size, seed=self.seed, shared=False, pad=NAN_BLOCK)
        k = case.k_cache  # NaN-poisoned, padding through an all-NaN block 0
        if self.ties:  # every key the same: the scores of a head tie
            live = ~k.isnan()
            row = k[live].reshape(-1, self.kv_heads, self.head_dim)[0]
            k = torch.where(live, row.expand_as(k), k)
        scale = (SCALES[self.scale][0] * self.head_dim) ** -0.5
        q, k = below(case.q, k, scale, 200.0) if self.below else (case.q * self.loud, k)
        return case._replace(q=q, k_cache=k, scale=scale)

    def _attention(self, g: torch.Generator) -> tuple:
        """05.4's q, k, v (float32), scale and TILE: scores = the profile's level at each
        key plus a few units of noise (k leans along q by level / scale)."""
        scale = (SCALES[self.scale][0] * self.d) ** -0.5
        q, k, v = (torch.randn(*shape, self.d, generator=g, dtype=torch.float64)
                   for shape in ((self.batch,), (self.batch, self.n), (self.batch, self.n)))
        level, pos = _LEVELS[self.profile], torch.arange(self.n, dtype=torch.float64)
        if self.profile == "ties":
            k = k[:, :1].expand_as(k)
        elif level is not None:
            at = {"rising": pos * level, "falling": (self.n - pos) * -level,
                  "spike": (pos == self.n // 2) * level}.get(self.profile, pos * 0 + level)
            q = q.abs() + 1
            k = 0.3 * k + (at / scale)[None, :, None] * (q / (q * q).sum(1, True))[:, None]
        return (q * self.loud).float(), k.float(), v.float(), scale, self.tile

    def describe(self) -> str:
        if self.ex == "05.1":
            return f"a {cdiv(self.m, self.bm)} x {cdiv(self.n, self.bn)} grid of programs"
        if self.ex == "05.2":
            return f"{cdiv(self.n, self.block)} programs" + (
                ", some row ids repeated" if self.shared else "")
        if self.ex == "05.3":
            return (f"rows around {', '.join(f'{s:g}' for s in self.shifts)}, "
                    + ("every value of a row tied" if self.ties else f"spread {self.spread:g}"))
        if self.ex == "05.5":
            group, bs = self.heads // self.kv_heads, self.block_size
            ends = [n for n in self.lens if n % bs == 0 and bs > 1]
            return (f"seq_lens {list(self.lens)}" + (f" ({ends} on a block boundary)" * bool(
                ends)) + f", blocks of {bs}, {self.heads} query heads on {self.kv_heads} KV "
                f"head(s) (GROUP {group}, GROUP_PAD {1 << (group - 1).bit_length()}), HEAD_DIM "
                f"{self.head_dim}, scale {SCALES[self.scale][1]}, q x {self.loud:g}"
                + (" (scores in the hundreds)" if self.loud > 1 else " (tiny scores)"
                   if self.loud < 1 else "") + (", every score of a head tied" * self.ties)
                + (", every score about -200" * self.below))
        what = {"random": f"random scores (q x {self.loud:g})", "below": "every score around "
                "-200", "above": "every score around +200", "rising": "scores rising 3 a key",
                "falling": "scores falling 3 a key (the max in the first tile)",
                "spike": "one key's score 30 above the rest", "ties": "every score tied"}
        return f"{what[self.profile]}, scale {SCALES[self.scale][1].replace('HEAD_DIM', 'D')}"

    def states(self) -> list[str]:
        return [name for name, reached in _STATES[self.ex].items() if reached(self)]

    def smaller(self) -> Iterator[Ramp]:
        for key, value in self.fields:
            if key == "kv_heads" and value > 1:
                yield self.replace(heads=self.heads // value, kv_heads=1)
            for v in [b for b in (1, 2, 4) if b < value] if key in _POW2 else \
                    _SIMPLER.get(key, lambda v, p: shorter(v))(value, self):
                small = self.replace(**{key: v})
                if v != value and (self.ex not in ("05.2", "05.3") or small.n <= (
                        small.block if self.ex == "05.3" else small.num_rows)):
                    yield small


#: per exercise, the edge states its cases reach
_STATES: dict[str, dict[str, Callable[[Ramp], bool]]] = {
    "05.1": {"more than two programs along an axis":
             lambda p: max(cdiv(p.m, p.bm), cdiv(p.n, p.bn)) > 2,
             "BLOCK_M != BLOCK_N over several rows of programs":
             lambda p: p.bm != p.bn and p.m > p.bm},
    "05.2": {"more than two programs": lambda p: cdiv(p.n, p.block) > 2,
             "repeated row ids": lambda p: p.shared},
    "05.3": {"a row far below 0 with lanes past N":
             lambda p: min(p.shifts) < -104 and p.n < p.block,
             "tied values": lambda p: p.ties, "tiny differences": lambda p: p.spread < 0.01},
    "05.4": {"every score far below 0": lambda p: p.profile == "below",
             "a scale that is not 1 / sqrt(D)": lambda p: p.scale != "head",
             "tied scores": lambda p: p.profile == "ties" and p.n > 1,
             "N <= TILE": lambda p: p.n <= p.tile},
    "05.5": {**{f"GROUP {g}": lambda p, g=g: p.heads // p.kv_heads == g for g in (1, 4, 5, 6, 7)},
             "one KV head": lambda p: p.kv_heads == 1,
             **{f"HEAD_DIM {d}": lambda p, d=d: p.head_dim == d for d in (4, 8, 32)},
             **{f"block size {b}": lambda p, b=b: p.block_size == b for b in (1, 2, 16)},
             "a scale that is not 1 / sqrt(HEAD_DIM)": lambda p: p.scale != "head",
             "tiny scores": lambda p: p.loud < 1, "tied scores": lambda p: p.ties,
             "every score far below 0": lambda p: p.below},
}


def _span(pick: Callable, programs: int, block: int) -> int:
    """A length that needs ``programs`` programs of ``block``, its last one full or not."""
    return (programs - 1) * block + pick(sorted({1, block // 2 + 1, block}))


def _draw_ramp(ex: str, seed: int) -> Ramp:
    pick = rng(5000 + 100 * int(ex[-1]) + seed)
    if ex == "05.1":
        bm, bn, pm = pick([1, 2, 4, 8, 16]), pick([1, 2, 4, 8, 16]), pick(range(1, 6))
        return Ramp(ex, seed, (("m", _span(pick, pm, bm)), ("n", _span(
            pick, pick(range(1, 12 // pm + 1)), bn)), ("pad", pick([0, 1, 3, 5])),
                               ("bm", bm), ("bn", bn)))
    if ex == "05.2":
        block = pick([1, 2, 4, 8])
        n = _span(pick, pick(range(1, 6)), block)
        return Ramp(ex, seed, (("num_rows", n + pick([0, 1, 7])), ("n", n), ("d", pick(
            [1, 2, 4, 8, 32])), ("block", block), ("shared", pick([False, True]))))
    if ex == "05.3":
        n = pick([1, 2, 3, 5, 7, 8, 13, 16, 17, 31])
        shifts = tuple(pick([0.0, 500.0, -50.0, -200.0, -1000.0, 90.0, -90.0])
                       for _ in range(pick([1, 2, 3])))
        return Ramp(ex, seed, (("shifts", shifts), ("n", n),
                               ("block", 1 << (n - 1).bit_length() << pick([0, 0, 1])),
                               ("spread", pick([3.0, 1e-3, 30.0])),
                               ("ties", pick([False] * 4 + [True]))))
    tile, profile, batch = pick([1, 2, 4, 8]), list(_LEVELS)[seed % len(_LEVELS)], pick([1, 2, 3])
    n = _span(pick, pick(range(1, 12 // batch + 1)), tile)
    return Ramp(ex, seed, (("batch", batch), ("n", n), ("d", pick([2, 4, 8, 16])),
                           ("tile", tile), ("profile", profile),
                           ("loud", pick([1e-3, 1.0, 40.0]) if profile == "random" else 1.0),
                           ("scale", ("head", "gemma", "mla")[seed % 3])))


def ramp_cases(ex: str, count: int = 16) -> list[Ramp]:
    return [_draw_ramp(ex, seed) for seed in range(count)]


_MODELS = [(4, 1), (6, 1), (5, 1), (7, 1), (8, 2), (2, 2), (6, 2), (3, 1)]


def _draw_decode(seed: int) -> Ramp:
    pick = rng(550 + seed)
    bs, (heads, kv) = pick([1, 2, 4, 8, 16]), pick(_MODELS)
    lens: list[int] = []
    for _ in range(pick([1, 2, 3])):
        n = pick([1, bs, bs + 1, 2 * bs - 1, 2 * bs, 3 * bs + 1, 5, 11, 23])
        if kv * sum(cdiv(x, bs) for x in lens + [n]) <= 48:
            lens.append(n)
    return Ramp("05.5", seed, (("lens", tuple(lens or [1])), ("kv_heads", kv), ("heads", heads),
                               ("head_dim", pick([4, 8, 16, 32])), ("ties", seed % 4 == 3),
                               ("loud", (40.0, 1e-3, 1.0, 40.0, 1.0, 1e-3)[seed % 6]),
                               ("scale", ("gemma", "head", "mla")[seed % 3]),
                               ("block_size", bs), ("below", seed % 6 == 4)))


def decode_cases(count: int = 24) -> list[Ramp]:
    return [_draw_decode(seed) for seed in range(count)]


def _undo(field: str, value: Any, when: Callable[[Ramp], bool]) -> Callable:
    return lambda p: p.replace(**{field: value(p) if callable(value) else value}) \
        if when(p) else None


#: 05.5's and 05.4's: a hint names the feature whose undoing makes the shrunk case pass
DECODE_CONTRASTS = (
    Contrast(_undo("below", False, lambda p: p.ex == "05.5" and p.below), BELOW_HINT),
    Contrast(_undo("scale", "head", lambda p: p.scale != "head"),
             "it passes with scale = 1 / sqrt(HEAD_DIM) and fails with another: multiply the "
             "scores by the kernel's scale argument"),
    Contrast(_undo("loud", 1.0, lambda p: p.loud > 1),
             "it passes with scores a few units apart and fails with scores in the "
             "hundreds: keep a running max m and rescale l and acc by exp(m_old - m_new)"),
)
RAMP_CONTRASTS = {
    "05.1": (Contrast(_undo("bn", lambda p: p.bm, lambda p: p.bn != p.bm),
                      "it passes with square tiles and fails when BLOCK_M != BLOCK_N: rows "
                      "step by BLOCK_M, columns by BLOCK_N"),
             Contrast(_undo("bm", 1, lambda p: p.bm > 1),
                      "it passes with BLOCK_M = 1 and fails with taller tiles: program "
                      "pid_m's first row is pid_m * BLOCK_M, not pid_m"),
             Contrast(_undo("bn", 1, lambda p: p.bn > 1),
                      "it passes with BLOCK_N = 1 and fails with wider tiles: program "
                      "pid_n's first column is pid_n * BLOCK_N")),
    "05.2": (Contrast(_undo("block", 1, lambda p: p.block > 1),
                      "it passes with BLOCK_I = 1 and fails with larger blocks: program pid covers "
                      "rows pid * BLOCK_I + arange(BLOCK_I) of out, not pid + arange(BLOCK_I)"),),
    "05.3": (Contrast(_undo("block", lambda p: p.n, lambda p: p.n < p.block
                            and p.n & (p.n - 1) == 0),
                      "it passes when N == BLOCK_N and fails with lanes past N: a padding "
                      "lane must not raise the row's max (load it with other=-inf, not 0)"),
             Contrast(_undo("shifts", lambda p: tuple(0.0 for _ in p.shifts),
                            lambda p: any(p.shifts)),
                      "it passes with values near 0 and fails with rows far from 0: "
                      "subtract the row's max (over its N values) before tl.exp")),
    "05.4": (Contrast(_undo("profile", "above", lambda p: p.profile == "below"), BELOW_HINT),
             *DECODE_CONTRASTS),
}
