"""Chapter 12's checks, each one verdict line and one generated stage (:func:`numeric.check`):
12.1 ``kv_bytes_per_rank`` and 12.2 ``rank_heads`` name a wrong number by the typical mistakes;
12.3 ``rank_attention`` with the all-reduce replayed, then serving on two ``gloo`` ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.machinery
import multiprocessing as mp
import pickle
import sys
from collections import namedtuple
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paged_lib.accounting import ModelSpec, kv_bytes
from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric, small_counts
from paged_lib.course.grading.generated.numeric import Contrast, fewer, shorter
from paged_lib.course.grading.generated.small_attention import poisoned_cache, rng
from paged_lib.course.grading.slips import name_mistake
from paged_lib.engine.model_runner import build_metadata, check_metadata
from paged_lib.model import rope_cos_sin
from paged_lib.parallel import (
    AttentionWeights,
    kv_bytes_per_rank,
    rank_attention,
    rank_heads,
    tp_size_problem,
)
from paged_lib.util import cdiv

# ------------------------------------------------------------------ 12.1 kv_bytes_per_rank

def _wrong_bytes(spec: ModelSpec, tp: int, n: int) -> dict[str, Any]:
    """What the typical mistakes return on one case, with the hint that names each."""
    per_head = spec.num_layers * spec.head_dim * spec.dtype_bytes * n  # K or V, one head
    mine = max(1, spec.num_kv_heads // tp)
    return {
        "the KV heads are split as if a fraction of a head could live on a rank: with "
        "more ranks than KV heads, each rank keeps one whole KV head (it is replicated)":
            kv_bytes(spec, n) // tp,
        "only K or only V counted: a rank caches both, for each of its KV heads": per_head * mine,
        "split by query heads: queries are never cached, a rank keeps its KV heads":
            2 * per_head * (spec.num_heads // tp),
        "not split at all: a rank caches only its own KV heads' share of every token":
            kv_bytes(spec, n),
        "the sum over all ranks: the question is one rank's bytes": 2 * per_head * mine * tp,
        "one token's bytes: a rank caches K and V for each of the num_tokens tokens":
            2 * per_head * mine // max(n, 1),
        "with more ranks than KV heads a rank keeps one KV head, not tp_size // num_kv_heads":
            2 * per_head * (tp // spec.num_kv_heads if tp > spec.num_kv_heads else mine),
        "one layer only: every layer caches its own K and V":
            2 * spec.head_dim * spec.dtype_bytes * n * mine,
        "every number counted as 2 bytes (fp16): use the spec's dtype_bytes (4 in fp32, 1 "
        "in fp8)": 2 * per_head * mine * 2 // max(spec.dtype_bytes, 1),
        "0 bytes with more ranks than KV heads: a rank whose query heads read a KV head "
        "keeps all of it, so every rank keeps at least one whole KV head":
            2 * per_head * (spec.num_kv_heads // tp),
        "with more ranks than KV heads a rank keeps only the KV head its own query heads "
        "read, not every KV head: the others are on other ranks":
            2 * per_head * (spec.num_kv_heads if tp > spec.num_kv_heads else mine),
    }


_REFUSED = ("a tp_size below 1, one that does not divide the query heads, or one that neither "
            "divides the KV heads nor is a multiple of them raises ValueError (so does a rank "
            "outside 0..tp_size-1)")


def _run(fn: Callable, library: Callable, args: tuple, what: str, ok: list, form: Callable,
         wrong: Callable, label: str, rule: str) -> None:
    """One case of 12.1 or 12.2: refused as vLLM refuses, or answered in ``form`` (it returns
    the answer normalised) as the library answers, else named by the mistake giving it."""
    try:
        want = library(*args)
    except ValueError:
        return grading.expect_value_error(fn, args, f"vLLM refuses this {what}", _REFUSED)
    try:
        got = form(fn(*args))
    except ValueError as err:
        grading.fail(f"your function raised ValueError ({err}) on a {what} vLLM accepts",
                     numeric.Named("only " + _REFUSED + ": more ranks than KV heads, a "
                                   "multiple of them, replicate each KV head"))
    grading.expect_equal(got, want, label, name_mistake(args, got, want, ok, lambda c: wrong(
        *c), lambda c: form(fn(*c)), rule))


def check_kv_bytes_per_rank(fn: Callable[[ModelSpec, int, int], int]) -> None:
    """12.1: the bytes of K and V one rank caches for ``num_tokens`` tokens."""
    cases = small_counts.rank_cases()
    ok = [(p.spec(), p.tp, p.tokens) for p in cases
          if not tp_size_problem(p.spec().num_heads, p.spec().num_kv_heads, p.tp)]

    whole = lambda got: grading.expect_int(got, "bytes per rank", "bytes are a whole number: "
                                           "divide heads with //, never with /") or int(got)
    with grading.exercise("12.1"):
        numeric.check("12.1", cases, lambda p: _run(
            fn, kv_bytes_per_rank, (p.spec(), p.tp, p.tokens), "tp_size", ok, whole, _wrong_bytes,
            "bytes per rank", "2 (K and V) x layers x the KV heads this rank keeps x head_dim x "
            "dtype bytes x tokens"), (small_counts._HEAD_DIM,))
        for h, kv, tp, _ in _REFUSED_CASES[:6]:  # tp_sizes vLLM refuses, on made-up models
            spec = ModelSpec(f"a model with {h} query heads and {kv} KV heads", 4, 64 * h, h,
                             kv, 64, dtype_bytes=2)
            grading.expect_value_error(fn, (spec, tp, 10), f"kv_bytes_per_rank({spec.name}, "
                                       f"tp_size={tp}, num_tokens=10)", _REFUSED)


# ------------------------------------------------------------------ 12.2 rank_heads

def _wrong_heads(h: int, kv: int, tp: int, r: int) -> dict[str, Any]:
    per, group = h // tp, h // kv
    q = list(range(r * per, (r + 1) * per))
    kv_per = max(1, kv // tp)
    return {
        "a rank's query heads are a contiguous run (rank r: heads r*H/T up to (r+1)*H/T), "
        "the slice of o_proj's input it owns, not every T-th head":
            (list(range(r, h, tp)), sorted({x // group for x in range(r, h, tp)})),
        "the replicas of a KV head sit on neighbouring ranks, the ones whose query heads "
        "read it (rank r keeps KV head r // (T / KV)), not rank r % KV":
            (q, [r % kv] if tp > kv else list(range(r * kv_per, (r + 1) * kv_per))),
        "with fewer KV heads than ranks a rank still keeps one whole KV head (replicated), "
        "never none": (q, list(range(r * kv // tp, (r + 1) * kv // tp))),
        "the KV head of query head j is j // (num_heads // num_kv_heads), the size of a "
        "group, not j // num_kv_heads": (q, sorted({x // kv for x in q})),
        "a rank keeps the KV heads of all its query heads (num_kv_heads / T of them when "
        "there are at least as many as ranks), not just the first": (q, [q[0] // group]),
        "KV head ids are not query head ids: query heads share KV heads in groups": (q, q),
        "a set is not sorted (small ones only happen to come out so): return the KV heads "
        "ascending, sorted(...)": (q, list({x // group for x in q})),
        "a group is consecutive query heads (0 .. g-1 read KV head 0, g = num_heads / "
        "num_kv_heads), not every num_kv_heads-th head": (q, sorted({x % kv for x in q})),
        "with more ranks than KV heads, a rank keeps the KV head its own query heads read, "
        "which its neighbours share: not KV head number r":
            (q, list(range(r * kv_per, (r + 1) * kv_per))),
        "the KV head of the rank's last query head is kept too (a range's end is "
        "exclusive)": (q, list(range(q[0] // group, q[-1] // group))),
    }


_OWNS = ("rank r owns query heads r*H/T up to (r+1)*H/T and the KV heads those query heads read")


#: (query heads, KV heads) of published configurations: Llama 3 8B and 70B, Qwen2 0.5B,
#: 1.5B and 7B (groups of 7 and 6), Qwen2.5 14B (40 on 8), Phi-3 medium (40 on 10),
#: Falcon 7B (MQA, 71 heads), Gemma 7B (MHA), Mistral NeMo
_HEAD_MODELS = [(32, 8), (64, 8), (14, 2), (12, 2), (28, 4), (40, 8), (40, 10), (71, 1),
                (16, 16), (32, 8), (24, 8), (6, 1)]
#: named shardings, every rank: the shipped model on 1, 2, 4 and 8 ranks, MHA, MQA on 2,
#: LLaMA-2-70B on 16, one or two KV heads per rank, three (rank 2's are 6, 7, 8, which a
#: set holds as 8, 6, 7)
_NAMED_SHARDINGS = [(8, 2, 2), (8, 2, 4), (8, 8, 4), (4, 1, 2), (64, 8, 16), (6, 6, 3), (8, 2, 1),
                     (32, 8, 8), (8, 2, 8), (12, 4, 2), (24, 12, 4)]
#: (heads, KV heads, tp_size, rank) vLLM refuses (a tp_size, then a rank)
_REFUSED_CASES = [(8, 2, 3, 0), (12, 6, 4, 0), (6, 2, 3, 0), (8, 2, 0, 0), (8, 2, 16, 0),
                  (12, 4, 6, 0), (8, 2, 2, 2), (8, 2, 2, -1)]


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
        ratio, group = max(1, self.tp // self.kv_heads), self.heads // self.kv_heads
        return numeric.reached(
            (f"{self.tp} ranks", self.tp not in (1, 2, 4, 8, 16)),
            (f"each KV head on {ratio} ranks", ratio not in (1, 2, 4)),
            (f"groups of {group}", group in (3, 5, 6, 7, 71)))

    def smaller(self) -> Iterator[Heads]:
        yield from fewer(self, rank=shorter(self.rank, 0))
        h, kv, tp = now = self.heads, self.kv_heads, self.tp
        for k in (2, 3, 5, 7):  # the same sharing on fewer heads (and ranks), refused or not
            for c in ((h // k, kv // k, tp // k), (h // k, kv, tp), (h // k, kv // k, tp)):
                if not h % k and c[1] and c[2] and self.rank < c[2] and not c[0] % c[1] and \
                        c != now and bool(tp_size_problem(*c)) == bool(tp_size_problem(*now)):
                    yield dataclasses.replace(self, heads=c[0], kv_heads=c[1], tp=c[2])


def head_cases(count: int = 48) -> list[Heads]:
    """12.2's cases: every rank of the named shardings, the refused ones, then published
    models on every size that divides their query heads (some refused for their KV heads),
    one rank each (seeds 0, 1, ...)."""
    out = [Heads(0, h, kv, tp, r) for h, kv, tp in _NAMED_SHARDINGS for r in range(tp)]
    out += [Heads(0, *args) for args in _REFUSED_CASES]
    for seed in range(count):
        pick, (heads, kv) = rng(1220 + seed), _HEAD_MODELS[seed % len(_HEAD_MODELS)]
        tp = pick([t for t in range(1, heads + 1) if heads % t == 0])
        out.append(Heads(seed, heads, kv, tp, pick(range(tp))))
    return out


def _power_of_two_ratio(p: Heads) -> Heads | None:
    """The same rank's place on a sharding whose replicas come in twos or fours."""
    ratio = p.tp // p.kv_heads if p.tp > p.kv_heads and not p.tp % p.kv_heads else 0
    if ratio < 3 or ratio & (ratio - 1) == 0:
        return None
    tp = p.kv_heads << (ratio.bit_length() - 1)
    return dataclasses.replace(p, heads=p.heads // p.tp * tp, tp=tp, rank=min(p.rank, tp - 1))


_DIVISION = ("rank r keeps KV head r // (tp_size // num_kv_heads), a division; a shift "
             "(r >> log2(...)) or a mask is that only when each KV head sits on 2 or 4 ranks")
HEAD_CONTRASTS = (Contrast(_power_of_two_ratio, "it passes when each KV head sits on a power "
                           "of two of ranks (2, 4) and fails when it sits on 3, 5 or 7: "
                           + _DIVISION),)


def check_rank_heads(fn: Callable[[int, int, int, int], tuple[list[int], list[int]]]) -> None:
    """12.2: the query heads and KV heads rank ``rank`` of ``tp_size`` owns."""
    cases = head_cases()
    ok = [(p.heads, p.kv_heads, p.tp, p.rank) for p in cases
          if not tp_size_problem(p.heads, p.kv_heads, p.tp) and 0 <= p.rank < p.tp]

    pair = lambda got: grading.expect_true(isinstance(got, tuple | list) and len(got) == 2 and all(
        isinstance(x, list) for x in got), f"expected a pair of lists (query heads, KV heads), "
        f"got {got!r}", "return (list_of_query_heads, list_of_kv_heads): lists, e.g. "
        "list(range(...))") or (list(got[0]), list(got[1]))
    with grading.exercise("12.2"):
        numeric.check("12.2", cases, lambda p: _run(
            fn, rank_heads, (p.heads, p.kv_heads, p.tp, p.rank), "tp_size or rank", ok, pair,
            _wrong_heads, "(query heads, KV heads)", _OWNS), HEAD_CONTRASTS)


# ------------------------------------------------------------------ 12.3 rank_attention

_HEADS = ("a rank computes num_heads / tp contiguous query heads and keeps the KV heads they "
          "read: the rows of q, k, v (and of their biases) for those heads; with fewer KV "
          "heads than ranks each KV head is replicated: rank r keeps KV head "
          "r // (tp / num_kv_heads), and writes it too")
_NAN = ("NaN: your attention read cache slots that were never written (they hold NaN): "
        "write the new tokens' K and V into the rank's cache at meta.slot_mapping first")
_ROTATED = ("keys go into the cache rotated: apply RoPE to k first, then write it at "
            "meta.slot_mapping (a cached key is read at every later step with its position "
            "already in it)")
_BEFORE_O = ("all_reduce comes after o_proj: each rank multiplies its heads' output by its "
             "columns of o_proj, and the ranks' [tokens, hidden] partial outputs are summed "
             "(a sum of different heads' outputs mixes heads that o_proj keeps apart)")
_ROWS = ("o_proj is row-parallel: a rank multiplies by the columns of o_proj that its heads "
         "feed, o[:, its heads].T (nn.Linear stores W as [out, in]), not by rows of it")


#: one step's inputs: ``cache`` holds every KV head before the step
Step = namedtuple("Step", "name tp w x cos sin cache meta")


@dataclass(frozen=True)
class Rank:
    """One step of 12.3: ``lens`` (cached, new) per sequence; ``loud`` scales the input."""

    seed: int
    tp: int
    heads: int
    kv_heads: int
    lens: tuple[tuple[int, int], ...]
    head_dim: int = 8
    hidden: int = 32
    block_size: int = 4
    bias: bool = False
    loud: float = 1.0

    def step(self) -> Step:
        """The step's tensors: its history in a cache whose other slots are NaN."""
        g = torch.Generator().manual_seed(self.seed)
        rand = lambda *shape: torch.randn(*shape, generator=g) * 0.3
        h, kv, d, bs, hid = self.heads, self.kv_heads, self.head_dim, self.block_size, self.hidden
        w = AttentionWeights(rand(h * d, hid), rand(kv * d, hid), rand(kv * d, hid),
                             rand(hid, h * d), h, kv, d, *((rand(h * d), rand(kv * d),
                             rand(kv * d), rand(hid)) if self.bias else ()))
        need = [cdiv(c + n, bs) for c, n in self.lens]
        num_blocks = max(16, sum(need) + 2)
        order = torch.randperm(num_blocks, generator=g).tolist()
        tables = [[order.pop() for _ in range(n)] for n in need]
        cache = poisoned_cache(g, num_blocks, bs, kv, d, tables, [c for c, _ in self.lens],
                               torch.float32)  # the history, written by earlier steps
        meta = build_metadata(tables, [c + n for c, n in self.lens], [n for _, n in self.lens], bs)
        check_metadata(meta, num_blocks, bs)
        cos, sin = rope_cos_sin(meta.positions, d, 10000.0, torch.float32)
        x = rand(int(meta.query_lens.sum()), hid) * 3 * self.loud
        return Step(self.describe(), self.tp, w, x, cos, sin, cache, meta)

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
        group = self.heads // self.kv_heads
        return numeric.reached(
            (f"{self.tp} ranks", self.tp == 3), ("louder inputs", self.loud > 1),
            (f"GQA groups of {group}", group not in (1, 2, 4, 8)),
            (f"hidden {self.hidden}", self.hidden != 32),
            (f"head_dim {self.head_dim}", self.head_dim != 8),
            (f"blocks of {self.block_size}", self.block_size != 4),
            ("a sequence over 10 tokens", max(c + n for c, n in self.lens) > 10))

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


#: (ranks, query heads, KV heads): split KV heads, replicated ones, MHA, MQA, groups of 3, 7
_SHARDS = [(2, 4, 2), (2, 6, 2), (2, 14, 2), (2, 4, 4), (2, 2, 1), (3, 6, 3), (3, 3, 1),
           (3, 12, 3), (3, 6, 1), (4, 8, 2), (4, 4, 1), (4, 8, 4), (4, 16, 8), (4, 12, 4)]

#: the named steps: a prefill, 3 decodes, a prefix hit, a GQA group split across 2 ranks,
#: biases (Qwen2's), 4 ranks for 2 KV heads, 4 ranks for 1 (MQA)
_NAMED = [Rank(1, 2, 4, 2, ((0, 5), (0, 3))), Rank(2, 2, 4, 2, ((6, 1), (9, 1), (1, 1))),
          Rank(3, 2, 4, 2, ((7, 1), (4, 1), (6, 4))), Rank(5, 2, 2, 1, ((5, 3), (2, 1))),
          Rank(7, 2, 4, 2, ((2, 4), (5, 1)), bias=True), Rank(8, 4, 8, 2, ((9, 1), (4, 3))),
          Rank(9, 4, 4, 1, ((0, 5),), bias=True)]


def _draw(seed: int) -> Rank:
    pick = rng(1230 + seed)
    tp, heads, kv = pick(_SHARDS)
    d = pick([4, 6, 8, 10, 12, 16])
    hidden = pick([heads * d, 24, 40, 48])
    lens = []
    for kind in (pick(["decode", "decode", "prefill", "chunk"]) for _ in range(pick([1, 2, 3]))):
        cached = 0 if kind == "prefill" else pick([1, 3, 4, 8, 15, 16, 30])
        lens.append((cached, 1 if kind == "decode" else pick([1, 2, 5, 8])))
    return Rank(seed, tp, heads, kv, tuple(lens), d, hidden, (1, 2, 3, 4, 5, 8)[seed % 6],
                seed % 4 == 1, (1.0, 1.0, 4.0)[seed % 3])


def rank_cases(count: int = 24) -> list[Rank]:
    """12.3's steps: the named ones, then ``count`` drawn (seeds 0, 1, ...)."""
    out = _NAMED + [_draw(seed) for seed in range(count)]
    assert not any(tp_size_problem(p.heads, p.kv_heads, p.tp) for p in out)
    return out


def steps() -> list[Step]:
    return [p.step() for p in _NAMED]


RANK_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, lens=tuple((0, c + n) for c, n in p.lens))
             if any(c for c, _ in p.lens) else None,
             "it passes when every sequence is a prefill and fails when tokens are cached: "
             "the new tokens attend to the cached ones and to each other, causally (a decode "
             "row is a query of one token over every cached one), read through the cache"),
    Contrast(lambda p: dataclasses.replace(p, bias=False) if p.bias else None,
             "it passes without biases and fails with them: q, k, v's biases are sliced with "
             "their rows; o_proj's bias: add it once, after all_reduce (vLLM's "
             "RowParallelLinear adds it on one rank only)"),
    Contrast(lambda p: dataclasses.replace(p, tp=4, heads=p.heads // p.tp * 4)
             if p.kv_heads == 1 and p.tp == 3 else None,
             "it passes on 4 ranks for one KV head and fails on 3: " + _DIVISION),
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
             "sharding: " + _HEADS),
)


