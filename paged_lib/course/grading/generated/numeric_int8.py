"""11.3's generated cases: one or two sequences written call after call into int8 blocks
of any size, 1 to 4 KV heads of 1 to 6 numbers, in blocks an earlier owner left (scale 9)
or never written (scale NaN), each call's values in a regime relative to the scale there
(the same, growing, jumping, zeros, below float32's tiny, exactly 127 x scale, shrinking).
Each call is compared with the library's write from the same state (``ch11_quant``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from paged_lib.course.grading.ch11_quant import WriteCall, snap
from paged_lib.course.grading.generated.numeric import Contrast, fewer, shorter
from paged_lib.util import cdiv

__all__ = ["INT8_CONTRASTS", "Int8", "int8_cases"]

_REGIMES = ("same", "grow", "jump", "zeros", "subnormal", "limit", "shrink")


@dataclass(frozen=True)
class Int8:
    """One generated case of 11.3: ``calls[i]`` tokens of sequence 0 (and one of sequence
    1 when ``two``) per call, in regime ``regimes[i]``."""

    seed: int
    block_size: int
    heads: int
    dim: int
    start: int              # tokens sequence 0 holds before the first call
    calls: tuple[int, ...]
    regimes: tuple[str, ...]
    stale: bool             # blocks hold an earlier owner's codes and scale (else NaN)
    two: bool = False

    def build(self) -> list[WriteCall]:
        """The calls, each with the library's answer, in order (state carried)."""
        return list(_build(self))

    def describe(self) -> str:
        bs = self.block_size
        what = {"same": "values as large as before", "grow": "values half as large again",
                "jump": "values a hundred times larger", "zeros": "a token of zeros",
                "subnormal": "values of 1e-40 (below float32's tiny)",
                "limit": "a value exactly 127 x the scale", "shrink": "values 100 times "
                "smaller"}
        steps = "; ".join(f"{n} token(s) with {what[r]}"
                          for n, r in zip(self.calls, self.regimes, strict=True))
        return (f"blocks of {bs}" + (" (not a power of two)" if bs & (bs - 1) else "")
                + f", {self.heads} KV head(s) of {self.dim} number(s), sequence 0 "
                f"holding {self.start} token(s) (offset {self.start % bs} of its block) in "
                + ("blocks an earlier owner left (scale 9)" if self.stale else
                   "blocks never written (scale NaN)")
                + (", a second sequence decoding one token per call" if self.two else "")
                + f"; {len(self.calls)} call(s): {steps}")

    def states(self) -> list[str]:
        """The states of this case that the stage is drawn to reach."""
        out = [f"block size {self.block_size}"] if self.block_size in (3, 5, 6, 7) else []
        out += ["more than 2 KV heads"] if self.heads > 2 else []
        out += ["head size not 2"] if self.dim != 2 else []
        out += ["values below float32's tiny"] if "subnormal" in self.regimes else []
        out += ["a call into 3 or more blocks"] if any(
            n > 2 * self.block_size for n in self.calls) else []
        out += ["growth after a value at the limit"] if any(
            a == "limit" and b in ("grow", "jump") for a, b in zip(
                self.regimes, self.regimes[1:], strict=False)) else []
        return out

    def smaller(self) -> Iterator[Int8]:
        n = len(self.calls)
        for i in range(n):  # one call fewer
            if n > 1:
                yield dataclasses.replace(self, calls=self.calls[:i] + self.calls[i + 1:],
                                          regimes=self.regimes[:i] + self.regimes[i + 1:])
        for i, c in enumerate(self.calls):
            for less in shorter(c):
                yield dataclasses.replace(self, calls=self.calls[:i] + (less,)
                                          + self.calls[i + 1:])
        yield from fewer(self, two=[False], start=shorter(self.start, 0),
                          heads=shorter(self.heads), dim=shorter(self.dim), stale=[False])
        for i, r in enumerate(self.regimes):
            if r != "same":
                yield dataclasses.replace(self, regimes=self.regimes[:i] + ("same",)
                                          + self.regimes[i + 1:])
        yield from fewer(self, block_size=[b for b in (4, 2) if b < self.block_size])


