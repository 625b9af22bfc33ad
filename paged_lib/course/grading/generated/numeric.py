"""The generated stage of every exercise that takes inputs, and 09.3's tile cases.

:func:`check` runs a piece's own per-case check on seeded cases (each chapter draws its own:
``small_ints``, ``small_blocks``, ``small_attention``, ``numeric_decode`` ... and
:class:`Tiles` here), each compared with the library's answer. The first case that fails is
*shrunk* (``p.smaller()``, while it still fails) and told in one line that names its state;
when undoing one feature of that state (a :class:`Contrast`: the dtype, the block size, the
scale ...) makes it pass, the hint names that feature. ``p.states()`` names what a case
reaches that the named cases do not; :func:`states` counts them.

09.3's cases leave the named cases' family (block sizes that are powers of two, head sizes of
8 or 16, scales of ``1 / sqrt(head_dim)``, scores a few units apart, float32): shapes of real
configurations (GQA groups of 1 to 7 as Llama 3, Qwen2 and Falcon have them, head sizes that
are not ``hidden / heads`` as in Gemma and Phi, block and tile sizes that are not powers of
two, lengths of 1 and at block boundaries), float16, float32 and float64, and scores from
tiny to extreme (exp overflows and underflows), rising, falling, one spike, or tied.

Everything is seeded: a piece gets the same verdict on any machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from paged_lib.course import grading
from paged_lib.util import CheckFailed, cdiv

__all__ = ["Contrast", "Named", "Tiles", "check", "fewer", "reached", "shorter", "states",
           "tile_cases"]

#: the most cases a shrink may try
MAX_SHRINK_RUNS = 40


@dataclass(frozen=True)
class Contrast:
    """Undo one feature of a failing state (``change`` returns the params with it undone,
    or None where it does not apply); if the piece then passes, ``hint`` names the rule."""

    change: Callable[[Any], Any]
    hint: str


class Named(str):
    """A per-case hint that already names the mistake: no :class:`Contrast` replaces it."""


def _attempt(run: Callable[[Any], None], p: Any) -> tuple[str, str | None] | None:
    """(message, hint) of the first check that fails on ``p``'s case, or None."""
    try:
        run(p)
    except (NotImplementedError, grading.TwinCalled):
        raise
    except CheckFailed as err:
        return err.message, err.hint
    except Exception as err:  # noqa: BLE001 - the learner's code on this case
        hint = grading.raised_hint(err)  # not the learner's mistake: named, kept
        return f"your function raised {type(err).__name__}: {err}", hint and Named(hint)
    return None


def shrink(p: Any, found: tuple, run: Callable[[Any], None],
           max_runs: int = MAX_SHRINK_RUNS) -> tuple[Any, tuple]:
    """The smallest params found (by ``p.smaller()``) whose case still fails."""
    runs, changed = 0, True
    while changed and runs < max_runs:
        changed = False
        for smaller in p.smaller():
            if runs >= max_runs:
                break
            runs += 1
            again = _attempt(run, smaller)
            if again is not None:
                p, found, changed = smaller, again, True
                break
    return p, found