def share(step: Step, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of rank ``rank``'s cache before the step: its KV heads of every block."""
    _, kv = rank_heads(step.w.num_heads, step.w.num_kv_heads, step.tp, rank)
    return tuple(c[:, :, kv[0]:kv[-1] + 1].clone() for c in step.cache)


def single_device(step: Step, w: AttentionWeights | None = None) -> tuple[torch.Tensor, tuple]:
    """The whole layer (with weights ``w``) on one device and its cache after."""
    cache = tuple(c.clone() for c in step.cache)
    return rank_attention(step.x, w or step.w, step.cos, step.sin, cache, step.meta, 0, 1,
                          lambda t: t), cache


def _copies(x, w, cos, sin, meta) -> tuple:
    """Copies for the learner's function: what it changes in place must not reach on."""
    return x.clone(), copy.deepcopy(w), cos.clone(), sin.clone(), copy.deepcopy(meta)


def replayed(fn: Callable, step: Step) -> list[tuple[torch.Tensor, tuple]]:
    """Every rank's (output, cache after) from ``fn`` with the all-reduce replayed: each
    rank runs once with its partial sums recorded, then again with their sums."""
    def run(rank: int, cache: tuple, all_reduce: Callable) -> Any:
        x, w, cos, sin, meta = _copies(step.x, step.w, step.cos, step.sin, step.meta)
        return fn(x, w, cos, sin, cache, meta, rank, step.tp, all_reduce)

    partials: list[list[torch.Tensor]] = [[] for _ in range(step.tp)]
    for rank, calls in enumerate(partials):  # all_reduce works in place, returns nothing
        run(rank, share(step, rank), lambda t, calls=calls: calls.append(t.detach().clone()))
    counts = [len(c) for c in partials]
    if 0 in counts or len(set(counts)) > 1:
        grading.fail(f"your ranks called all_reduce {counts} times (rank 0 first)",
                     "every rank calls all_reduce exactly as often (once, on its partial "
                     "output); a rank that calls it alone waits forever")
    want = (step.x.shape[0], step.x.shape[1])
    shapes = {tuple(t.shape) for calls in partials for t in calls} - {want}
    if shapes:
        w = step.w
        grading.fail(f"all_reduce got shape {sorted(shapes)[0]}, expected [tokens, hidden] "
                     f"= {list(want)}", _BEFORE_O if sorted(shapes)[0][-1] * step.tp ==
                     w.num_heads * w.head_dim else _ROWS)
    results = []
    for rank in range(step.tp):
        sums = iter([sum(c[i] for c in partials) for i in range(counts[0])])
        cache = share(step, rank)
        results.append((run(rank, cache, lambda t, sums=sums: t.copy_(next(sums))), cache))
    return results


def _heads(step: Step) -> torch.Tensor:
    """Every head's output on one device, before o_proj."""
    w = step.w
    return single_device(step, dataclasses.replace(w, o=torch.eye(w.num_heads * w.head_dim),
                                                   o_bias=None))[0]


def _mistake(step: Step, heads: torch.Tensor, got: torch.Tensor, want: torch.Tensor,
             partial: torch.Tensor) -> str | None:
    """The typical mistake whose output after the sum is ``got``; ``heads``: every head's
    output before o_proj (:func:`_heads`); ``partial``: this rank's own (the library's)."""
    w = step.w
    b = w.o_bias if w.o_bias is not None else torch.zeros(step.x.shape[1])
    wrong = {"that is this rank's own partial output: all_reduce (sum) the ranks' partial "
             "outputs, each its heads times its columns of o_proj": partial,
             "the partial outputs were averaged: all_reduce sums them (the output is the sum "
             "over every head)": (want - b) / step.tp + b}
    if w.o.shape[0] == w.o.shape[1]:  # o[its heads' rows, :] multiplies only when square
        wrong[_ROWS] = heads @ w.o + b
    return next((hint for hint, out in wrong.items() if torch.allclose(got, out, 1e-4, 1e-5)), None)


def compare(step: Step, results: list) -> None:
    """Every rank's output against the single-device layer, its cache against the library
    rank's: fail at the first difference."""
    want, _ = single_device(step)
    # An output is a sum over every head of o_proj's terms, which cancel: float32 rounds
    # each term, so the tolerance grows with sum |term| (1.9e-6 of it measured on an AMD
    # EPYC where a tolerance on the output alone failed a correct answer), not |output|.
    w, heads = step.w, _heads(step)
    scale = heads.abs() @ w.o.abs().T + (0 if w.o_bias is None else w.o_bias.abs())
    for rank, (out, cache) in enumerate(results):
        what = f"rank {rank} of {step.tp}"
        grading.expect_true(isinstance(out, torch.Tensor), f"{what}: returned {type(out).__name__}",
                            "return the layer's output, a tensor [tokens, hidden]")
        grading.expect_true(tuple(out.shape) == tuple(want.shape), f"{what}: output of shape "
                            f"{tuple(out.shape)}, expected {tuple(want.shape)}",
                            "return [tokens, hidden]: after o_proj, not the heads")
        lib = share(step, rank)
        partial = rank_attention(step.x, step.w, step.cos, step.sin, lib, step.meta, rank,
                                 step.tp, lambda t: t)
        same = [torch.isclose(mine, ref, 1e-5, 1e-6, equal_nan=True)
                for mine, ref in zip(cache, lib, strict=True)]
        got = out.detach().float()
        bad = got.isnan() | ((got - want).abs() > 1e-5 + 1e-4 * want.abs() + 1e-5 * scale)
        if bad.any():
            row, col = (int(i) for i in bad.nonzero()[0])
            grading.fail(f"{what}: token {row} (position {int(step.meta.positions[row])}), "
                         f"output {col}: the single-device layer gives {want[row, col]:.5f}, "
                         f"yours {float(out[row, col]):.5f}",
                         _NAN if out[row, col].isnan() else _ROTATED if same[1].all() and not
                         same[0].all() else _mistake(step, heads, got, want, partial) or _HEADS)
        for name, ok, mine, ref in zip("KV", same, cache, lib, strict=True):
            if not bool(ok.all()):
                blk, off, head = (int(i) for i in (~ok).nonzero()[0][:3])
                grading.fail(f"{what}: your cache's {name} of block {blk}, slot {off}, the "
                             f"rank's KV head {head}: expected {float(ref[blk, off, head, 0]):.4f}"
                             f", got {float(mine[blk, off, head, 0]):.4f} (nan: never written)",
                             _ROTATED if name == "K" and bool(same[1].all()) else _HEADS)


def _ask(fn: Callable, p: Rank) -> None:
    step = p.step()
    try:
        results = replayed(fn, step)
    except (grading.CheckFailed, NotImplementedError):
        raise
    except Exception as err:  # noqa: BLE001 - told with the hint on heads
        grading.fail(f"your function raised {type(err).__name__}: {err}", _HEADS)
    compare(step, results)


def check_generated(fn: Callable) -> None:
    numeric.check("12.3", rank_cases(), lambda p: _ask(fn, p), RANK_CONTRASTS)


# ------------------------------------------------------------------ on two gloo ranks


class Shipped:
    """``fn`` in a form a spawned rank rebuilds: pickled when its module can be imported
    there, else its source (:func:`paged_lib.course.mine.section_text`); called on copies."""

    def __init__(self, fn: Callable):
        self.kind, self.body, self.fn = *_ship(fn), None

    def __call__(self, x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce):
        if self.fn is None and self.kind == "pickle":
            self.fn = pickle.loads(self.body)
        elif self.fn is None:
            space: dict[str, Any] = {"__name__": "your_rank_attention"}
            exec(compile(self.body, "<your rank_attention>", "exec"), space)  # noqa: S102
            self.fn = space["rank_attention"]
        x, w, cos, sin, meta = _copies(x, w, cos, sin, meta)
        return self.fn(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce)


def _ship(fn: Callable) -> tuple[str, Any]:
    module = getattr(fn, "__module__", "__main__")
    if module != "__main__" and "<locals>" not in getattr(fn, "__qualname__", "<locals>"):
        try:  # looked up on sys.path, not in sys.modules (mine/ch12.py is loaded by file)
            importable = importlib.machinery.PathFinder.find_spec(module.split(".")[0])
        except (ImportError, ValueError):
            importable = None
        if importable is not None:
            try:
                return "pickle", pickle.dumps(fn)
            except Exception:  # noqa: BLE001 - not picklable: try the source
                pass
        path = getattr(sys.modules.get(module), "__file__", None)
        if path:  # a module loaded from its file (mine/ch12.py): the file travels
            text = Path(path).read_text()
            if fn.__name__ != "rank_attention":
                text += f"\nrank_attention = {fn.__name__}\n"
            return "source", text
    from paged_lib.course import mine

    return "source", mine.section_text(fn, "rank_attention")


ENGINE = dict(num_blocks=14, block_size=4, num_cpu_blocks=32, preemption="swap",
              enable_prefix_caching=True, enable_chunked_prefill=True,
              max_num_batched_tokens=12, max_num_seqs=4, watermark=0)


def _served(runner: Any = None) -> list[list[int]]:
    """Every sample's tokens of a small workload (prefix hits, chunks, samples, swaps)."""
    from paged_lib.engine import LLMEngine, SamplingParams
    from paged_lib.model import load_tiny_code_llama
    from paged_lib.tokenizer import ByteTokenizer

    engine = LLMEngine(load_tiny_code_llama(), **ENGINE)
    engine.runner = runner or engine.runner
    prompts = [ByteTokenizer().encode("def area(w, h):\n    " + t)
               for t in ("return w * h", "# the area", "pass")]
    outs = engine.generate(prompts, [
        SamplingParams(max_tokens=6, temperature=0.0),
        SamplingParams(max_tokens=5, temperature=0.8, n=2, seed=3),
        SamplingParams(max_tokens=7, temperature=0.0)])
    return [list(s.token_ids) for o in outs for s in o.outputs]


def _on_gloo_ranks(fn: Callable) -> None:
    """:func:`_served` on two gloo ranks with ``fn`` as every layer's attention."""
    from paged_lib.engine.tensor_parallel import TensorParallelRunner
    from paged_lib.model import load_tiny_code_llama

    try:
        sent = Shipped(fn)
    except Exception as err:  # noqa: BLE001 - mine.CannotSave and the like
        grading.fail(f"your function cannot be sent to the rank processes: {err}",
                     "define rank_attention with def at the top of its cell; it may use "
                     "imports, constants and functions of the notebook")
    try:
        runner = TensorParallelRunner(load_tiny_code_llama(), ENGINE["num_blocks"],
                                      ENGINE["block_size"], ENGINE["num_cpu_blocks"],
                                      timeout=60, rank_attention=sent)
    except Exception as err:  # noqa: BLE001 - the check's machinery, not the learner's code
        grading.fail(f"the check could not start its two rank processes ({type(err).__name__}"
                     f": {err}); this is not your function", "run the check from a notebook, "
                     "or from a script whose checks sit under `if __name__ == \"__main__\":` "
                     "(each rank process is started with multiprocessing's spawn)")
    try:
        got = _served(runner)
    except RuntimeError as err:  # a rank raised, or did not answer
        grading.fail(f"on two gloo ranks: {str(err).strip().splitlines()[-1]}",
                     "the function runs in a fresh process on each rank: it may use only its "
                     "arguments (the all_reduce it is given), imports and the notebook's "
                     "functions and constants; each rank calls all_reduce once per layer (a "
                     "rank that waits for a sum the other never sends hangs)")
    finally:
        runner.close()
    grading.expect_equal(got, _served(), "serving a workload on two gloo ranks with your "
                         "attention in every layer of the shipped model (prefix caching, "
                         "chunked prefill, samples, swaps): every sample's tokens",
                         "the steps above pass, the engine's do not: compare the engine's "
                         "states (a block table, a prefill that starts mid-sequence) with theirs")


def _in_a_rank_bootstrapping() -> bool:
    """True in a spawned rank still importing the parent's main module (a script with no
    ``__main__`` guard runs its checks again there)."""
    return mp.parent_process() is not None and bool(
        getattr(mp.current_process(), "_inheriting", False))


def check_rank_attention(fn: Callable[..., torch.Tensor]) -> None:
    """12.3: one rank's attention layer, its all-reduce included."""
    if _in_a_rank_bootstrapping():
        return  # the parent prints the verdict
    with grading.exercise("12.3"):
        check_generated(fn)
        _on_gloo_ranks(fn)