@functools.lru_cache(maxsize=256)
def _build(p: Int8) -> tuple[WriteCall, ...]:
    from paged_lib.kernels.kv_quant import write_int8_blocks

    # the values from their own generator: the same whatever the block size (a contrast
    # changes only the layout)
    g, gx = torch.Generator().manual_seed(1100 + p.seed), torch.Generator().manual_seed(p.seed)
    bs = p.block_size
    lens = [p.start + sum(p.calls)] + ([len(p.calls)] if p.two else [])
    need = [cdiv(n, bs) for n in lens]
    num_blocks = sum(need) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [order[:need[0]], order[need[0]:sum(need)]]
    shape = (num_blocks, bs, p.heads, p.dim)
    if p.stale:
        data = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        scale = torch.full((num_blocks, p.heads), 9.0)
    else:
        data, scale = torch.zeros(shape, dtype=torch.int8), torch.full(
            (num_blocks, p.heads), float("nan"))
    pos = [0, 0]
    mag = 1.0

    def slots_of(s: int, n: int) -> list[int]:
        out = [tables[s][x // bs] * bs + x % bs for x in range(pos[s], pos[s] + n)]
        pos[s] += n
        return out

    if p.start:  # what sequence 0 already holds: one earlier call
        x = torch.randn(p.start, p.heads, p.dim, generator=gx)
        write_int8_blocks(x, data, scale, torch.tensor(slots_of(0, p.start)))
    calls = []
    for k, (n, regime) in enumerate(zip(p.calls, p.regimes, strict=True)):
        mag = {"grow": mag * 1.5, "jump": mag * 100, "shrink": mag / 100}.get(regime, mag)
        slots = slots_of(0, n) + (slots_of(1, 1) if p.two else [])
        x = torch.randn(len(slots), p.heads, p.dim, generator=gx) * mag
        if regime == "zeros":
            x[:n] = 0.0
        elif regime == "subnormal":
            x[:n] = torch.sign(x[:n]) * 1e-40
        elif regime == "limit":  # a value exactly at 127 x the scale of its block
            b = slots[0] // bs
            held = scale[b].nan_to_num(1.0).clamp(min=2.0 ** -20)
            x[0, :, 0] = 127 * held * torch.where(x[0, :, 0] < 0, -1.0, 1.0)
            x[:, :, 1:] = x[:, :, 1:].clamp(-0.5, 0.5) * held[None, :, None]
        s = torch.tensor(slots)
        calls.append(snap(f"call {k} of generated case {p.seed}", x, data, scale, s))
        write_int8_blocks(x.clone(), data, scale, s.clone())
    return tuple(calls)


def _draw(seed: int) -> Int8:
    g = torch.Generator().manual_seed(1130 + seed)

    def pick(xs: list | tuple):
        return xs[int(torch.randint(len(xs), (1,), generator=g))]

    bs = pick([3, 5, 6, 7, 1, 2, 4, 8, 12])
    calls = tuple(pick([1, 1, 2, bs, bs + 1, 2 * bs + 1, 3 * bs]) for _ in range(pick([1, 2,
                                                                                     3, 4])))
    regimes = tuple(_REGIMES[(seed + i) % len(_REGIMES)] for i in range(len(calls)))
    return Int8(seed, bs, pick([1, 2, 3, 4]), pick([1, 3, 4, 6]), pick([0, 0, 1, bs - 1, bs]),
                calls, regimes, bool(pick([0, 1])), bool(pick([0, 0, 1])))


def int8_cases(count: int = 48) -> list[Int8]:
    """11.3's generated cases (seeds 0, 1, ...)."""
    return [_draw(seed) for seed in range(count)]


INT8_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, block_size=4) if p.block_size & (
        p.block_size - 1) else None,
        "it passes with blocks of 4 and fails with blocks of a size that is not a power of "
        "two: a slot's block is slot // block_size and its offset slot % block_size (a shift "
        "and a mask, >> and &, give them only for powers of two)"),
)
