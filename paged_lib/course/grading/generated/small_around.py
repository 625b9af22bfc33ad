"""Generated inputs for 05.6 (slot mapping) and 05.7 (merge split-KV partials), on the
harness of :mod:`~paged_lib.course.grading.generated.numeric` (see
:mod:`~paged_lib.course.grading.generated.small_attention` for the families they leave).

05.6's fixed tables hold block ids below 8; here half the cases draw them from a pool of
``2**31 - 1`` blocks, so a slot no longer fits in 32 bits, with padding tokens anywhere
and block sizes of 1 to 32. 05.7's fixed cases have one empty segment, last, and
log-sum-exps a few units apart; here empty segments come first and several in a row, and
one segment's scores may sit 800 above the others.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from paged_lib import attention as A
from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.generated.numeric import Contrast, fewer, shorter
from paged_lib.course.grading.generated.small_attention import rng
from paged_lib.kernels import slot_mapping_from_positions

__all__ = ["Partials", "Slots", "partials_cases", "partials_stage", "slot_cases", "slot_stage"]


# ------------------------------------------------------------------ 05.6 slot_mapping


@dataclass(frozen=True)
class Slots:
    """One generated case of 05.6: ``tokens`` new tokens of ``seqs`` sequences whose tables
    have ``width`` entries, ids drawn below ``pool`` (a pool past ``2**31 / block_size``
    blocks: their slots do not fit in 32 bits)."""

    seed: int
    block_size: int
    seqs: int
    width: int
    tokens: int
    pool: int
    pads: int

    def build(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(5600 + self.seed)
        ids = torch.randint(self.pool // 2, self.pool, (self.seqs, self.width), generator=g)
        used = torch.randint(1, self.width + 1, (self.seqs,), generator=g)
        for s in range(self.seqs):
            ids[s, int(used[s]):] = -1
        seq_ids = torch.randint(0, self.seqs, (self.tokens,), generator=g)
        pos = (torch.rand(self.tokens, generator=g) * used[seq_ids] * self.block_size).long()
        pad = torch.randperm(self.tokens, generator=g)[:self.pads]
        pos[pad] = -1
        return ids.to(torch.int32), seq_ids, pos

    def describe(self) -> str:
        bt, seq_ids, pos = self.build()
        return (f"block_size {self.block_size}, block_tables {bt.tolist()}, seq_ids "
                f"{seq_ids.tolist()}, positions {pos.tolist()}"
                + (f" (block ids up to {int(bt.max()):,}: slots past 2**31)"
                   if int(bt.max()) * self.block_size >= 2 ** 31 else ""))

    def states(self) -> list[str]:
        out = ["slots past 2**31"] if self.pool * self.block_size > 2 ** 32 else []
        out += ["padding tokens among the others"] if self.pads and self.tokens > 1 else []
        out += [f"block size {self.block_size}"] if self.block_size not in (3, 4, 16) else []
        return out

    def smaller(self) -> Iterator[Slots]:
        yield from fewer(self, tokens=shorter(self.tokens), seqs=shorter(self.seqs),
                         width=shorter(self.width), pads=shorter(self.pads, 0),
                         pool=[64] if self.pool > 64 else [],
                         block_size=shorter(self.block_size))


def _draw_slots(seed: int) -> Slots:
    pick = rng(5601 + seed)
    return Slots(seed, pick([1, 3, 5, 12, 16, 32]), pick([1, 2, 3]), pick([1, 2, 4]),
                 pick([1, 4, 7]), (64, 2 ** 31 - 1)[seed % 2], pick([0, 1, 2]))


def slot_cases(count: int = 24) -> list[Slots]:
    return [_draw_slots(seed) for seed in range(count)]


def run_slots(slot_mapping: Callable, p: Slots) -> None:
    bt, seq_ids, pos = p.build()
    want = slot_mapping_from_positions(bt, seq_ids, pos, p.block_size)
    got = slot_mapping(bt.clone(), seq_ids.clone(), pos.clone(), p.block_size)
    grading.expect_true(isinstance(got, torch.Tensor),
                        f"expected a torch.Tensor, got {type(got).__name__}")
    grading.expect_true(got.dtype == torch.int64, f"expected dtype torch.int64, got {got.dtype}")
    grading.expect_equal(got.tolist(), want.tolist(), "slot_mapping",
                         hint="block_tables[seq, pos // block_size] * block_size + pos % "
                              "block_size; position -1 maps to -1")


SLOT_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, pool=64) if p.pool > 64 else None,
             "it passes with small block ids and fails with a pool of 2**31 - 1 blocks: "
             "block_tables is int32, so block * block_size wraps in 32 bits; widen first "
             "(block_tables.long()), a slot indexes num_blocks * block_size rows"),
)


def slot_stage(slot_mapping: Callable) -> None:
    """05.6's generated stage."""
    numeric.check("05.6", slot_cases(), lambda p: run_slots(slot_mapping, p), SLOT_CONTRASTS)


