"""Generated prompts for 10.1 (a prompt's block hashes), on the harness of
:mod:`~paged_lib.course.grading.generated.numeric`.

10.1's named prompts, the engine's replayed calls and the random workloads hash each text
at one block size and with at most one extra key. Here seeded prompts (token ids up to
Qwen2's vocabulary of 152,000) are hashed one after another at block sizes 2, 3, 5 and
16, with the extra keys real requests carry together (a LoRA adapter, a multimodal
input's hash, a cache salt: two or three keys, in the request's order). Each case runs
through the grader's own per-prompt check against the library's hashes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.generated.numeric import Contrast

__all__ = ["PROMPT_CONTRASTS", "Prompt", "prompt_cases", "prompt_stage"]

#: extra keys as requests carry them, in their order
_EXTRAS = [(), ("lora-7",), ("salt-9", "lora-7"), ("lora-2", "mm:3f2a", "salt-1"),
           ("mm:9c01", 4)]
_SIZES = (16, 5, 3, 2)


@dataclass(frozen=True)
class Prompt:
    """One generated case of 10.1: prompt ``family`` (its tokens and extra keys), cut to
    ``length`` tokens, hashed at ``block_size``."""

    seed: int
    family: int
    length: int
    block_size: int
    extras: tuple

    def tokens(self) -> list[int]:
        return [(7919 * t + 104_729 * self.family + 13) % 152_000 for t in range(self.length)]

    def describe(self) -> str:
        t = self.tokens()
        before = [b for b in _SIZES[:self.seed % len(_SIZES)]]
        return (f"{self.length} tokens {t[:5]}{' ...' if self.length > 5 else ''}, block size "
                f"{self.block_size}, extra keys {self.extras}"
                + (f" (the same tokens were hashed at block size(s) {before} just before)"
                   if before else ""))

    def states(self) -> list[str]:
        out = [f"{len(self.extras)} extra keys"] if len(self.extras) > 1 else []
        out += ["a text hashed again at another block size"] if self.seed % len(_SIZES) \
            else []
        out += ["token ids past 100,000"] if max(self.tokens(), default=0) > 100_000 else []
        return out

    def smaller(self) -> Iterator[Prompt]:
        n, bs = self.length, self.block_size
        yield from numeric.fewer(self, length=sorted({x for x in (0, bs, n // 2, n - 1)
                                                      if 0 <= x < n}))


def prompt_cases(families: int = 10) -> list[Prompt]:
    """Each family's prompt at block sizes 16, 5, 3 and 2, in turn (seeds 0, 1 ...)."""
    out = []
    for f in range(families):
        length = (9, 16, 30, 31, 47)[f % 5]
        out += [Prompt(len(_SIZES) * f + k, f, length, bs, _EXTRAS[f % len(_EXTRAS)])
                for k, bs in enumerate(_SIZES)]
    return out


def _in_order(p: Prompt) -> Prompt | None:
    ordered = tuple(sorted(p.extras, key=str))
    return dataclasses.replace(p, extras=ordered) if ordered != p.extras else None


PROMPT_CONTRASTS = (
    Contrast(_in_order, "it passes when the extra keys come sorted and fails when they do "
             "not: every hash takes the request's extra keys as given, in their order (each "
             "BlockHash records them, and the pool compares them on lookup)"),
)


def prompt_stage(fn: Callable, check_hashes: Callable) -> None:
    """10.1's generated stage; ``check_hashes(fn, name, tokens, block_size, extra)``: the
    grader's own per-prompt check."""
    numeric.check("10.1", prompt_cases(), lambda p: check_hashes(
        fn, "generated", p.tokens(), p.block_size, p.extras), PROMPT_CONTRASTS)
