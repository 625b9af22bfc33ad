"""Generated steps for 12.3, one rank's attention (the stage's harness:
:mod:`~paged_lib.course.grading.generated.numeric`).

12.3's fixed steps stay inside one family: 2 or 4 ranks, a hidden size of 32 that is
``num_heads x head_dim`` in most of them, heads of 8, blocks of 4, at most 10 tokens a
sequence, inputs a few units large. Here seeded steps are drawn from the ways real models
are sharded: 2, 3 and 4 ranks; GQA groups of 1 to 7, KV heads split or replicated
(Llama 3 8B's 8 KV heads on 16 ranks, Falcon's one on every rank); heads wider or narrower
than ``hidden / num_heads`` (Gemma); biases on q, k, v and o (Qwen2); blocks of 1 to 8
tokens, not only powers of two; decodes after up to 30 cached tokens, prefills from an
empty cache and chunks after a prefix hit in one step; inputs up to 4x louder. Each step
is checked as the fixed ones are (every rank's output against the single-device layer,
its cache against the library rank's), and a failing one is shrunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from paged_lib.course.grading.generated.numeric import Contrast, fewer, shorter
from paged_lib.parallel import tp_size_problem

__all__ = ["RANK_CONTRASTS", "Rank", "rank_cases"]

#: (ranks, query heads, KV heads), as models shard: split KV heads, replicated ones (more
#: ranks than KV heads), MHA, MQA, groups of 3 and 7
_SHARDS = [(2, 4, 2), (2, 6, 2), (2, 14, 2), (2, 4, 4), (2, 2, 1), (3, 6, 3), (3, 3, 1),
           (3, 12, 3), (3, 6, 1), (4, 8, 2), (4, 4, 1), (4, 8, 4), (4, 16, 8), (4, 12, 4)]


@dataclass(frozen=True)
class Rank:
    """One generated step of 12.3."""

    seed: int
    tp: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    block_size: int
    lens: tuple[tuple[int, int], ...]  # (cached, new) per sequence
    bias: bool
    loud: float

    def describe(self) -> str:
        kv = (f"{self.kv_heads} KV heads, {self.kv_heads // self.tp} per rank"
              if self.kv_heads >= self.tp else
              f"{self.kv_heads} KV head(s), each on {self.tp // self.kv_heads} ranks")
        return (f"{self.tp} ranks, {self.heads} query heads on {kv}, head_dim "
                f"{self.head_dim} with hidden {self.hidden} ("
                + ("=" if self.heads * self.head_dim == self.hidden else "!=")
                + f" heads x head_dim), blocks of {self.block_size}, sequences (cached, new) "
                f"{list(self.lens)}" + (", biases on q, k, v and o" if self.bias else "")
                + (f", inputs x {self.loud:g}" if self.loud != 1 else ""))

    def states(self) -> list[str]:
        """The states of this step that no fixed step of 12.3 has."""
        out = [f"{self.tp} ranks"] if self.tp == 3 else []
        group = self.heads // self.kv_heads
        out += [f"GQA groups of {group}"] if group not in (1, 2, 4, 8) else []
        out += [f"hidden {self.hidden}"] if self.hidden != 32 else []
        out += [f"head_dim {self.head_dim}"] if self.head_dim != 8 else []
        out += [f"blocks of {self.block_size}"] if self.block_size != 4 else []
        out += ["a sequence over 10 tokens"] if max(c + n for c, n in self.lens) > 10 else []
        out += ["louder inputs"] if self.loud > 1 else []
        return out

    def smaller(self) -> Iterator[Rank]:
        lens = self.lens
        for i, (cached, new) in enumerate(lens):
            if len(lens) > 1:
                yield dataclasses.replace(self, lens=lens[:i] + lens[i + 1:])
            for c in shorter(cached, 0):
                yield dataclasses.replace(self, lens=lens[:i] + ((c, new),) + lens[i + 1:])
            for n in shorter(new):
                yield dataclasses.replace(self, lens=lens[:i] + ((cached, n),) + lens[i + 1:])
        for tp, heads, kv in _SHARDS:
            if (heads, kv) < (self.heads, self.kv_heads) and tp <= self.tp:
                yield dataclasses.replace(self, tp=tp, heads=heads, kv_heads=kv)
        yield from fewer(self, bias=[False], loud=[1.0], block_size=[4],
                         head_dim=[d for d in (4, 8) if d < self.head_dim])


def _draw(seed: int) -> Rank:
    g = torch.Generator().manual_seed(1230 + seed)

    def pick(xs: list | tuple):
        return xs[int(torch.randint(len(xs), (1,), generator=g))]

    tp, heads, kv = pick(_SHARDS)
    d = pick([4, 6, 8, 10, 12, 16])
    hidden = pick([heads * d, 24, 40, 48])
    lens = []
    for _ in range(pick([1, 2, 3])):
        kind = pick(["decode", "decode", "prefill", "chunk"])
        cached = 0 if kind == "prefill" else pick([1, 3, 4, 8, 15, 16, 30])
        lens.append((cached, 1 if kind == "decode" else pick([1, 2, 5, 8])))
    return Rank(seed, tp, heads, kv, d, hidden, (1, 2, 3, 4, 5, 8)[seed % 6], tuple(lens),
                seed % 4 == 1, (1.0, 1.0, 4.0)[seed % 3])


def rank_cases(count: int = 24) -> list[Rank]:
    """12.3's generated steps (seeds 0, 1, ...), every one a sharding that exists."""
    out = [_draw(seed) for seed in range(count)]
    assert not any(tp_size_problem(p.heads, p.kv_heads, p.tp) for p in out)
    return out


RANK_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, hidden=p.heads * p.head_dim)
             if p.hidden != p.heads * p.head_dim else None,
             "it passes when hidden == num_heads x head_dim and fails otherwise: a rank's "
             "rows of q, k and v and its columns of o are its heads x head_dim, counted in "
             "head_dim (w.head_dim), not hidden / num_heads or hidden / tp (Gemma's heads "
             "are wider than hidden / num_heads)"),
    Contrast(lambda p: dataclasses.replace(p, block_size=4) if p.block_size != 4 else None,
             "it passes with blocks of 4 and fails with other block sizes: read the block "
             "size from the cache (its dimension 1) and the slots from meta.slot_mapping"),
    Contrast(lambda p: dataclasses.replace(p, tp=2, heads=4, kv_heads=2)
             if (p.tp, p.heads, p.kv_heads) != (2, 4, 2) else None,
             "it passes on 2 ranks with 4 query heads and 2 KV heads and fails on this "
             "sharding: a rank owns num_heads / tp contiguous query heads, and the KV heads "
             "they read: num_kv_heads / tp of them, or with fewer KV heads than ranks the "
             "one KV head r // (tp / num_kv_heads)"),
)