# ------------------------------------------------------------------ 05.7 merge_partials


@dataclass(frozen=True)
class Partials:
    """One generated case of 05.7: segments of ``segs`` keys (0: an empty segment);
    ``spike``: the segment whose scores are raised by 800 (log-sum-exps hundreds apart)."""

    seed: int
    segs: tuple[int, ...]
    d: int
    loud: float
    shift: float
    spike: int | None

    def build(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(5700 + self.seed)
        outs, lses = [], []
        for j, n in enumerate(self.segs):
            s = torch.randn(n, generator=g, dtype=torch.float64) * self.loud + self.shift
            s = s + (800.0 if j == self.spike else 0.0)
            v = torch.randn(n, self.d, generator=g, dtype=torch.float64)
            outs.append(torch.softmax(s, 0) @ v if n else torch.zeros(self.d,
                                                                      dtype=torch.float64))
            lses.append(torch.logsumexp(s, 0).item() if n else -math.inf)
        return torch.stack(outs), torch.tensor(lses, dtype=torch.float64)

    def describe(self) -> str:
        _, lse = self.build()
        where = [j for j, n in enumerate(self.segs) if n == 0]
        return (f"segments of {list(self.segs)} keys" + (f" (empty: {where})" if where else "")
                + f", head_dim {self.d}, log-sum-exps {[round(x, 3) for x in lse.tolist()]}")

    def states(self) -> list[str]:
        empty = [j for j, n in enumerate(self.segs) if n == 0]
        out = ["an empty segment first"] if self.segs[0] == 0 else []
        out += ["several empty segments"] if len(empty) > 1 else []
        out += ["log-sum-exps hundreds apart"] if self.spike is not None else []
        out += ["tiny scores"] if self.loud < 0.01 else []
        return out

    def smaller(self) -> Iterator[Partials]:
        for j in range(len(self.segs)):
            rest = self.segs[:j] + self.segs[j + 1:]
            if any(rest) and j != self.spike:
                spike = None if self.spike is None else self.spike - (j < self.spike)
                yield dataclasses.replace(self, segs=rest, spike=spike)
        yield from fewer(self, segs=[tuple(min(n, 1) for n in self.segs)], d=shorter(self.d),
                         loud=[1.0], shift=[0.0], spike=[None])


def _draw_partials(seed: int) -> Partials:
    pick = rng(5701 + seed)
    segs = tuple(pick([0, 0, 1, 3, 6]) for _ in range(pick([2, 3, 4, 5])))
    if not any(segs):
        segs = segs[:-1] + (4,)
    spike = pick([None, None] + [j for j, n in enumerate(segs) if n])
    loud, shift = pick([(3.0, 0.0), (1e-3, 0.0), (3.0, 1000.0), (3.0, -1000.0)])
    return Partials(seed, segs, pick([1, 3, 4, 8]), loud, shift, spike)


def partials_cases(count: int = 30) -> list[Partials]:
    return [_draw_partials(seed) for seed in range(count)]


def run_partials(merge_partials: Callable, p: Partials) -> None:
    out, lse = p.build()
    want = A.merge_partials(out, lse)
    got = merge_partials(out.clone(), lse.clone())
    grading.expect_true(isinstance(got, torch.Tensor),
                        f"expected a torch.Tensor, got {type(got).__name__}")
    if got.shape == want.shape and got.isnan().any():
        grading.fail("the merged output is NaN", _PARTIALS_HINT)
    grading.expect_tensor_close(got, want, "merged output", atol=1e-9, rtol=1e-9,
                                hint=_PARTIALS_HINT)


_PARTIALS_HINT = ("weight each partial by exp(lse_j - M), M the max over all segments (an "
                  "empty segment, lse = -inf, weighs 0 wherever it is), and divide by the sum "
                  "of the weights")
PARTIALS_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, segs=tuple(max(n, 1) for n in p.segs))
             if 0 in p.segs else None,
             "it passes when no segment is empty: an empty segment (lse = -inf) may come "
             "first or several in a row; subtract the max over all segments, so no "
             "difference of two -inf (NaN) is ever taken"),
    Contrast(lambda p: dataclasses.replace(p, spike=None) if p.spike is not None else None,
             "it passes with log-sum-exps a few units apart and fails when one segment's is "
             "hundreds above the others: subtract the max over all segments, not another "
             "segment's lse (exp overflows past 709)"),
)


def partials_stage(merge_partials: Callable) -> None:
    """05.7's generated stage."""
    numeric.check("05.7", partials_cases(), lambda p: run_partials(merge_partials, p),
          PARTIALS_CONTRASTS)
