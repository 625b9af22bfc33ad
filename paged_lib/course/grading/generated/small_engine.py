"""Generated direct inputs for the engine's small pieces: the last stage of 06.1
(``build_metadata``), on the harness of :mod:`~paged_lib.course.grading.generated.numeric`.

06.1's fixed batches, the engine's replayed calls and the random workloads of
:mod:`~paged_lib.course.grading.generated` all come from pools of a few dozen blocks, so
every slot fits in 32 bits. Here seeded batches draw block ids from a pool of
``2**31 - 1`` blocks (as int32 block tables allow: a slot then needs int64), with block
sizes that are not powers of two, chunks in the middle of a prompt (a query shorter than
the sequence, longer than one token), and decodes, full prefills and chunks in one batch.
Each batch goes through the grader's own per-batch check, which compares it with the
library's answer field by field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.generated.numeric import Contrast, fewer, shorter
from paged_lib.course.grading.generated.small_attention import rng
from paged_lib.util import cdiv

__all__ = ["Batch", "metadata_cases", "metadata_stage"]

#: a sequence's step: "decode" (one new token), "prefill" (all of them), "chunk" (some)
_KINDS = ("decode", "prefill", "chunk")


@dataclass(frozen=True)
class Batch:
    """One generated batch of 06.1: ``seqs`` as (tokens after the step, kind)."""

    seed: int
    block_size: int
    seqs: tuple[tuple[int, str], ...]
    pool: int

    def build(self) -> tuple[list[list[int]], list[int], list[int], int]:
        g = torch.Generator().manual_seed(6100 + self.seed)
        tables, seq_lens, query_lens = [], [], []
        for n, kind in self.seqs:
            used = cdiv(n, self.block_size)
            ids = torch.randint(self.pool // 2, self.pool, (used,), generator=g).tolist()
            tables.append(list(dict.fromkeys(ids)) + list(range(used - len(set(ids)))))
            seq_lens.append(n)
            query_lens.append({"decode": 1, "prefill": n, "chunk": max(1, n // 2)}[kind])
        return tables, seq_lens, query_lens, self.block_size

    def describe(self) -> str:
        tables, seq_lens, query_lens, bs = self.build()
        big = max((b for t in tables for b in t), default=0)
        return (f"block size {bs}, tables {tables}, seq_lens {seq_lens}, query_lens "
                f"{query_lens}" + (f" (block ids up to {big:,}: slots past 2**31)"
                                   if big * bs >= 2 ** 31 else ""))

    def states(self) -> list[str]:
        out = ["slots past 2**31"] if self.pool * self.block_size > 2 ** 32 else []
        out += ["a chunk in the middle of a prompt"] if any(
            k == "chunk" and n > 2 for n, k in self.seqs) else []
        out += [f"block size {self.block_size}"] if self.block_size in (5, 6, 7, 12) else []
        return out

    def smaller(self) -> Iterator[Batch]:
        for i in range(len(self.seqs)):
            if len(self.seqs) > 1:
                yield dataclasses.replace(self, seqs=self.seqs[:i] + self.seqs[i + 1:])
        for i, (n, kind) in enumerate(self.seqs):
            for m in shorter(n):
                yield dataclasses.replace(self, seqs=self.seqs[:i] + ((m, kind),)
                                          + self.seqs[i + 1:])
        yield from fewer(self, pool=[64] if self.pool > 64 else [],
                         block_size=shorter(self.block_size))


def _draw(seed: int) -> Batch:
    pick = rng(6101 + seed)
    bs = pick([1, 2, 5, 6, 7, 12, 16])
    seqs = tuple((pick([1, 2, bs, bs + 1, 3 * bs - 1, 9, 17]), pick(_KINDS))
                 for _ in range(pick([1, 2, 3, 4])))
    return Batch(seed, bs, seqs, (2 ** 31 - 1, 64)[seed % 2])


def metadata_cases(count: int = 24) -> list[Batch]:
    return [_draw(seed) for seed in range(count)]


METADATA_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, pool=64) if p.pool > 64 else None,
             "it passes with small block ids and fails with a pool of 2**31 - 1 blocks: an "
             "int32 block id times block_size wraps in 32 bits; compute slots in Python ints "
             "or int64 (block_tables.long()) before multiplying"),
)


def metadata_stage(build_metadata: Callable, check_batch: Callable) -> None:
    """06.1's generated stage; ``check_batch(fn, name, tables, seq_lens, query_lens,
    block_size)``: the grader's own per-batch check."""
    numeric.check("06.1", metadata_cases(),
                  lambda p: check_batch(build_metadata, "generated", *p.build()),
                  METADATA_CONTRASTS)