def check(ex: str, cases: Iterable[Any], run: Callable[[Any], None],
          contrasts: tuple[Contrast, ...] = ()) -> None:
    """Run ``run(p)`` (the piece's per-case check, which fails as the grader does) on every
    generated ``p``; at the first that fails, shrink it and fail with its story."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only adds overhead
    try:
        for p in cases:
            found = _attempt(run, p)
            if found is None:
                continue
            small, (message, hint) = shrink(p, found, run)
            for c in () if isinstance(hint, Named) else contrasts:
                other = c.change(small)
                if other is not None and other != small and _attempt(run, other) is None:
                    hint = c.hint
                    break
            grading.fail(f"generated case {p.seed} of {ex}, shrunk to {small.describe()}: "
                         f"{message}", hint)
    finally:
        torch.set_num_threads(threads)


def fewer(p: Any, **options: Iterable) -> Iterator[Any]:
    """``p`` with one field replaced by each smaller value given for it, in order."""
    for name, values in options.items():
        for v in values:
            if v != getattr(p, name):
                yield dataclasses.replace(p, **{name: v})


def reached(*states: tuple[str, bool]) -> list[str]:
    """The names of the ``(name, reached)`` rows that hold: what a case's ``states()``
    returns."""
    return [name for name, on in states if on]


def shorter(n: int, floor: int = 1) -> list[int]:
    return sorted({x for x in (floor, n // 2, n - 1) if floor <= x < n})


#: (query heads, KV heads, head size) scaled down from real configurations: Llama 3 8B
#: (groups of 4), Qwen2 7B (7), Falcon 7B (MQA), Phi-3 mini (MHA, head 96), Gemma 2 9B
#: (head 256, not 3584 / 16 = 224), Mistral 7B (groups of 4, head 128), a head of 80
#: (Phi-2), 6 query heads on 3.
_MODELS = [(8, 2, 12), (7, 1, 8), (4, 1, 20), (3, 3, 24), (8, 4, 16), (4, 1, 10),
           (6, 3, 5), (14, 2, 6)]
_DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def _level(profile: str, n: int, g: torch.Generator) -> torch.Tensor:
    """How far each position's key leans towards the query: the score's shape along the
    sequence (rising: every tile raises the running max; spike: one key dominates)."""
    pos = torch.arange(n, dtype=torch.float64)
    if profile == "rising":
        return pos / 3
    if profile == "falling":
        return (n - pos) / 3
    level = torch.zeros(n, dtype=torch.float64)
    if profile == "spike" and n:
        level[int(torch.randint(n, (1,), generator=g))] = 6.0
    return level


# ------------------------------------------------------------------ 09.3 tiles


@dataclass(frozen=True)
class Tiles:
    """One generated case of 09.3 (attend_tiles)."""

    seed: int
    block_size: int
    tile: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    profile: str
    loud: float
    sign: float = 1.0

    def build(self) -> dict[str, Any]:
        """The case's tensors, as ``ch09.Case`` takes them (unused slots NaN, the
        table padded with -1, the sequence's blocks shuffled)."""
        g = torch.Generator().manual_seed(self.seed)
        dt, bs, n = _DTYPES[self.dtype], self.block_size, self.seq_len
        used = cdiv(n, bs)
        physical = torch.randperm(used + 2, generator=g)[:used].tolist()
        shape = (used + 3, bs, self.kv_heads, self.head_dim)
        k = torch.full(shape, float("nan"), dtype=dt)
        v = k.clone()
        base = torch.randn(n, self.kv_heads, self.head_dim, generator=g, dtype=torch.float64)
        if self.profile == "ties":  # every key the same: every score of a head ties
            base = base[:1].expand_as(base)
        if self.profile == "offset":  # every score far from 0, a few units apart
            keys = base * 0.3 + self.loud
        else:
            keys = (base * 0.3 + _level(self.profile, n, g)[:, None, None]) * self.loud
        vals = torch.randn(n, self.kv_heads, self.head_dim, generator=g, dtype=torch.float64)
        for pos in range(n):
            k[physical[pos // bs], pos % bs] = keys[pos].to(dt)
            v[physical[pos // bs], pos % bs] = vals[pos].to(dt)
        q = torch.randn(self.heads, self.head_dim, generator=g, dtype=torch.float64)
        q = (q.abs() + 1) * self.sign if self.profile != "random" else q * 1.5
        table = torch.tensor(physical + [-1] * 2, dtype=torch.int32)
        return dict(name=f"generated {self.seed}", q=q.to(dt), k_cache=k, v_cache=v, table=table,
                    seq_len=n, tile=self.tile)

    def scores(self) -> tuple[float, float]:
        """The lowest and highest score q . k / sqrt(head_dim) of the case (float64)."""
        c = self.build()
        n, bs = self.seq_len, self.block_size
        if n == 0:
            return 0.0, 0.0
        pos = torch.arange(n)
        k = c["k_cache"][c["table"].long()[pos // bs], pos % bs].double()
        k = k[:, torch.arange(self.heads) // (self.heads // self.kv_heads)]
        s = torch.einsum("hd,thd->ht", c["q"].double(), k) * self.head_dim ** -0.5
        return float(s.min()), float(s.max())

    def states(self) -> list[str]:
        """The states of this case that no fixed case of 09.3 has."""
        lo, hi = self.scores()
        n, bs, group = self.seq_len, self.block_size, self.heads // self.kv_heads
        out = [f"block size {bs}"] if bs in (6, 7, 12) else []
        out += ["head_dim not 8"] if self.head_dim != 8 else []
        out += [f"groups of {group}"] if group in (5, 7) else []
        out += ["float16 with scores past 88"] if self.dtype == "fp16" and hi > 88 else []
        out += ["tied scores"] if self.profile == "ties" and n > 1 else []
        out += ["tiny scores"] if n and max(abs(lo), abs(hi)) < 0.05 else []
        out += ["max in the first tile"] if self.profile == "falling" and n > self.tile else []
        out += ["one spiking key"] if self.profile == "spike" and n > 1 else []
        out += ["ends on a block boundary"] if n and bs > 1 and n % bs == 0 else []
        out += ["scores far from 0, a few units apart"] if self.profile == "offset" and \
            max(abs(lo), abs(hi)) > 88 else []
        return out

    def describe(self) -> str:
        n, bs, t = self.seq_len, self.block_size, self.tile
        parts = [f"blocks of {bs}, tiles of {t}"
                 + (" (tiles straddle blocks)" if t % bs and bs % t else ""),
                 f"{n} tokens" + (f" (a last tile of {n % t})" if n > t and n % t else "")
                 + (" (ends on a block boundary)" if n and bs > 1 and n % bs == 0 else ""),
                 f"{self.heads} query heads on {self.kv_heads} KV heads, head_dim "
                 f"{self.head_dim}", {"fp16": "float16", "fp32": "float32",
                                      "fp64": "float64"}[self.dtype]]
        if n:
            lo, hi = self.scores()
            shape = {"random": "random scores", "rising": "scores rising along the sequence",
                     "falling": "scores falling along the sequence (the max in the first "
                     "tile)", "spike": "one key's score far above the rest",
                     "ties": "every score of a head tied",
                     "offset": "scores a few units apart, all far from 0"}[self.profile]
            parts.append(f"{shape}, from {lo:.3g} to {hi:.3g}" + (
                " (exp of a raw score overflows float32 past 88)" if hi > 88 else
                " (exp of a raw score underflows to 0 below -104)" if hi < -104 else
                " (tiny scores)" if max(abs(lo), abs(hi)) < 0.05 else ""))
        return ", ".join(parts)

    def smaller(self) -> Iterator[Tiles]:
        yield from fewer(self, seq_len=shorter(self.seq_len, 0) + [
            x for x in (self.block_size, self.tile) if x < self.seq_len])
        if self.kv_heads > 1:
            yield dataclasses.replace(self, heads=self.heads // self.kv_heads, kv_heads=1)
        if self.heads > self.kv_heads:
            yield dataclasses.replace(self, heads=self.kv_heads)
        yield from fewer(self, head_dim=[x for x in (2, 4, 8) if x < self.head_dim],
                          profile=["random"] if self.loud == 1.0 else [],
                          loud=[1.0], sign=[1.0], dtype=["fp32"],
                          tile=shorter(self.tile), block_size=shorter(self.block_size))


#: (score profile, loudness, dtype, sign) a case is drawn in, in turn: large scores a few
#: units apart in float16, a max that rises every tile, ties, one spike below zero
#: (underflow), tiny scores, the max in the first tile, scores in the hundreds below zero
_REGIMES = [("offset", 12.0, "fp16", 1.0), ("rising", 4.0, "fp32", 1.0),
            ("ties", 1.0, "fp16", 1.0), ("spike", 12.0, "fp64", -1.0),
            ("random", 1e-3, "fp32", 1.0), ("falling", 4.0, "fp16", 1.0),
            ("offset", 4.0, "fp32", -1.0)]


def _draw_tiles(seed: int) -> Tiles:
    g = torch.Generator().manual_seed(9300 + seed)

    def pick(xs: list | tuple) -> Any:
        return xs[int(torch.randint(len(xs), (1,), generator=g))]

    bs, tile = pick([1, 3, 5, 6, 7, 12, 16]), pick([2, 5, 6, 9, 10, 13, 24])
    heads, kv, d = pick(_MODELS)
    n = pick([0, 1, bs, 2 * bs, 3 * bs + 1, tile, tile + 1, 17, 23, 37])
    profile, loud, dtype, sign = _REGIMES[seed % len(_REGIMES)]
    return Tiles(seed, bs, tile, min(n, 40), heads, kv, d, dtype, profile, loud, sign)


TILE_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, dtype="fp32") if p.dtype == "fp16" else None,
             "it passes in float32 and fails in float16: compute in float32 (q, K and V "
             "widened with .to(torch.float32) before any arithmetic, the scale applied "
             "after widening), cast only the result to q's dtype"),
    Contrast(lambda p: dataclasses.replace(p, loud=1.0) if p.loud > 1 else None,
             "it passes with scores a few units apart and fails with large ones: subtract "
             "the running max (starting from -inf) before exp, and rescale by "
             "exp(m_old - m_new)"),
)

# ------------------------------------------------------------------ what they reach


def tile_cases(count: int = 35) -> list[Tiles]:
    """09.3's generated cases (seeds 0, 1, ...)."""
    return [_draw_tiles(seed) for seed in range(count)]


def states(cases: Iterable[Any]) -> dict[str, int]:
    """How many of the cases reach each state the fixed cases do not (``p.states()``)."""
    seen: dict[str, int] = {}
    for p in cases:
        for name in p.states():
            seen[name] = seen.get(name, 0) + 1
    return seen
