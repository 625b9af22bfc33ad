"""Checks for chapter 06 (the serving engine), each against the library's function: 06.1
``build_metadata``, 06.2 ``num_required_blocks``, 06.3 ``can_admit`` (each limit's boundary)
and 06.4 ``schedule_waiting`` next to the library's (:mod:`.scheduler_loops`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from paged_lib.course import grading
from paged_lib.course.grading import generated
from paged_lib.course.grading import scheduler_loops as loops
from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.generated.numeric import Contrast, fewer, shorter
from paged_lib.course.grading.generated.small_attention import rng
from paged_lib.course.grading.scheduler_loops import Scenario
from paged_lib.engine.block_manager import num_required_blocks as lib_required
from paged_lib.engine.model_runner import build_metadata as lib_build_metadata
from paged_lib.engine.policy import Budget, seqs_to_come
from paged_lib.engine.policy import can_admit as lib_can_admit
from paged_lib.engine.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from paged_lib.model import AttentionMetadata
from paged_lib.util import cdiv

# ------------------------------------------------------------------ 06.1 build_metadata

#: the spec's example: a decode of 6 tokens over blocks [7, 2] next to a 3-token prefill
_SPEC_BATCH = ([[7, 2], [5]], [6, 3], [1, 3], 4)

_DTYPES = {"slot_mapping": torch.int64, "block_tables": torch.int32, "seq_lens": torch.int32,
           "query_lens": torch.int32, "positions": torch.int64}
_DTYPE_HINTS = {
    "slot_mapping": "slot_mapping is int64: block * block_size + offset outgrows int32 in a "
                    "large pool (vLLM uses int64 too)",
    "positions": "positions are int64 (they index the rotary embedding table)",
}


def check_build_metadata(build_metadata: Callable[..., Any]) -> None:
    """``build_metadata(block_tables, seq_lens, query_lens, block_size) -> AttentionMetadata``."""
    with grading.exercise("06.1"):
        _check_batch(build_metadata, "the spec's example", *_SPEC_BATCH)
        numeric.check("06.1", metadata_cases(),
                      lambda p: _check_batch(build_metadata, "generated", *p.build()),
                      (_SMALL_IDS,))
        generated.check("build_metadata", build_metadata, "every new token's slot is its "
                        "position's block in the table, at position % block_size")


def _check_batch(fn, name, tables, seq_lens, query_lens, block_size) -> None:
    given = [list(t) for t in tables]
    got = fn(given, list(seq_lens), list(query_lens), block_size)
    want = lib_build_metadata(tables, seq_lens, query_lens, block_size)
    where = f"batch '{name}'"
    if given != tables:
        grading.fail(f"{where}: your function changed the block tables it was given "
                     f"({tables} became {given})",
                     "the lists are the sequences' own tables: build new padded rows "
                     "instead of appending -1 to them")
    grading.expect_true(isinstance(got, AttentionMetadata),
                        f"{where}: expected an AttentionMetadata, got {type(got).__name__}",
                        "return AttentionMetadata(slot_mapping=..., block_tables=..., "
                        "seq_lens=..., query_lens=..., positions=...)")
    for field, dtype in _DTYPES.items():
        value = getattr(got, field)
        grading.expect_true(isinstance(value, torch.Tensor),
                            f"{where}: {field} is a {type(value).__name__}, not a tensor",
                            f"make {field} a torch tensor of dtype {dtype}")
        grading.expect_true(value.dtype == dtype,
                            f"{where}: {field} has dtype {value.dtype}, expected {dtype}",
                            _DTYPE_HINTS.get(field, f"{field} is {dtype}, the dtype the "
                                             "kernels take"))
    _check_block_tables(got.block_tables, want.block_tables, where)
    _check_slots(got, want, tables, seq_lens, query_lens, block_size, where)
    for field in ("seq_lens", "query_lens"):
        grading.expect_equal(getattr(got, field).tolist(), getattr(want, field).tolist(),
                             f"{where}: {field}", "seq_lens[s] (the tokens in the cache after "
                             "this step) and query_lens[s] (its new tokens): the values given")


def _check_block_tables(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    if tuple(got.shape) != tuple(want.shape):
        grading.fail(f"{where}: block_tables has shape {tuple(got.shape)}, expected "
                     f"{tuple(want.shape)}",
                     "one row per sequence, as wide as the longest table (no wider)")
    if torch.equal(got, want):
        return
    pad = want == -1
    if pad.any() and torch.equal(got[~pad], want[~pad]):
        filler = sorted({int(v) for v in got[pad].tolist()})
        grading.fail(f"{where}: block_tables pads short rows with {filler}, expected -1",
                     "pad with -1, never with a block id such as 0: block 0 may belong to "
                     "another sequence, and -1 can never be allocated")
    grading.fail(f"{where}: block_tables is {got.tolist()}, expected {want.tolist()}",
                 "row s is the sequence's own table, in logical order, then -1 padding")


def _check_slots(got, want, tables, seq_lens, query_lens, bs, where) -> None:
    slots, wslots, wpos = (t.tolist() for t in (got.slot_mapping, want.slot_mapping,
                                                 want.positions))
    if len(slots) != len(wslots):
        grading.fail(f"{where}: slot_mapping has {len(slots)} entries, expected {len(wslots)}",
                     "only the new tokens get a slot: the last query_lens[s] positions of "
                     "sequence s (earlier tokens are in the cache already)"
                     if len(slots) == sum(seq_lens) else "one slot per new token, sequences "
                     "packed back to back: sum(query_lens)")
    if slots != wslots:
        k = next(i for i, (a, b) in enumerate(zip(slots, wslots, strict=True)) if a != b)
        seqs = list(zip(tables, seq_lens, query_lens, strict=True))
        mistakes = (  # (the slots a typical mistake gives, its hint)
            (wpos, "slot = block * block_size + offset with the *physical* block: look it up "
             "in the sequence's table (position // block_size is only the logical block)"),
            ([t[p // bs] * bs + p for t, n, q in seqs for p in range(n - q, n)],
             "the offset inside the block is position % block_size, not the position"),
            ([t[p // bs] * bs + p % bs for t, _, q in seqs for p in range(q)],
             "the tokens a step computes are each sequence's newest: the ones before them "
             "are in the cache already (a decode's one token is its last, at position "
             "seq_lens[s] - 1, not 0)"))
        grading.fail(f"{where}: slot_mapping[{k}] is {slots[k]}, expected {wslots[k]} "
                     f"(token at position {wpos[k]})", next((
                         hint for wrong, hint in mistakes if slots == wrong), "token at "
                         "position p of sequence s: physical block "
                         "block_tables[s][p // block_size], offset p % block_size"))
    grading.expect_equal(got.positions.tolist(), wpos, f"{where}: positions",
                         "the new tokens of sequence s sit at positions "
                         "seq_lens[s] - query_lens[s] ... seq_lens[s] - 1")


@dataclass(frozen=True)
class Batch:
    """A generated batch of 06.1: ``seqs`` as (tokens after the step, "decode", "prefill"
    or "chunk"), block ids drawn from the top half of a pool of ``pool`` blocks."""

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
        return numeric.reached(("slots past 2**31", self.pool * self.block_size > 2 ** 32),
                               ("a chunk in the middle of a prompt",
                                any(k == "chunk" and n > 2 for n, k in self.seqs)),
                               (f"block size {self.block_size}", self.block_size in (5, 6, 7, 12)))

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


def _draw_batch(seed: int) -> Batch:
    pick = rng(6101 + seed)
    bs = pick([1, 2, 5, 6, 7, 12, 16])
    seqs = tuple((pick([1, 2, bs, bs + 1, 3 * bs - 1, 9, 17]), pick(("decode", "prefill", "chunk")))
                 for _ in range(pick([1, 2, 3, 4])))
    return Batch(seed, bs, seqs, (2 ** 31 - 1, 64)[seed % 2])


def metadata_cases(count: int = 24) -> list[Batch]:
    return [_draw_batch(seed) for seed in range(count)]


_SMALL_IDS = Contrast(
    lambda p: dataclasses.replace(p, pool=64) if p.pool > 64 else None,
    "it passes with small block ids and fails with a pool of 2**31 - 1 blocks: an int32 "
    "block id times block_size wraps in 32 bits; compute slots in Python ints or int64 "
    "(block_tables.long()) before multiplying")


# ------------------------------------------------------------------ 06.2 num_required_blocks

def check_num_required_blocks(num_required_blocks: Callable[..., Any]) -> None:
    """``num_required_blocks(group, block_size) -> int``."""
    with grading.exercise("06.2"):
        numeric.check("06.2", required_cases(), lambda p: _check_waiting(
            num_required_blocks, p), _REQUIRED_CONTRASTS)
        generated.check("num_required_blocks", num_required_blocks, _REQUIRED_RULE)


_REQUIRED_RULE = ("a fresh request: its prompt's blocks; a single sequence: its whole text's; "
                  "a group of several: the prompt once, each tail's blocks past it, and the "
                  "part-filled prompt block's copies")


def _check_waiting(fn: Callable[..., Any], p: Waiting) -> None:
    group = p.build()
    want, got = lib_required(group, p.block_size), fn(group, p.block_size)
    grading.expect_int(got, "blocks")
    grading.expect_true([s.num_tokens for s in group.seqs] == [p.prompt + k for k in p.tails],
                        "your function changed the group",
                        "only count: the scheduler allocates after admission")
    if got != want:  # a part-filled prompt block's copies counted wrong, or the rule
        copies = {want - _live(p) + 1: "forgot the copy-on-write of the part-filled last "
                  "prompt block: every sequence that writes its tail into it copies it first "
                  "(all but the last one holding it)", want + 1: "one copy too many: the "
                  "last sequence to write into the shared part-filled prompt block finds it "
                  "no longer shared and writes in place (copies = sequences - 1)"}
        named = copies.get(got) if _live(p) > 1 and p.prompt % p.block_size else None
        grading.fail(f"expected {want} blocks, got {got}", named or _REQUIRED_RULE)


@dataclass(frozen=True)
class Waiting:
    """A generated waiting group of 06.2: a prompt of ``prompt`` tokens and one sequence per
    entry of ``tails`` (tokens it generated; ``(0,)``: a fresh request of ``n`` samples);
    ``finished``: which are done; ``agree``: how many leading generated tokens every
    sequence shares."""

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
        live = _live(self)
        return numeric.reached(("samples that agree", self.agree and live > 1),
                               (f"{live} live sequences", live > 4),
                               (f"block size {self.block_size}", self.block_size in (3, 5, 7)),
                               ("a one-token prompt", self.prompt == 1))

    def smaller(self) -> Iterator[Waiting]:
        yield from fewer(self, finished=[()] if self.finished else [])
        for i in range(len(self.tails)):
            if len(self.tails) > 2 and i not in self.finished and _live(self) > 1:
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


def _live(p: Waiting) -> int:
    return len(p.tails) - len(p.finished)


#: Each undoes one feature of a failing group; the first that makes the answer pass names
#: the rule (a part-filled prompt block's copies, counted wrong, are named by the check).
_REQUIRED_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, agree=0) if p.agree else None,
             "it passes when the samples' outputs differ from their first token and fails "
             "when they agree: only the prompt is prefilled once and shared; every sequence "
             "appends its own generated tokens into its own blocks, even the ones it has in "
             "common with the others"),
    Contrast(lambda p: dataclasses.replace(p, finished=()) if p.finished else None,
             "finished sequences take no blocks: count only group.live_seqs()"),
    Contrast(lambda p: dataclasses.replace(p, n=1) if p.tails == (0,) else None,
             "a fresh group prefills its prompt once, in one sequence: its n samples fork it "
             "afterwards and share those blocks, so the prompt's blocks count once, not once "
             "per sample"),
    Contrast(lambda p: dataclasses.replace(p, block_size=1) if _live(p) == 1 else None,
             "the partly filled last block counts too: ceil(tokens / block_size), in integers, "
             "over the whole text at once (the first generated tokens fill the prompt's last "
             "block: not the prompt's blocks plus the outputs' blocks)"),
    Contrast(lambda p: dataclasses.replace(p, tails=(0,), finished=(), agree=0, n=1)
             if _live(p) == 1 and p.tails != (0,) else None,
             "a sequence preempted by recompute prefills its whole text again: the prompt "
             "*and* the tokens it generated need blocks"),
    Contrast(lambda p: dataclasses.replace(p, prompt=p.block_size - 1)
             if _live(p) > 1 and p.prompt >= p.block_size > 1 else None,
             "a group preempted by recompute gets its prompt back once, shared by all its "
             "sequences: count the prompt's blocks once, then each sequence's own tail"),
    Contrast(lambda p: _equal_tails(p), "it passes when the live sequences' tails are equally "
             "long and fails when they are not: count each live sequence's blocks by its own "
             "num_tokens, not by one sequence's"),
)


def _equal_tails(p: Waiting) -> Waiting | None:
    live = [k for i, k in enumerate(p.tails) if i not in p.finished]
    if len(set(live)) < 2:
        return None
    tails = tuple(k if i in p.finished else live[0] for i, k in enumerate(p.tails))
    return dataclasses.replace(p, tails=tails, agree=min(p.agree, live[0]))


# ------------------------------------------------------------------ 06.3 can_admit

def _budget(free, watermark=0, num_seqs=0, max_num_seqs=256, tokens=0, max_tokens=4096):
    return Budget(free, watermark, num_seqs, max_num_seqs, tokens, max_tokens)


#: The spec's example step: 20 free, watermark 2, 5 decodes (5 tokens) of 8 / 512.
_SPEC = dict(free=20, watermark=2, num_seqs=5, max_num_seqs=8, tokens=5, max_tokens=512)

#: (what, blocks_needed, num_seqs, num_tokens, budget, hint if the answer is wrong)
_ADMISSION_CASES = [
    ("the spec's example: a request of 100 tokens needing 13 blocks", 13, 1, 100,
     _budget(**_SPEC), "a group whose blocks leave the watermark free and that keeps the step "
     "within both limits joins"),
    ("the spec's example: the same request with n=4 samples", 13, 4, 100, _budget(**_SPEC),
     "the step already holds 5 sequences and the group brings 4 (its samples run together): 9, "
     "past max_num_seqs of 8"),
    ("the spec's example: a request needing 19 blocks", 19, 1, 100, _budget(**_SPEC),
     "after taking 19 of the 20 free blocks only 1 stays free, less than the watermark of 2: "
     "admission never takes the watermark's blocks"),
    ("10 free, watermark 1, the step holds 3 decodes, a group needing 9 (exactly the "
     "watermark stays free)", 9, 1, 70, _budget(10, 1, num_seqs=3, tokens=3),
     "off by one at the watermark: leaving exactly watermark_blocks free is allowed"),
    ("an empty step (nothing running), 10 free, watermark 1, a group needing 10", 10, 1, 70,
     _budget(10, 1), "the watermark holds in an empty step too: can_admit never lets a group "
     "into it (letting a lone request that needs the whole pool in is the admission loop's "
     "decision, exercise 06.4)"),
    ("10 free, watermark 1, a group of 4 samples needing 7 blocks", 7, 4, 30, _budget(10, 1),
     "blocks_needed already counts the whole group (exercise 06.2), and the watermark is "
     "kept once for the pool: neither grows with the group's sequences"),
    ("max_num_seqs 4, the step holds 3, a group of 1", 2, 1, 10,
     _budget(50, 1, num_seqs=3, max_num_seqs=4),
     "reaching max_num_seqs exactly is allowed: that step is the one vLLM profiled"),
    ("max_num_seqs 4, the step holds 2, a group of 3 samples", 2, 3, 10,
     _budget(50, 1, num_seqs=2, max_num_seqs=4),
     "a group brings num_seqs sequences (all its samples run together), not 1"),
    ("max_num_batched_tokens 100, the step holds 60, 40 more", 5, 1, 40,
     _budget(50, 1, tokens=60, max_tokens=100), "reaching max_num_batched_tokens exactly is "
     "allowed: that step is the one vLLM profiled"),
    ("max_num_batched_tokens 100, the step holds 60, 41 more", 5, 1, 41,
     _budget(50, 1, tokens=60, max_tokens=100), "the step already holds 60 tokens: 41 more "
     "make 101, past max_num_batched_tokens of 100"),
    ("max_num_batched_tokens 100, the step holds 60, a group of 4 samples with a "
     "30-token prompt", 3, 4, 30, _budget(50, 1, tokens=60, max_tokens=100),
     "num_tokens is what the group computes this step: its samples fork the prompt after "
     "one prefill, they do not each compute it"),
]


def check_can_admit(can_admit: Callable[..., Any]) -> None:
    """``can_admit(blocks_needed, num_seqs, num_tokens, budget) -> bool``."""
    with grading.exercise("06.3"):
        for what, need, seqs, tokens, budget, hint in _ADMISSION_CASES:
            want, got = (f(need, seqs, tokens, budget) for f in (lib_can_admit, can_admit))
            grading.expect_true(isinstance(got, bool | np.bool_), f"case '{what}': returned "
                                f"{got!r}, expected a bool", "return True or False (a "
                                "comparison's result), not a number or None")
            grading.expect_equal(got, want, f"case '{what}' with {budget}", hint)
        generated.check("can_admit", can_admit, "after its blocks at least watermark_blocks "
                        "stay free, and the step's sequences and tokens (those already in "
                        "it, decodes included, plus the group's) stay within their maximums")


# ------------------------------------------------------------------ 06.4 schedule_waiting

def _snapshot(waiting, step) -> SimpleNamespace:
    """What ``schedule_waiting`` saw: the first four waiting groups and the step's budget."""
    heads = []
    for g in list(waiting)[:4]:
        tokens = step.prefill_tokens(g)
        chunk = min(tokens, step.tokens_left) if step.chunked_prefill else tokens
        heads.append(SimpleNamespace(rid=g.request_id, seqs=seqs_to_come(g), n=g.params.num_seqs,
                                     tokens=tokens, chunk=chunk,
                                     need=step.blocks_needed(g, chunk) if chunk > 0 else 0))
    return SimpleNamespace(
        heads=heads, num_waiting=len(waiting), free=step.free_blocks,
        watermark=step.watermark_blocks, tokens_left=step.tokens_left,
        max_tokens=step.max_num_batched_tokens, num_seqs=step.num_seqs,
        max_num_seqs=step.max_num_seqs, swapped=len(step.swapped),
        preempted=step.num_preempted, empty=step.is_empty(), running=len(step.running),
        chunked=step.chunked_prefill, prefill_first=step.prefill_first)


