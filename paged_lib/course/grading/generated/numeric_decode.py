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
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from paged_lib.course.grading.generated.numeric import Contrast, fewer, shorter
from paged_lib.kernels.cases import NAN_BLOCK, make_decode_case
from paged_lib.util import cdiv

__all__ = ["DECODE_CONTRASTS", "Decode", "decode_cases"]

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
