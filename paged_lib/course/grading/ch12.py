"""Checks for chapter 12 (beyond one device). Each prints one verdict line.

* 12.1 ``kv_bytes_per_rank(spec, tp_size, num_tokens)``: the K/V bytes one tensor-parallel
  rank caches, KV heads replicated when there are fewer of them than ranks: shardings vLLM
  refuses, then :func:`small_counts.rank_cases` (real models);
* 12.2 ``rank_heads(num_heads, num_kv_heads, tp_size, rank)``: the query heads and the KV
  heads one rank owns, on :func:`head_cases` (named shardings, then published models);
* 12.3 ``rank_attention``: :mod:`~paged_lib.course.grading.ch12_rank`.

12.1 and 12.2 compare with :mod:`paged_lib.parallel`; a wrong answer is matched against the
typical mistakes computed on the same case, a failing case shrunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from paged_lib.accounting import SPECS, ModelSpec, kv_bytes
from paged_lib.course import grading
from paged_lib.course.grading.ch12_rank import check_rank_attention
from paged_lib.course.grading.generated import numeric, small_counts
from paged_lib.course.grading.generated.numeric import Contrast, fewer, shorter
from paged_lib.course.grading.slips import name_mistake
from paged_lib.parallel import kv_bytes_per_rank, rank_heads, tp_size_problem

__all__ = ["HEAD_CONTRASTS", "Heads", "check_kv_bytes_per_rank", "check_rank_attention",
           "check_rank_heads", "head_cases", "run_demo"]


_TINY = ModelSpec("tiny-code-llama (fp32)", num_layers=4, hidden_size=256, num_heads=8,
                  num_kv_heads=2, head_dim=32, dtype_bytes=4)
_SIX = ModelSpec("a 12-head model with 6 KV heads", num_layers=4, hidden_size=768,
                 num_heads=12, num_kv_heads=6, head_dim=64, dtype_bytes=2)
_FOUR = ModelSpec("a 12-head model with 4 KV heads", num_layers=4, hidden_size=768,
                  num_heads=12, num_kv_heads=4, head_dim=64, dtype_bytes=2)

# ------------------------------------------------------------------ 12.1 kv_bytes_per_rank

def _wrong_bytes(spec: ModelSpec, tp: int, n: int) -> dict[str, Any]:
    """What the typical mistakes return on one case, with the hint that names each."""
    per_head = spec.num_layers * spec.head_dim * spec.dtype_bytes * n  # K or V, one head
    mine = max(1, spec.num_kv_heads // tp)
    return {
        "the KV heads are split as if a fraction of a head could live on a rank: with "
        "more ranks than KV heads, each rank keeps one whole KV head (it is replicated)":
            kv_bytes(spec, n) // tp,
        "only K or only V counted: a rank caches both, for each of its KV heads":
            per_head * mine,
        "split by query heads: queries are never cached, a rank keeps its KV heads":
            2 * per_head * (spec.num_heads // tp),
        "not split at all: a rank caches only its own KV heads' share of every token":
            kv_bytes(spec, n),
        "the sum over all ranks: the question is one rank's bytes":
            2 * per_head * mine * tp,
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


def _normal(value: Any) -> Any:
    """Answers as the mistakes' tables hold them (pairs of lists as tuples of lists)."""
    if isinstance(value, tuple | list) and len(value) == 2 and all(
            isinstance(x, list) for x in value):
        return (list(value[0]), list(value[1]))
    return value