def _decide(args, before, result) -> tuple:
    return tuple((g.request_id, args[1].tokens_scheduled(g))
                 for g in args[1].admitted[before[0]:])


def _describe(st: SimpleNamespace) -> str:
    queue = "waiting " + ", ".join(
        f"request {h.rid} (" + (f"{h.seqs} of its {h.n} sequences live, {h.n - h.seqs} "
                                "finished" if h.seqs < h.n else f"{h.seqs} sequence(s)")
        + f", {h.tokens} tokens to prefill" + (f", {h.chunk} of them now" if h.chunk !=
                                               h.tokens else "")
        + f", {h.need} blocks)" for h in st.heads) + (
        f" and {st.num_waiting - len(st.heads)} more" if st.num_waiting > 4 else "")
    return "; ".join([
        queue if st.heads else "nobody waiting", f"{st.free} free blocks (watermark "
        f"{st.watermark})", f"{st.tokens_left} of {st.max_tokens} tokens left",
        f"{st.num_seqs} of {st.max_num_seqs} sequences running",
        f"{st.swapped} group(s) swapped out" if st.swapped else "nothing swapped out",
        f"{st.preempted} group(s) preempted this step" if st.preempted else
        "nobody preempted this step",
        "nothing scheduled yet" if st.empty else "others already scheduled"]
        + ["chunked prefill on"] * st.chunked
        + [f"prefill_first, {st.running} group(s) running"] * st.prefill_first)


