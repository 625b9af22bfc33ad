"""Generated cases for 12.2 (published models on every ``tp_size`` that divides their query
heads) and 12.3 (seeded steps sharded as real models are: 2 to 4 ranks, GQA groups of 1
to 7, KV heads split or replicated, heads wider or narrower than ``hidden / num_heads``,
biases, blocks of 1 to 8 tokens, decodes, prefills and chunks after a prefix hit, louder
inputs); the stage's harness is :mod:`~paged_lib.course.grading.generated.numeric`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from paged_lib.course.grading.generated.numeric import Contrast, fewer, shorter
from paged_lib.parallel import tp_size_problem

# ------------------------------------------------------------------ 12.2 rank_heads

#: (query heads, KV heads) of published configurations: Llama 3 8B and 70B, Qwen2 0.5B,
#: 1.5B and 7B (groups of 7 and 6), Qwen2.5 14B (40 on 8), Phi-3 medium (40 on 10),
#: Falcon 7B (MQA, 71 heads), Gemma 7B (MHA), Mistral NeMo
_HEAD_MODELS = [(32, 8), (64, 8), (14, 2), (12, 2), (28, 4), (40, 8), (40, 10), (71, 1),
                (16, 16), (32, 8), (24, 8), (6, 1)]


@dataclass(frozen=True)
class Heads:
    """One generated case of 12.2: ``rank`` of ``tp`` ranks (vLLM may refuse the size)."""

    seed: int
    heads: int
    kv_heads: int
    tp: int
    rank: int

    def describe(self) -> str:
        ratio = (f", each KV head on {self.tp // self.kv_heads} ranks"
                 if self.tp > self.kv_heads and not self.tp % self.kv_heads else "")
        return (f"rank_heads({self.heads}, {self.kv_heads}, tp_size={self.tp}, "
                f"rank={self.rank}){ratio}")

    def states(self) -> list[str]:
        out = [f"{self.tp} ranks"] if self.tp not in (1, 2, 4, 8, 16) else []
        ratio = self.tp // self.kv_heads if self.tp > self.kv_heads else 1
        out += [f"each KV head on {ratio} ranks"] if ratio not in (1, 2, 4) else []
        return out + [f"groups of {self.heads // self.kv_heads}"] if \
            self.heads // self.kv_heads in (3, 5, 6, 7, 71) else out

    def smaller(self) -> Iterator[Heads]:
        yield from fewer(self, rank=shorter(self.rank, 0))
        for k in (2, 3, 5, 7):  # the same sharing on fewer heads (and ranks)
            for heads, kv, tp in ((self.heads // k, self.kv_heads // k, self.tp // k),
                                  (self.heads // k, self.kv_heads, self.tp),
                                  (self.heads // k, self.kv_heads // k, self.tp)):
                if heads * k == self.heads and kv and tp and self.rank < tp and (
                        (heads, kv, tp) != (self.heads, self.kv_heads, self.tp)) and (
                        not tp_size_problem(heads, kv, tp)) == (
                        not tp_size_problem(self.heads, self.kv_heads, self.tp)):
                    yield dataclasses.replace(self, heads=heads, kv_heads=kv, tp=tp)


def head_cases(count: int = 48) -> list[Heads]:
    """12.2's generated cases: published models on every size that divides their query
    heads (some refused for their KV heads), one rank each (seeds 0, 1, ...)."""
    out = []
    for seed in range(count):
        g = torch.Generator().manual_seed(1220 + seed)
        heads, kv = _HEAD_MODELS[seed % len(_HEAD_MODELS)]
        sizes = [t for t in range(1, heads + 1) if heads % t == 0]
        tp = sizes[int(torch.randint(len(sizes), (1,), generator=g))]
        out.append(Heads(seed, heads, kv, tp, int(torch.randint(tp, (1,), generator=g))))
    return out


def _power_of_two_ratio(p: Heads) -> Heads | None:
    """The same rank's place on a sharding whose replicas come in twos or fours."""
    ratio = p.tp // p.kv_heads if p.tp > p.kv_heads and not p.tp % p.kv_heads else 0
    if ratio < 3 or ratio & (ratio - 1) == 0:
        return None
    two = 1 << (ratio.bit_length() - 1)
    return dataclasses.replace(p, heads=p.heads // p.tp * p.kv_heads * two,
                               tp=p.kv_heads * two, rank=min(p.rank, p.kv_heads * two - 1))


#: a failing case that passes when each KV head sits on 2 or 4 ranks
HEAD_CONTRASTS = (Contrast(_power_of_two_ratio, (
    "it passes when each KV head sits on a power of two of ranks (2, 4) and fails when it "
    "sits on 3, 5 or 7: rank r keeps KV head r // (tp_size // num_kv_heads), a division; "
    "a shift (r >> log2(...)) or a mask is that only for powers of two")),)

# ------------------------------------------------------------------ 12.3 rank_attention

__all__ = ["HEAD_CONTRASTS", "Heads", "RANK_CONTRASTS", "Rank", "head_cases", "rank_cases"]

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
        """The states of this step that the named steps of 12.3 do not have."""
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
    Contrast(lambda p: dataclasses.replace(p, tp=4, heads=p.heads // p.tp * 4)
             if p.kv_heads == 1 and p.tp == 3 else None,
             "it passes on 4 ranks for one KV head and fails on 3: rank r keeps KV head "
             "r // (tp_size // num_kv_heads), a division; a shift (r >> log2(...)) or a "
             "mask is that only when each KV head sits on 2 or 4 ranks"),
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
