"""Generated inputs for 10.1 and 10.2, run through the grader's own per-case check. 10.1:
seeded prompts (token ids up to 152,000) hashed at block sizes 16, 5, 3 and 2 in turn, with
up to three extra keys in their order. 10.2: prompts up to 131,072 tokens, every block
cached, a prefix or all but one, block ids up to 2**31 - 2, block 0 among them.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from dataclasses import dataclass

from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.generated.numeric import Contrast

__all__ = ["HIT_CONTRASTS", "PROMPT_CONTRASTS", "Hit", "Prompt", "hit_cases", "prompt_cases"]

#: extra keys as requests carry them, in their order
_EXTRAS = [(), ("lora-7",), ("salt-9", "lora-7"), ("lora-2", "mm:3f2a", "salt-1"),
           ("mm:9c01", 4)]
_SIZES = (16, 5, 3, 2)


@dataclass(frozen=True)
class Prompt:
    """10.1: prompt ``family`` cut to ``length`` tokens, hashed at ``block_size``."""

    seed: int
    family: int
    length: int
    block_size: int
    extras: tuple

    def tokens(self) -> list[int]:
        return [(7919 * t + 104_729 * self.family + 13) % 152_000 for t in range(self.length)]

    def describe(self) -> str:
        t, before = self.tokens(), list(_SIZES[:self.seed % len(_SIZES)])
        return (f"{self.length} tokens {t[:5]}{' ...' if self.length > 5 else ''}, block size "
                f"{self.block_size}, extra keys {self.extras}" + (
                    f" (the same tokens were hashed at block size(s) {before} just before)"
                    if before else ""))

    def states(self) -> list[str]:
        return ([f"{len(self.extras)} extra keys"] * (len(self.extras) > 1)
                + ["a text hashed again at another block size"] * bool(self.seed % len(_SIZES))
                + ["token ids past 100,000"] * (max(self.tokens(), default=0) > 100_000))

    def smaller(self) -> Iterator[Prompt]:
        n = self.length
        yield from numeric.fewer(self, length=sorted({x for x in (0, self.block_size, n // 2,
                                                                  n - 1) if 0 <= x < n}))


def prompt_cases(families: int = 10) -> list[Prompt]:
    """Each family's prompt at block sizes 16, 5, 3 and 2, in turn, then a long prompt."""
    out = [Prompt(len(_SIZES) * f + k, f, (9, 16, 30, 31, 47)[f % 5], bs,
                  _EXTRAS[f % len(_EXTRAS)]) for f in range(families)
           for k, bs in enumerate(_SIZES)]
    return out + [Prompt(len(out), families, 20_000, 16, ("lora-7",))]


PROMPT_CONTRASTS = (Contrast(
    lambda p: dataclasses.replace(p, extras=tuple(sorted(p.extras, key=str)))
    if tuple(sorted(p.extras, key=str)) != p.extras else None,
    "it passes when the extra keys come sorted and fails when they do not: every hash takes "
    "the request's extra keys as given, in their order"),)


@dataclass(frozen=True)
class Hit:
    """10.2: a prompt of ``num_tokens`` whose full blocks are cached as ``pattern`` says:
    ("all", 0), ("prefix", k) or ("hole", j), all but block j."""

    seed: int
    num_tokens: int
    block_size: int
    pattern: tuple[str, int]
    zero: bool = True  # one of the cached blocks is physical block 0

    def cached(self) -> dict[int, int]:
        how, k = self.pattern
        keep = [i for i in range(self.num_tokens // self.block_size) if how == "all"
                or (how == "prefix" and i < k) or (how == "hole" and i != k)]
        ids = random.Random(1002 + self.seed).sample(range(2 ** 31 - 1), len(keep))
        if ids and self.zero:
            ids[len(ids) // 3] = 0  # block 0 is a block
        return dict(zip(keep, ids, strict=True))

    def describe(self) -> str:
        how, k = self.pattern
        return (f"a prompt of {self.num_tokens:,} tokens, block size {self.block_size} "
                f"({self.num_tokens // self.block_size:,} full blocks), cached: "
                + {"all": "every full block", "prefix": f"the first {k}",
                   "hole": f"all but block {k}"}[how])

    def states(self) -> list[str]:
        return (["more than 1,000 cached blocks"] * (self.num_tokens // self.block_size > 1000
                                                     and self.pattern != ("prefix", 0))
                + ["block size 5 or 7"] * (self.block_size in (5, 7)))

    def smaller(self) -> Iterator[Hit]:
        how, k = self.pattern
        for n in (self.num_tokens // 4, self.num_tokens // 2):
            if self.block_size < n < self.num_tokens:
                yield dataclasses.replace(self, num_tokens=n,
                                          pattern=(how, min(k, n // self.block_size - 1)))


def hit_cases() -> list[Hit]:
    """Short prompts at block sizes 5, 7, 16, 1 in every pattern, then long ones."""
    cases = [(n, bs, pattern) for bs in (5, 7, 16, 1) for n in (bs, bs + 1, 3 * bs, 3 * bs + 1, 50)
             for pattern in (("all", 0), ("prefix", 1), ("hole", 0), ("hole", 2))]
    cases += [(n, bs, pattern) for n, bs in ((131_072, 16), (32_768, 16), (20_001, 5))
              for pattern in (("all", 0), ("hole", n // bs - 2))]
    return [Hit(seed, *case) for seed, case in enumerate(cases)]


HIT_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, zero=False), "it passes when no cached block "
             "is physical block 0: block 0 is a block like any other (a miss is lookup(...) "
             "is None, not a falsy answer)"),
    Contrast(lambda p: dataclasses.replace(p, num_tokens=29 * p.block_size // 4, pattern=(
        p.pattern[0], min(p.pattern[1], 5))) if p.num_tokens > 1000 else None,
             "it passes on short prompts and fails on a long one (8,192 blocks): walk the "
             "hashes in a loop, not one call deep per block (Python stops recursion at about "
             "1,000 calls)"),
)