def _show(decision) -> str:
    return "admits " + (", ".join(f"request {r} ({t} tokens)" for r, t in decision) or "nobody")


def _why(st: SimpleNamespace, lib, got) -> str:
    if isinstance(got, Exception):
        return _WHY["raise"] if "admit(" in str(got) else \
            "the state above is the one your code met: follow it by hand"
    i = next((k for k, (a, b) in enumerate(zip(lib, got, strict=False)) if a != b),
             min(len(lib), len(got)))
    free, left, seqs = st.free, st.tokens_left, st.num_seqs
    for h in st.heads[:i]:
        free, left, seqs = free - h.need, left - h.chunk, seqs + h.seqs
    more, h = len(got) > len(lib) == i, st.heads[i] if i < len(st.heads) else None
    alone, busy = st.empty and i == 0, st.prefill_first and st.running
    rules = ((more and st.swapped, "swapped"), (more and st.preempted, "preempted"),
             (h is None, "admission"), (i < len(got) and h and got[i][0] != h.rid, "hol"),
             (i < len(got) and i < len(lib), "chunk"))
    if h is not None and more:
        rules += ((st.chunked and (left < 1 or got[i][1] != h.chunk), "chunk"),
                  (h.need > free, "blocks"),
                  (alone and busy, "alone"), (free - h.need < st.watermark and not alone,
                                              "watermark"),
                  (seqs + h.seqs > st.max_num_seqs, "seqs"), (h.chunk > left, "tokens"))
    elif h is not None:
        only_alone = free - h.need < st.watermark or seqs + h.seqs > st.max_num_seqs
        rules += ((h.seqs < h.n and seqs + h.seqs <= st.max_num_seqs < seqs + h.n, "seqs"),
                  (alone and not busy and h.need <= free and h.chunk <= left and only_alone,
                   "alone"),
                  (st.chunked and (lib[i][1] < h.tokens or h.chunk == 1 <= left), "chunk"),
                  (alone and not busy and h.need <= free and h.chunk <= left, "alone"),
                  (free - h.need == st.watermark, "watermark"), (h.chunk == left, "tokens"),
                  (seqs + h.seqs == st.max_num_seqs, "seqs"))
    return _WHY[next((rule for cond, rule in rules if cond), "admission")]


