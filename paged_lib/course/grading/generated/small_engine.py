"""Generated direct inputs for 06.1 (``build_metadata``) and 06.2 (``num_required_blocks``),
on the harness of :mod:`~paged_lib.course.grading.generated.numeric`.

06.1: seeded batches whose block ids come from a pool of ``2**31 - 1`` blocks (int32
tables, int64 slots), block sizes that are not powers of two, chunks in the middle of a
prompt, and decodes, prefills and chunks in one batch, each through the grader's own
per-batch check. 06.2: waiting groups, fresh (``n`` samples to come) or preempted by
recompute, with up to six live samples whose first generated tokens may agree, finished
ones anywhere, one-token prompts, block sizes 1 to 16; a wrong count is named by the
grader's rule namer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.generated.numeric import Contrast, fewer, shorter
from paged_lib.course.grading.generated.small_attention import rng
from paged_lib.engine.block_manager import num_required_blocks
from paged_lib.engine.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from paged_lib.util import cdiv

__all__ = ["Batch", "Waiting", "metadata_cases", "metadata_stage", "required_cases",
           "required_stage"]

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


# ------------------------------------------------------------------ 06.2 num_required_blocks


@dataclass(frozen=True)
class Waiting:
    """One generated waiting group of 06.2: a prompt of ``prompt`` tokens and one sequence
    per entry of ``tails`` (tokens it generated; ``(0,)``: a fresh request of ``n``
    samples); ``finished``: which are done; ``agree``: how many leading generated tokens
    every sequence shares."""

    seed: int
    block_size: int
    prompt: int
    tails: tuple[int, ...]
    finished: tuple[int, ...]
    agree: int
    n: int

    def build(self) -> SequenceGroup:
        prompt = [(7 * t + 3) % 251 for t in range(self.prompt)]
        seqs = [Sequence(i, list(prompt), [(5 + t) % 251 if t < self.agree else
                                           (11 * i + 13 * t + 1) % 251 for t in range(k)])
                for i, k in enumerate(self.tails)]
        for i in self.finished:
            seqs[i].status = SequenceStatus.FINISHED
        return SequenceGroup(0, seqs, SamplingParams(max_tokens=64, n=self.n, temperature=(
            1.0 if self.n > 1 else 0.0)))

    def describe(self) -> str:
        live = [k for i, k in enumerate(self.tails) if i not in self.finished]
        if self.tails == (0,):
            return (f"a fresh request of n={self.n}, prompt of {self.prompt} (block size "
                    f"{self.block_size})")
        return (f"{len(live)} live sequence(s) preempted by recompute, prompt of "
                f"{self.prompt}, tails {live}" + (f", {len(self.finished)} finished"
                                                  if self.finished else "")
                + (f", the first {self.agree} generated tokens the same in every sequence"
                   if self.agree else "") + f" (block size {self.block_size})")

    def states(self) -> list[str]:
        live = len(self.tails) - len(self.finished)
        out = ["samples that agree"] if self.agree and live > 1 else []
        out += [f"{live} live sequences"] if live > 4 else []
        out += [f"block size {self.block_size}"] if self.block_size in (3, 5, 7) else []
        out += ["a one-token prompt"] if self.prompt == 1 else []
        return out

    def smaller(self) -> Iterator[Waiting]:
        yield from fewer(self, finished=[()] if self.finished else [])
        for i in range(len(self.tails)):
            if len(self.tails) > 2 and i not in self.finished:
                fin = tuple(j - (j > i) for j in self.finished)
                yield dataclasses.replace(self, tails=self.tails[:i] + self.tails[i + 1:],
                                          finished=fin, n=max(1, self.n - 1))
        for i, k in enumerate(self.tails):
            for m in shorter(k) if self.tails != (0,) else []:
                yield dataclasses.replace(self, tails=self.tails[:i] + (m,) + self.tails[i + 1:],
                                          agree=min(self.agree, m))
        yield from fewer(self, prompt=shorter(self.prompt), agree=shorter(self.agree, 0))


def _draw_waiting(seed: int) -> Waiting:
    pick = rng(6201 + seed)
    bs = pick([1, 3, 4, 5, 7, 16])
    prompt = pick([1, bs - 1 or 1, bs, bs + 1, 2 * bs + 3, 13])
    if seed % 5 == 4:
        return Waiting(seed, bs, prompt, (0,), (), 0, pick([1, 2, 4, 8]))
    tails = tuple(pick([1, 2, bs, 2 * bs + 1, 9]) for _ in range(pick([1, 2, 3, 4, 6])))
    finished = tuple(sorted({pick(range(len(tails))) for _ in range(pick([0, 0, 1, 2]))}))
    if len(finished) == len(tails):
        finished = finished[1:]
    agree = min(pick([0, 1, bs, 9]), min(tails))
    return Waiting(seed, bs, prompt, tails, finished, agree, len(tails))


def required_cases(count: int = 30) -> list[Waiting]:
    return [_draw_waiting(seed) for seed in range(count)]


def run_required(fn: Callable, name_rule: Callable, p: Waiting) -> None:
    group = p.build()
    want = num_required_blocks(group, p.block_size)
    got = fn(group, p.block_size)
    grading.expect_int(got, "blocks")
    grading.expect_true([s.num_tokens for s in group.seqs] == [p.prompt + k for k in p.tails],
                        "your function changed the group",
                        "only count: the scheduler allocates after admission")
    if got != want:
        grading.fail(f"expected {want} blocks, got {got}", name_rule(group, p.block_size, got))


REQUIRED_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, agree=0) if p.agree else None,
             "it passes when the samples' outputs differ from their first token and fails "
             "when they agree: only the prompt is prefilled once and shared; every sequence "
             "appends its own generated tokens into its own blocks, even the ones it has in "
             "common with the others"),
)


def required_stage(fn: Callable, name_rule: Callable) -> None:
    """06.2's generated stage; ``name_rule(group, block_size, got)``: the grader's hint."""
    numeric.check("06.2", required_cases(), lambda p: run_required(fn, name_rule, p),
                  REQUIRED_CONTRASTS)