def check_kv_bytes_per_rank(fn: Callable[[ModelSpec, int, int], int]) -> None:
    """12.1: the bytes of K and V one rank caches for ``num_tokens`` tokens."""
    with grading.exercise("12.1"):
        cases = [(p.spec(), p.tp, p.tokens) for p in small_counts.rank_cases()
                 if not tp_size_problem(p.spec().num_heads, p.spec().num_kv_heads, p.tp)]
        small_counts.rank_stage(fn, lambda case, got, want: name_mistake(  # real models
            case, got, want, cases, lambda c: _wrong_bytes(*c), lambda c: fn(*c),
            "2 (K and V) x layers x the KV heads this rank keeps x head_dim x dtype bytes x "
            "tokens"))
        for spec, tp, n, about in ((SPECS["llama-2-70b"], 3, 10, "3 ranks for 64 heads"),
                                   (SPECS["llama-2-70b"], 0, 10, "tp_size 0"),
                                   (_TINY, 16, 10, "16 ranks for 8 heads"),
                                   (_SIX, 4, 10, "4 ranks for 12 query heads and 6 KV "
                                    "heads: ranks 0 and 1 would both need KV head 1"),
                                   (_FOUR, 6, 10, "6 ranks for 12 query heads and 4 KV "
                                    "heads: rank 1 would need KV heads 0 and 1")):
            grading.expect_value_error(fn, (spec, tp, n), f"kv_bytes_per_rank with {about}",
                                hint="a tp_size below 1, one that does not divide the "
                                "query heads, or one that neither divides the KV heads nor "
                                "is a multiple of them raises ValueError")


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
        "never none":
            (q, list(range(r * kv // tp, (r + 1) * kv // tp))),
        "the KV head of query head j is j // (num_heads // num_kv_heads), the size of a "
        "group, not j // num_kv_heads":
            (q, sorted({x // kv for x in q})),
        "a rank keeps the KV heads of all its query heads (num_kv_heads / T of them when "
        "there are at least as many as ranks), not just the first":
            (q, [q[0] // group]),
        "KV head ids are not query head ids: query heads share KV heads in groups":
            (q, q),
        "a set is not sorted (small ones only happen to come out so): return the KV heads "
        "ascending, sorted(...)":
            (q, list({x // group for x in q})),
        "a group is consecutive query heads (0 .. g-1 read KV head 0, g = num_heads / "
        "num_kv_heads), not every num_kv_heads-th head":
            (q, sorted({x % kv for x in q})),
        "with more ranks than KV heads, a rank keeps the KV head its own query heads read, "
        "which its neighbours share: not KV head number r":
            (q, list(range(r * kv_per, (r + 1) * kv_per))),
        "the KV head of the rank's last query head is kept too (a range's end is "
        "exclusive)":
            (q, list(range(q[0] // group, q[-1] // group))),
    }


_OWNS = ("rank r owns query heads r*H/T up to (r+1)*H/T and the KV heads those query heads "
         "read")
_REFUSED = ("tp_size must divide the query heads and divide the KV heads or be a multiple of "
            "them; rank is in 0..tp_size-1; anything else raises ValueError")


#: (query heads, KV heads) of published configurations: Llama 3 8B and 70B, Qwen2 0.5B,
#: 1.5B and 7B (groups of 7 and 6), Qwen2.5 14B (40 on 8), Phi-3 medium (40 on 10),
#: Falcon 7B (MQA, 71 heads), Gemma 7B (MHA), Mistral NeMo
_HEAD_MODELS = [(32, 8), (64, 8), (14, 2), (12, 2), (28, 4), (40, 8), (40, 10), (71, 1),
                (16, 16), (32, 8), (24, 8), (6, 1)]
#: named shardings, every rank: the shipped model on 1, 2, 4 and 8 ranks, MHA, MQA on 2,
#: LLaMA-2-70B on 16, one or two KV heads per rank, three (rank 2's are 6, 7, 8, which a
#: set holds as 8, 6, 7)
_NAMED = [(8, 2, 2), (8, 2, 4), (8, 8, 4), (4, 1, 2), (64, 8, 16), (6, 6, 3), (8, 2, 1),
          (32, 8, 8), (8, 2, 8), (12, 4, 2), (24, 12, 4)]
#: (heads, KV heads, tp_size, rank) vLLM refuses: 3 ranks for 8 heads, 4 for 6 KV heads,
#: 3 for 2, tp_size 0, rank 2 of 2, rank -1
_REFUSED_CASES = [(8, 2, 3, 0), (12, 6, 4, 0), (6, 2, 3, 0), (8, 2, 0, 0), (8, 2, 2, 2),
                  (8, 2, 2, -1)]


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
                if heads * k == self.heads and kv and tp and self.rank < tp and not heads % kv and (
                        (heads, kv, tp) != (self.heads, self.kv_heads, self.tp)) and (
                        not tp_size_problem(heads, kv, tp)) == (
                        not tp_size_problem(self.heads, self.kv_heads, self.tp)):
                    yield dataclasses.replace(self, heads=heads, kv_heads=kv, tp=tp)


def head_cases(count: int = 48) -> list[Heads]:
    """12.2's cases: every rank of the named shardings, the refused ones, then published
    models on every size that divides their query heads (some refused for their KV heads),
    one rank each (seeds 0, 1, ...)."""
    out = [Heads(0, h, kv, tp, r) for h, kv, tp in _NAMED for r in range(tp)]
    out += [Heads(0, *args) for args in _REFUSED_CASES]
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


def check_rank_heads(fn: Callable[[int, int, int, int], tuple[list[int], list[int]]]) -> None:
    """12.2: the query heads and KV heads rank ``rank`` of ``tp_size`` owns."""
    with grading.exercise("12.2"):
        cases = head_cases()
        ok = [(p.heads, p.kv_heads, p.tp, p.rank) for p in cases
              if not tp_size_problem(p.heads, p.kv_heads, p.tp) and 0 <= p.rank < p.tp]
        numeric.check("12.2", cases, lambda p: _run_heads(fn, p, ok), HEAD_CONTRASTS)


def _run_heads(fn: Callable, p: Heads, others: list[tuple]) -> None:
    args = (p.heads, p.kv_heads, p.tp, p.rank)
    try:
        want = rank_heads(*args)
    except ValueError:
        grading.expect_value_error(fn, args, "vLLM refuses this tp_size or rank",
                                   hint=_REFUSED)
        return
    got = fn(*args)
    grading.expect_true(isinstance(got, tuple | list) and len(got) == 2
                        and all(isinstance(x, list) for x in got),
                        f"expected a pair of lists (query heads, KV heads), got {got!r}",
                        hint="return (list_of_query_heads, list_of_kv_heads): lists, e.g. "
                        "list(range(...))")
    got = (list(got[0]), list(got[1]))
    hint = name_mistake(args, got, want, others, lambda c: _wrong_heads(*c),
                        lambda c: _normal(fn(*c)), _OWNS)
    grading.expect_equal(got, want, "(query heads, KV heads)", hint=hint)


# ------------------------------------------------------------------------------ demo


def run_demo(kv_bytes_per_rank_fn: Callable[..., int],
             rank_heads_fn: Callable[..., tuple[list[int], list[int]]]):
    """The learner's two functions on the shipped model's shape (8 query heads, 2 KV
    heads) at 1, 2, 4 and 8 ranks, next to the library's; returns the heads picture."""
    from paged_lib.course.viz import parallel as viz

    def table() -> None:
        for tp in (1, 2, 4, 8):
            mine = kv_bytes_per_rank_fn(_TINY, tp, 2048)
            lib = kv_bytes_per_rank(_TINY, tp, 2048)
            q, k = rank_heads_fn(8, 2, tp, tp - 1)
            print(f"{tp} rank(s): {mine / 2**20:.2f} MiB per rank for 2048 tokens "
                  f"(library {lib / 2**20:.2f}); the last rank owns query heads {q}, "
                  f"KV heads {k}")

    grading.on_learner_code(table, "exercises 12.1 and 12.2", "the shipped model's shards")
    return grading.on_learner_code(lambda: viz.heads_by_rank(8, 2, 4, owners=rank_heads_fn),
                                   "exercise 12.2", "the heads picture from your function")