#: one hint per rule of admission, whichever way the answer broke it
_WHY = {
    "raise": "step.admit(group, num_tokens) takes the group out of waiting itself: call it "
             "for the head of waiting, with 1 to step.prefill_tokens(group) tokens, asked when it "
             "is the head (a group admitted just before it may have cached its prompt's prefix)",
    "swapped": "groups are swapped out: they come back first, and nobody new is admitted "
               "while any is swapped (their blocks would be taken)",
    "preempted": "this step preempted a group: as in vLLM v1, a step that preempts admits "
                 "nobody (the victim would be readmitted at once)",
    "hol": "head-of-line blocking: the head of waiting is considered first, and the first "
           "group that does not fit stops admission; nobody behind it may overtake it "
           "(first come, first served)",
    "chunk": "the tokens it brings: its whole prefill (step.prefill_tokens), or with chunked "
             "prefill a first chunk of min(tokens, step.tokens_left), and the blocks are the "
             "chunk's (step.blocks_needed(group, chunk)), never shrunk to fit the free blocks; one "
             "token is still a chunk: admission stops only when no token is left",
    "blocks": "its blocks are not free: a group never joins without its blocks",
    "alone": "a group alone in an empty step joins when its blocks are free (for its whole "
             "prefill, or with chunked prefill its first chunk), even into the watermark "
             "(otherwise a long request could wait forever); with prefill_first "
             "it is alone only if nobody is running either (they decode next step)",
    "watermark": "the watermark: after its blocks at least watermark_blocks must stay free "
                 "(leaving exactly watermark_blocks free is allowed), unless it would be "
                 "alone in an empty step; a first chunk keeps it too, as a whole prefill does",
    "seqs": "max_num_seqs: the running sequences count, and a group brings what it runs: a fresh "
            "n > 1 group (samples or beams) its n, while a group that has sampled brings only its "
            "live sequences (group.live_seqs()); reaching max_num_seqs exactly is allowed (<=)",
    "tokens": "the token budget: the running groups' tokens come first, and a group joins only if "
              "its tokens fit what is left (reaching max_num_batched_tokens exactly is allowed)",
    "admission": "admission: the head first, while its blocks leave the watermark free and "
                 "its sequences and tokens fit the step; keep admitting while the head fits",
}


