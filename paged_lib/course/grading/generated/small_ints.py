"""The generated stages of chapters 00 and 01 (:mod:`.numeric`): counts past 2**53 at block
sizes 1 to 2**20 + 1 (00.1, 01.2, 01.3); real models in fp8, fp16 and fp32 (01.1), with
budgets of exactly k requests, one byte less, or a block less one byte more (01.4)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from paged_lib.accounting import ModelSpec, kv_bytes_per_token
from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric
from paged_lib.util import cdiv

_NS = [0, 1, 15, 10 ** 18 + 17, 2 ** 53 + 1, 3 * 10 ** 17 + 5, 2 ** 62 + 3, 10 ** 15 + 7,
       2 ** 53 + 15]
_BS = [16, 3, 7, 100, 2 ** 20 + 1, 1]


@dataclass(frozen=True)
class Count:
    seed: int
    n: int
    b: int

    def describe(self) -> str:
        return (f"n = {self.n:,}, block size {self.b}"
                + (" (n / b as a float is rounded: n is past 2**53)" if self.n > 2 ** 53
                   else " (n / b as a float keeps about 16 digits: its fraction is rounded)"
                   if self.n > 2 ** 40 else ""))

    def states(self) -> list[str]:
        out = ["n past 2**53"] if self.n > 2 ** 53 else []
        return out + ([f"block size {self.b}"] if self.b not in (1, 3, 16) else [])

    def smaller(self) -> Iterator[Count]:
        yield from numeric.fewer(self, n=[x for x in _NS if x < self.n],
                                 b=[x for x in _BS if x < self.b])


def count_cases(count: int = 30) -> list[Count]:
    return [Count(k, _NS[k % len(_NS)], _BS[(k // len(_NS) + k) % len(_BS)])
            for k in range(count)]


def fill(n: int, b: int) -> float:
    return ((n % b) or b) / b if n else 0.0


FLOAT_HINT = numeric.Named("stay in integers: n // b and n % b are exact at any size, n / b "
                           "is a float that holds 53 bits and rounds past 2**53")


def count_stage(ex: str, run: Callable[[int, int], None]) -> None:
    numeric.check(ex, count_cases(), lambda p: run(p.n, p.b), (numeric.Contrast(
        lambda p: dataclasses.replace(p, b=1 << p.b.bit_length()) if p.b & (p.b - 1) else None,
        "it passes once the block size is a power of two: a bit mask (& (b - 1), & -b) or a "
        "shift (>> log2 b) divides only by powers of two; count with // and %"),))


def _division_hint(n: int, b: int, got: Any) -> str:
    if n > 2 ** 53:
        return FLOAT_HINT
    if got == n // b:
        return "a partly filled last block still takes a whole block: round up, not down"
    if isinstance(got, float) and got != int(got):
        return "`/` gives a fraction of a block; blocks are whole: round up"
    if n % b == 0 and got == n // b + 1:
        return (f"when n is a multiple of b the last block is exactly full: {n} tokens in "
                f"blocks of {b} need {n // b}, not one more")
    return "ceil(n / b): the number of b-sized blocks that hold n items, 0 for n = 0"


def check_division(ex: str, name: str, fn: Callable[[int, int], int]) -> None:
    """00.1 (``ceil_div``) and 01.2 (``logical_blocks``): the same division."""
    def run(n: int, b: int) -> None:
        got = fn(n, b)
        grading.expect_equal(got, cdiv(n, b), f"{name}({n}, {b})", _division_hint(n, b, got))
        grading.expect_int(got, f"{name}({n}, {b})")  # (its hint: stay in integers)

    with grading.exercise(ex):
        count_stage(ex, run)


def _counts() -> Any:
    """:mod:`small_counts` (its real models), imported when first asked: it imports Triton."""
    from paged_lib.course.grading.generated import small_counts

    return small_counts


def kv_cases() -> list[Any]:
    """01.1's cases: every model that caches K and V (not MLA), in fp8, fp16 or fp32."""
    plain = [i for i, m in enumerate(_counts().MODELS) if not m[6]]
    return [_counts().PerToken(k, m, None, (1, 2, 4)[k % 3]) for k, m in enumerate(plain)]


def kv_stage(run: Callable[[ModelSpec], None]) -> None:
    numeric.check("01.1", kv_cases(), lambda p: run(p.spec()), (_counts()._HEAD_DIM,))


@dataclass(frozen=True)
class Budget:
    """01.4: a budget of ``requests`` requests of ``context_len`` tokens, less one byte
    (``extra`` -1), exactly (0), or a block less one byte more (1)."""

    seed: int
    token: Any  # small_counts.PerToken: the model, its layers, its dtype
    block_size: int
    context_len: int
    requests: int
    extra: int

    def args(self) -> tuple[ModelSpec, int, int, int]:
        spec, bs = self.token.spec(), self.block_size
        block = bs * kv_bytes_per_token(spec)
        extra = {-1: -1, 0: 0, 1: block - 1}[self.extra]
        return spec, self.requests * cdiv(self.context_len, bs) * block + extra, \
            self.context_len, bs

    def describe(self) -> str:
        spec, budget, ctx, bs = self.args()
        return (f"max_requests of {_counts()._about(spec)}, a budget of {budget:,} bytes "
                f"({self.requests} x {cdiv(ctx, bs)} blocks" + {-1: " less one byte", 0: "",
                1: " and a block less one byte"}[self.extra] + f"), context_len {ctx}, "
                f"block_size {bs}")

    def states(self) -> list[str]:
        spec, budget, ctx, bs = self.args()
        odd = bs & (bs - 1) > 0
        return [f"block size {bs}"] * odd + ["a budget past 2**32 bytes"] * (budget > 2 ** 32) \
            + ["a context of whole blocks of a size not a power of two"] * (odd and ctx % bs == 0)

    def smaller(self) -> Iterator[Budget]:
        yield from (dataclasses.replace(self, token=t) for t in self.token.smaller())
        yield from numeric.fewer(self, requests=[1], extra=[0], context_len=[
            x for x in (1, self.block_size) if x < self.context_len])


def budget_cases(count: int = 30) -> list[Budget]:
    out = []
    for seed in range(count):
        pick = random.Random(104 + seed).choice
        bs, model = pick([1, 3, 12, 16, 24, 48, 100]), kv_cases()[seed % 9].model
        out.append(Budget(seed, _counts().PerToken(seed, model, None, pick([1, 2, 4])), bs,
                          pick([1, bs, 7 * bs, 7 * bs + 1, 1000, 4096, 32768]),
                          pick([1, 2, 7, 40]), pick([-1, 0, 1])))
    return out


def budget_stage(run: Callable[[ModelSpec, int, int, int], None]) -> None:
    numeric.check("01.4", budget_cases(), lambda p: run(*p.args()), (numeric.Contrast(
        lambda p: dataclasses.replace(p, block_size=1 << p.block_size.bit_length())
        if p.block_size & (p.block_size - 1) else None,
        "it passes once block_size is a power of two: rounding up to a multiple of "
        "block_size with a bit mask (& -block_size) or counting blocks with a shift (>> "
        "log2) holds only for powers of two; count blocks with ceil division in integers"),))