loops.LOOPS["schedule_waiting"] = (_snapshot, _decide, _describe, _show, _why)


#: scenarios served by the scheduler alone: requests (prompt, max_tokens, arrival, n)
SCENARIOS: list[Scenario] = [
    Scenario("nobody waiting, then four requests arriving together (ties)",
             dict(num_blocks=40, block_size=4, max_num_batched_tokens=64, max_num_seqs=8),
             ((9, 4, 2, 1), (7, 4, 2, 1), (12, 4, 2, 1), (5, 4, 2, 1))),
    Scenario("the token budget met exactly (16 tokens: prompts of 10 and 6, then 5)",
             dict(num_blocks=40, block_size=4, max_num_batched_tokens=16, max_num_seqs=4),
             ((10, 5, 0, 1), (6, 5, 0, 1), (5, 5, 0, 1), (11, 3, 1, 1))),
    Scenario("a long request alone in an empty step, into the watermark, one taking all",
             dict(num_blocks=8, block_size=4, watermark_blocks=2),
             ((27, 2, 0, 1), (4, 3, 1, 1), (9, 2, 1, 1), (32, 1, 12, 1))),
    Scenario("samples against max_num_seqs 4 (n=3, n=2, then one behind)",
             dict(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=64),
             ((5, 3, 0, 3), (5, 3, 0, 2), (4, 3, 0, 1), (6, 2, 1, 1))),
    Scenario("swap: nobody is admitted while a group is swapped out",
             dict(num_blocks=7, block_size=4, preemption="swap", num_cpu_blocks=16),
             ((8, 12, 0, 1), (6, 10, 1, 1), (2, 3, 4, 1), (3, 3, 6, 1))),
    Scenario("chunks of 8 on 7 blocks: a step that preempts admits nobody, not its victim",
             dict(num_blocks=7, block_size=4, enable_chunked_prefill=True,
                  max_num_batched_tokens=8, max_num_seqs=4),
             ((9, 5, 0, 1), (10, 8, 0, 1), (10, 13, 1, 1))),
    Scenario("chunks of 6, recompute: 3 samples, one finished at once, back against max_num_seqs 4",
             dict(num_blocks=8, block_size=4, enable_chunked_prefill=True,
                  max_num_batched_tokens=6, max_num_seqs=4),
             ((3, 10, 2, 1), (9, 14, 0, 1), (7, 5, 0, 3, 4))),
    Scenario("chunks of 8, 8 blocks, watermark 1: a first chunk into it; 3 beams, 3 seqs", dict(
        num_blocks=8, block_size=4, watermark_blocks=1, enable_chunked_prefill=True,
        max_num_batched_tokens=8, max_num_seqs=3), ((23, 3, 0, 1), (12, 2, 3, 1), (4, 3, 4, -3))),
    Scenario("chunks of 12 on 4 blocks, watermark 2: a first chunk alone in an empty step, "
             "into the watermark", dict(num_blocks=4, block_size=4, watermark_blocks=2,
                                        enable_chunked_prefill=True, max_num_batched_tokens=12,
                                        max_num_seqs=4), ((14, 2, 0, 1), (5, 3, 1, 1))),
    Scenario("prefill_first, watermark 2: a long request waits while one runs, then joins alone",
             dict(num_blocks=8, block_size=4, watermark_blocks=2, scheduling="prefill_first"),
             ((8, 6, 0, 1), (28, 2, 1, 1), (3, 2, 2, 1))),
    Scenario("swap, chunks of 8: a small request arrives while a group is swapped out and "
             "blocks are free", dict(num_blocks=8, block_size=4, preemption="swap",
                                     num_cpu_blocks=16, enable_chunked_prefill=True,
                                     max_num_batched_tokens=8, max_num_seqs=4),
             ((16, 10, 0, 1), (12, 10, 0, 1), (3, 3, 4, 1))),
]


def check_schedule_waiting(schedule_waiting: Callable[..., Any]) -> None:
    """``schedule_waiting(waiting, step) -> None`` (admits with ``step.admit``)."""
    with grading.exercise("06.4"):
        loops.run_scheduler("schedule_waiting", schedule_waiting, SCENARIOS, "admission: the head "
                            "first, while can_admit lets it in (or it is alone in an empty step), "
                            "nobody while groups are swapped out or after a preemption")
