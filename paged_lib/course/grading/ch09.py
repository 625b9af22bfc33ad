"""Chapter 09 (block size): 09.1 ``internal_waste`` and 09.2 ``choose_block_size`` (fixed and
generated cases, a wrong answer named by the mistake that gives it), 09.3 ``attend_tiles``
(fixed and generated cases against ``paged_attention``; :class:`TileLog` watches the reads).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import numbers
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from types import SimpleNamespace as Case
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric, small_counts
from paged_lib.course.grading.generated.small_attention import rng
from paged_lib.course.grading.slips import name_mistake, name_slip
from paged_lib.kernels.torch_backend import paged_attention_torch
from paged_lib.studies.block_size import choose_block_size, internal_waste
from paged_lib.util import CheckFailed, cdiv

__all__ = ["CASES", "check_attend_tiles", "check_case", "check_choose_block_size",
           "check_internal_waste"]


# ------------------------------------------------------------------ 09.1 internal_waste

def _wrong_waste(lengths: Sequence[int], b: int) -> dict[str, float]:
    """What the typical mistakes return on one case, with the hint that names each."""
    n = [int(x) for x in lengths]
    tok, held = sum(n), sum(cdiv(x, b) * b for x in n)
    mean = tok / len(n)
    at_mean = math.ceil(mean / b) * b

    def share(blocks: Callable[[int], int], den: int | None = None) -> float | None:
        h = sum(blocks(x) * b for x in n)
        return None if (den or h) == 0 else (h - tok) / (den or h)

    out = {
        "a full last block counted as one block more (x // B + 1 blocks: off by one block)":
            share(lambda x: x // b + 1),
        "the partly filled last block is not counted (x // B blocks): it holds the waste":
            share(lambda x: x // b),
        "averaged over sequences instead of over slots: a long sequence holds more slots":
            sum((cdiv(x, b) * b - x) / (cdiv(x, b) * b) for x in n) / len(n),
        "divided by the tokens, not by the slots held": share(lambda x: cdiv(x, b), tok),
        "returned the filled share: the waste is the empty one": 1 - (held - tok) / held,
        "a sequence whose length is a multiple of the block size has no empty slot (B - "
        "length % B counts a whole empty block there)": sum(b - x % b for x in n) / held,
        "divided by the last blocks' slots only: the share is over every slot held":
            (held - tok) / (len(n) * b),
        "computed on the mean length: each sequence rounds up its own last block":
            (at_mean - mean) / at_mean,
        "computed in float32, then cast to a float: the share is off in its 8th digit "
        "(Python's floats are float64)": float(np.float32(held - tok) / np.float32(held))}
    return {numeric.Named(hint): v for hint, v in out.items() if v is not None}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12 + 1e-9 * abs(b)  # as the check's own comparison


def check_internal_waste(fn: Callable[[Sequence[int], int], float]) -> None:
    """09.1: the empty share of whole blocks, over all slots."""
    with grading.exercise("09.1"):
        # valid input first, where a shrink neither reaches bad input nor stops at a crash
        cases = waste_cases(100)
        numeric.check("09.1", [c for c in cases if _valid(c)],
                      lambda p: _valid(p) and _run_waste(fn, p, crash_ok=True), (_POW2,))
        numeric.check("09.1", cases, lambda p: _run_waste(fn, p), (_NEGATIVE, _POW2))


def _valid(p: Waste) -> bool:
    return bool(p.lengths) and min((p.block_size, *p.lengths)) > 0


@dataclass(frozen=True)
class Waste:
    """One generated case of 09.1 (bad input too: what a parsed trace or a config holds)."""

    seed: int
    lengths: tuple[int, ...]
    block_size: int

    def describe(self) -> str:
        return f"internal_waste({list(self.lengths)}, {self.block_size})"

    def states(self) -> list[str]:
        n = self.lengths
        return numeric.reached(("a negative length", any(x < 0 for x in n)),
                               ("a negative block size", self.block_size < 0),
                               ("a pool past 2**32 slots", sum(map(abs, n)) > 2 ** 32),
                               ("a length listed twice", len(set(n)) < len(n)))

    def smaller(self) -> Iterator[Waste]:
        n = self.lengths
        for i in range(len(n)):
            for x in [(), *((v,) for v in sorted({1, -1, max(n[i] // 2, 1)} - {n[i]}))]:
                yield dataclasses.replace(self, lengths=n[:i] + x + n[i + 1:])
        yield from numeric.fewer(self, block_size=sorted({1, -1, self.block_size // 2} - {0}))


def waste_cases(count: int = 40) -> list[Waste]:
    """09.1's generated cases: block sizes not powers of two, repeated lengths, pools past
    2**32 slots, and bad input beyond 0: negative lengths and sizes."""
    picks = [rng(901 + seed) for seed in range(count)]
    return [Waste(seed, tuple(pick([1, 1, 3, 7, 16, 33, 100, 4097, 0, -1, -5, 10 ** 10 + 1])
                              for _ in range(pick([0, 1, 2, 3, 5]))),
                  pick([1, 3, 5, 6, 12, 16, 100, 3 * 10 ** 9, 0, -1, -16]))
            for seed, pick in enumerate(picks)]


def _run_waste(fn: Callable, p: Waste, crash_ok: bool = False) -> None:
    args = (list(p.lengths), p.block_size)
    try:
        want = internal_waste(*args)
    except ValueError:
        grading.expect_value_error(fn, args, "bad input", hint="bad input (no lengths, a "
                                   "length or block size below 1) raises ValueError")
        return
    try:
        got = fn(*args)
    except Exception:
        if crash_ok:
            return
        raise
    grading.expect_true(isinstance(got, numbers.Real) and not isinstance(got, bool),
                        f"expected a float, got {got!r}", hint="return the share as a float")
    if isinstance(got, numbers.Integral) and not _close(float(got), want):
        grading.fail(f"expected {want!r}, got {got!r} (an int)",
                     hint="integer division (//) rounded the share down: divide with /")
    hint = name_mistake(p, got, want, filter(_valid, waste_cases()),
                        lambda c: _wrong_waste(c.lengths, c.block_size),
                        lambda c: fn(list(c.lengths), c.block_size),
                        "each sequence holds ceil(length / B) whole blocks; the waste is "
                        "their empty slots over all their slots", _close)
    grading.expect_close(got, want, "the waste", rel=1e-9, abs_=1e-12, hint=hint)


#: a failing bad input that raises once its negative numbers are 0
_NEGATIVE = numeric.Contrast(
    lambda p: dataclasses.replace(p, lengths=tuple(max(n, 0) for n in p.lengths),
                                  block_size=max(p.block_size, 0))
    if min((p.block_size, *p.lengths)) < 0 else None,
    "it raises ValueError for a length or block size of 0 and not for a negative one: "
    "test below 1 (n < 1), not equal to 0")

_POW2 = numeric.Contrast(
    lambda p: dataclasses.replace(p, block_size=1 << (p.block_size - 1).bit_length())
    if p.block_size > 0 else None, "it passes when the block size is a power of two: a shift "
    "or a bit mask (x >> log2(B), x & (B - 1), (x + B - 1) & ~(B - 1)) is // or % only there")


# --------------------------------------------------------------- 09.2 choose_block_size

#: (lengths, allowed, max_waste, what it tests)
_CHOICE_CASES: list[tuple[list[int], list[int], float, str]] = [
    ([96, 192], [32, 48, 16, 64], 0.05, "an unsorted list of sizes"),
    ([5, 16, 40, 300], [8, 16, 32], 0.10, "vLLM's CUDA kernel sizes"),
    ([3], [1, 2, 4], 0.25, "a waste exactly at the budget"),
    ([20, 70, 33], [256, 512, 1024], 0.05, "FlashAttention's sizes, none fits"),
    ([3], [4, 2], 0.10, "no size fits; two waste the same"),
    ([500, 900, 1500], [32, 8, 16, 256, 64], 0.12, "a long trace"),
    ([47, 95], [20, 24, 40], 0.01, "no size fits; the least wasteful is not the smallest "
     "(sizes that are not powers of two)"),
    ([48, 96], [20, 24, 48], 0.05, "size 20 wastes more than 24 and 48, which divide the "
     "lengths"),
    ([26], [13, 32], 0.2, "size 32 wastes 6 of its 32 slots (but 6 / 26 tokens > 0.2)"),
    ([9], [10, 5], 0.1, "both waste exactly the budget of 0.1 (in float32 a bit more)"),
    ([7], [10, 1], 0.3, "size 10 wastes 3/10, which float division makes exactly 0.3"),
    ([13], [20, 4], 0.35, "size 20 wastes 7/20, which float division makes exactly 0.35 "
     "(in float32 a bit less)"),
    ([5, 25, 45, 42], [20, 5], 0.35, "size 20 wastes 63 of its 180 slots: exactly 0.35"),
    ([23040] * 10_000 + [23039], [25600, 256], 0.1, "size 25600 wastes one slot more than "
     "0.1 of 256,025,600: a hair above the budget as floats, equal to it in float32"),
]


def _wrong_choices(lengths: list[int], allowed: list[int], budget: float) -> dict[str, Any]:
    """What the typical mistakes return on one case (hint -> size): first the rules that
    decide "within the budget" otherwise than as 09.1's float against the float given."""
    waste = {b: internal_waste(lengths, b) for b in allowed}
    held = {b: sum(cdiv(x, b) * b for x in lengths) for b in allowed}
    per_seq = {b: sum((cdiv(x, b) * b - x) / (cdiv(x, b) * b) for x in lengths) / len(lengths)
               for b in allowed}
    tokens, f32 = sum(lengths), np.float32
    rules: dict[str, Callable[[int], bool]] = {
        "the waste computed in float32: a waste exactly at the budget rounds above it":
            lambda b: float(f32(waste[b])) <= budget,
        "the waste equals the budget as the float you are given, so the size fits: "
        "compared as exact fractions with Fraction(max_waste) it lands above":
            lambda b: Fraction(held[b] - tokens, held[b]) <= Fraction(budget),
        "the waste equals the budget as the floats you are given, so the size fits: "
        "max_waste rounded to float32 is a hair below it":
            lambda b: (held[b] - tokens) / held[b] <= float(f32(budget)),
        "the waste is a hair above the budget as Python's floats compute it, so the size "
        "does not fit: in float32 (torch's default dtype, or np.float32) both round alike":
            lambda b: bool(f32(held[b] - tokens) / f32(held[b]) <= f32(budget)),
        "the waste computed as 1 - tokens / held: the subtraction rounds; divide the empty "
        "slots by the slots held": lambda b: 1 - tokens / held[b] <= budget,
        "the budget multiplied out (held - tokens <= max_waste * held): the product rounds":
            lambda b: held[b] - tokens <= budget * held[b],
        "the budget held by every sequence on its own: it is on the memory all the "
        "sequences hold together":
            lambda b: all(internal_waste([x], b) <= budget for x in lengths),
        "a waste exactly at max_waste fits (at most, not below)": lambda b: waste[b] < budget,
        "the waste divided by the tokens (09.1 divides by the slots held)":
            lambda b: held[b] - tokens <= budget * tokens,
        "the slots held rounded up with a bit mask (& ~(B - 1)): right only when B is a power "
        "of two": lambda b: (m := sum((x + b - 1) & ~(b - 1) for x in lengths)) - tokens
        <= budget * m,
        "waste averaged over sequences instead of over slots": lambda b: per_seq[b] <= budget,
    }
    least = min(waste, key=lambda b: (waste[b], b))
    out = {hint: max((b for b in allowed if fits(b)), default=least)
           for hint, fits in rules.items()}
    if not any(per_seq[b] <= budget for b in allowed):
        out["waste averaged over sequences instead of over slots"] = \
            min(per_seq, key=lambda b: (per_seq[b], b))
    fits = [b for b in allowed if waste[b] <= budget]
    return out | ({
        "the smallest block that fits the budget: the largest one is asked": min(fits),
        "the least wasteful size although several keep the budget: the largest one that "
        "keeps it is asked": least,
        "the first size that fits in the list's order: allowed is not sorted": fits[0],
        "stopped at the first size that does not fit, as if the waste grew with the size: "
        "a size that divides the lengths can waste less than a smaller one that does not":
            max(itertools.takewhile(fits.__contains__, sorted(allowed)), default=least),
        "the last size that fits in the list's order: allowed is not sorted": fits[-1],
        "the last size that fits in a set's order: allowed is not sorted, and a set is not "
        "either": [b for b in set(allowed) if waste[b] <= budget][-1]} if fits else {
        "two sizes waste the same: return the smaller":
            max(b for b in allowed if waste[b] == waste[least]),
        "when no size fits, return the one that wastes least": max(allowed),
        "when no size fits, return the one that wastes least: the smallest size does only "
        "when the sizes divide each other": min(allowed),
        "when no size fits, return the one that wastes least (not the first listed)":
            allowed[0]})


def _show(lengths: Sequence[int]) -> str:
    """``lengths`` as a list, runs of one length written ``[n] * k`` when it is long."""
    if len(lengths) <= 12:
        return str(list(lengths))
    runs = [(n, len(list(g))) for n, g in itertools.groupby(lengths)]
    return " + ".join(f"[{n}] * {k}" if k > 1 else f"[{n}]" for n, k in runs)


def check_choose_block_size(fn: Callable[[Sequence[int], Sequence[int], float], int]) -> None:
    """09.2: the largest allowed block size within the waste budget."""
    lost = ("no allowed size keeps the budget here, but the engine still needs a block "
            "size: the one that loses least memory on this workload")
    with grading.exercise("09.2"):
        for lengths, allowed, budget, about in _CHOICE_CASES:
            what = f"choose_block_size({_show(lengths)}, {allowed}, {budget}) ({about})"
            none_fits = all(internal_waste(lengths, b) > budget for b in allowed)
            try:
                got = fn(list(lengths), list(allowed), budget)
            except ValueError as err:
                grading.fail(f"{what}: your function raised ValueError ({err}) on valid input",
                             lost if none_fits else "raise ValueError only for bad input")
            grading.expect_int(got, what, hint=lost if none_fits and got is None
                               else "return one of the allowed sizes, an int")
            hint = name_mistake((lengths, allowed, budget), got,
                                want := choose_block_size(lengths, allowed, budget),
                                _CHOICE_CASES, lambda c: _wrong_choices(*c[:3]),
                                lambda c: fn(list(c[0]), list(c[1]), c[2]),
                                "the largest allowed size whose waste (over all slots) is at "
                                "most max_waste; if none, the least wasteful, the smaller on "
                                "a tie")
            grading.expect_equal(int(got), want, what=what, hint=hint)
        for args, what in ((([5], [], 0.1), "no allowed size"),
                           (([5], [8], 1.0), "max_waste = 1"),
                           (([5], [8], -0.1), "a negative max_waste")):
            grading.expect_value_error(fn, args, f"choose_block_size with {what}",
                                       hint="bad input (no allowed size, max_waste outside "
                                       "[0, 1)) raises ValueError")
        small_counts.choice_stage(fn)  # generated: budgets one ulp from a waste


# ------------------------------------------------------------------ 09.3 attend_tiles

_ONE_STATE = "between tiles hold one running (m, l, acc) and nothing else"
_READS = (torch.Tensor.__getitem__, torch.index_select, torch.Tensor.index_select,
          torch.gather, torch.Tensor.gather, torch.take, torch.Tensor.take)


class TileLog:
    """One call of the learner's function: its reads, what it holds, the first problem."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                 seq_len: int, tile: int, num_heads: int):
        nb, bs, nkv, d = k_cache.shape
        posmap = torch.full((nb, bs), -1, dtype=torch.int64)
        for j, b in enumerate(table.tolist()[:-(-seq_len // bs)] if seq_len else []):
            n = min(bs, seq_len - j * bs)
            posmap[b, :n] = torch.arange(j * bs, j * bs + n)
        posmap = torch.where(posmap >= 0, posmap * nkv, posmap)  # position * nkv + KV head
        self.caches = {}  # storage pointer -> (kind, element-wise position map, its offset)
        for kind, cache in (("K", k_cache), ("V", v_cache)):
            full = (posmap[:, :, None, None] + torch.arange(nkv)[None, None, :, None]
                    * (posmap[:, :, None, None] >= 0)).expand(cache.shape).contiguous()
            self.caches[cache.untyped_storage().data_ptr()] = kind, full, cache.storage_offset()
        self.tile, self.small, self.block_size, self.num_kv_heads = tile, num_heads * d, bs, nkv
        self.seq_len, self.state, self.pending, self.trips = seq_len, num_heads * (d + 2), [], {}
        self.live: dict[int, weakref.ref] = {}
        self.problem = self.hint = None  # the first problem flagged, and its hint
        self.past_end = False  # a read returned a slot past seq_len (or of the padding)
        #: the first op to make inf or nan of finite inputs: (name, what, an input held 0)
        self.made_nonfinite: tuple[str, str, bool] | None = None

    def flag(self, problem: str, hint: str) -> None:
        if self.problem is None:
            self.problem, self.hint = problem, hint

    def positions(self, t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """(kind, the position of every element of ``t``) if ``t`` is a cache or a view."""
        found = self.caches.get(t.untyped_storage().data_ptr())
        if found is None:
            return None
        kind, full, base = found
        return kind, full.as_strided(t.shape, t.stride(), t.storage_offset() - base)

    def read(self, kind: str, pos: torch.Tensor) -> tuple[int, int] | None:
        """Log one read of positions ``pos``; its in-sequence span."""
        inside = pos[pos >= 0]
        self.past_end |= inside.numel() < pos.numel()
        if inside.numel() == 0:
            return None
        lo, hi = (int(x) // self.num_kv_heads for x in (inside.min(), inside.max()))
        self.pending += [(kind, p) for p in inside.unique().tolist()]
        self._check_live(lo)
        return lo, hi

    def fold(self) -> None:
        """An exp: the K (V) rows read since the last one are one trip of each KV head read;
        trip ``k`` covers tile ``k`` (walked backwards, the ``k``-th from the end), and no
        more than the blocks it spans; a row read twice is a second pass."""
        nkv, t, bs, n = self.num_kv_heads, self.tile, self.block_size, self.seq_len
        for kind, head in sorted({(k, p % nkv) for k, p in self.pending}):
            rows = [p // nkv for k, p in self.pending if (k, p % nkv) == (kind, head)]
            keys, trips = sorted(set(rows)), self.trips.setdefault((kind, head), [])
            if len(rows) > len(keys) or len(trips) >= cdiv(n, t):
                self.flag(f"read {kind} (KV head {head}) of positions passed again: a second "
                          "pass over the sequence (the max first, then the sum)", "one pass over "
                          "the tiles is enough (rescale by exp(m_old - m_new)), and one read per "
                          "KV head serves its query heads (a loop over KV heads, not over query "
                          "heads)")
            i = len(trips) if (trips or [keys])[0][0] == 0 else cdiv(n, t) - 1 - len(trips)
            a, b = i * t, min(i * t + t, n) - 1
            trips.append(keys)
            if not set(range(a, b + 1)) <= set(keys) or keys[0] < a - a % bs \
                    or keys[-1] >= cdiv(b + 1, bs) * bs:
                self.flag(f"trip {len(trips) - 1} read {kind} (KV head {head}) of {len(keys)}"
                          f" positions, {keys[0]}-{keys[-1]}, for one exp; tile {i} is "
                          f"positions {a}-{b}", "fold each tile into the running (m, l, acc) "
                          "when you reach it (gather it, exp its scores, rescale), not the "
                          "whole sequence at once" if len(keys) == n else
                          f"one loop trip covers one tile of `tile` = {t} positions (trip i: "
                          "i * tile to (i + 1) * tile - 1), not a block, nor part of a tile")
        self.pending = []

    def _check_live(self, lo: int) -> None:
        """At a read from ``lo`` on (of tile ``now``): what is still alive from tile ``now - 2``
        or older (scores that grow tile after tile are trips of more than a tile)."""
        now, held = lo // self.tile, {}  # held: tile -> numbers depending on it
        for key, ref in list(self.live.items()):
            t = ref()
            if t is None:
                del self.live[key]
                continue
            last = t._span[1] // self.tile
            if last > now - 2:
                continue
            held[last] = held.get(last, 0) + t.numel()
            if t.numel() > self.small:
                self.flag(f"at tile {now} you still hold a {tuple(t.shape)} tensor from tile "
                          f"{last}: you keep earlier tiles' scores or values", "fold each "
                          "tile into the running (m, l, acc) and let its scores and values go")
        if len(held) > 1 and sum(held.values()) > 1.5 * self.state:
            self.flag(f"at tile {now} you still hold {sum(held.values())} numbers from tiles "
                      f"{sorted(held)}: you keep every tile's scores or state and combine them "
                      "at the end", _ONE_STATE)

    def track(self, t: torch.Tensor, span: tuple[int, int]) -> None:
        t._span = span
        self.live[id(t)] = weakref.ref(t)


_ACTIVE: list[TileLog] = []


class TileTensor(torch.Tensor):
    """A cache, or a tensor computed from it, that reports to the active :class:`TileLog`;
    ``_span``: the first and last position its value depends on."""

    _span: tuple[int, int] | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = super().__torch_function__(func, types, args, kwargs)
        if _ACTIVE:
            with torch._C.DisableTorchFunctionSubclass():
                _after(_ACTIVE[-1], func, args, kwargs, out)
        return out


def _after(log: TileLog, func, args, kwargs, out) -> None:
    outs = [t for t in tree_leaves(out) if isinstance(t, TileTensor)]
    if not outs:
        return
    ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    views = [(t, p) for t in ins if (p := log.positions(t)) is not None]
    if views and any(log.positions(o) is not None for o in outs):
        return  # a view of the cache: nothing read yet
    if views and func in _READS and args and args[0] is views[0][0]:
        (t, (kind, pos)) = views[0]
        try:  # the same read on the position map: the positions it returned
            pos = func(pos, *args[1:], **{k: x for k, x in kwargs.items() if k != "out"})
        except (RuntimeError, IndexError, TypeError):
            pass  # (then every position of what it read from)
        reads = [log.read(kind, pos)]
    else:  # an op on views of the cache (a copy, a cat, an einsum) reads them whole
        reads = [log.read(kind, pos) for _, (kind, pos) in views]
    if any(w in getattr(func, "__name__", "") for w in ("exp", "softmax")):
        log.fold()
    if log.made_nonfinite is None:
        _watch_finite(log, func, ins, outs)
    spans = [s for s in [getattr(t, "_span", None) for t in ins] + reads if s is not None]
    for o in outs if spans else ():
        log.track(o, (min(s[0] for s in spans), max(s[1] for s in spans)))


def _watch_finite(log: TileLog, func, ins: list[torch.Tensor], outs: list) -> None:
    """Note the first op that made inf or NaN of finite numbers (not NaN read past the end)."""
    floats = [t for t in ins if t.is_floating_point()]
    made = [o for o in outs if o.is_floating_point() and not bool(o.isfinite().all())]
    name = getattr(func, "__name__", str(func))
    if made and any(w in name for w in ("exp", "div", "softmax")) \
            and all(bool(t.isfinite().all()) for t in floats):
        what = "inf" if any(bool(o.isinf().any()) for o in made) else "nan"
        zero = any(bool((t == 0).any()) for t in floats)
        log.made_nonfinite = (name, what, zero)


@contextlib.contextmanager
def watching(log: TileLog, k_cache: torch.Tensor, v_cache: torch.Tensor
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``with watching(log, k, v) as (k, v):`` the learner reads ``k`` and ``v``, watched."""
    _ACTIVE.append(log)
    try:
        yield k_cache.as_subclass(TileTensor), v_cache.as_subclass(TileTensor)
    finally:
        _ACTIVE.remove(log)
        log.live.clear()
        log.fold()  # what was read after the last exp (or by an attention with no exp)


#: (name, seed, block size, tile, seq_len[, dtype, profile, loud[, sign]]): float32 random
CASES = [(name, numeric.Tiles(seed, bs, tile, n, 4, 2, 8, *(more or ("fp32", "random", 1.0))))
         for name, seed, bs, tile, n, *more in [
    ("blocks of 4, tiles of 4 (a tile is a block), 13 tokens", 1, 4, 4, 13),
    ("blocks of 4, tiles of 2 (two tiles per block), 11 tokens", 2, 4, 2, 11),
    ("an empty sequence (length 0): zeros", 10, 4, 3, 0),
    ("scores in the hundreds, as a sharp softmax has them: exp of a raw score overflows "
     "float32 (blocks of 4, tiles of 5, 18 tokens)", 17, 4, 5, 18, "fp32", "rising", 4.0),
    ("scores in the hundreds below zero: exp of a raw score is 0 in float32 (blocks of 4, "
     "tiles of 5, 18 tokens)", 18, 4, 5, 18, "fp32", "offset", 30.0, -1.0),
    ("float16 (blocks of 8, tiles of 4, 27 tokens)", 16, 8, 4, 27, "fp16", "random", 1.0),
]]


def reference(c: Case) -> torch.Tensor:
    """The library's answer: paged_attention's torch backend."""
    return paged_attention_torch(c.q[None], c.k_cache, c.v_cache, c.table[None].clamp(min=0),
                                 torch.tensor([c.seq_len], dtype=torch.int32),
                                 c.q.shape[-1] ** -0.5)[0]


def _variant(c: Case, *, block_of: str = "block", rescale: bool | str = True,
             kv: str = "group", scale: bool = True, wide: torch.dtype | None = None,
             whole_tiles: bool = False) -> torch.Tensor:
    """Online softmax over tiles with one typical mistake (defaults: none); ``rescale``:
    True, False, only "l" or "acc", or "inverted" (by exp(m_new - m_old))."""
    h, d = c.q.shape
    bs, nkv = c.k_cache.shape[1], c.k_cache.shape[2]
    dt = wide or (torch.float64 if c.q.dtype == torch.float64 else torch.float32)
    heads = torch.arange(h) // (h // nkv) if kv == "group" else torch.arange(h) % nkv
    qf = c.q.to(dt) * (d ** -0.5 if scale else 1.0)
    m = torch.full((h,), -math.inf, dtype=dt)
    den, acc = torch.zeros(h, dtype=dt), torch.zeros(h, d, dtype=dt)
    end = c.seq_len // c.tile * c.tile if whole_tiles else c.seq_len
    for start in range(0, end, c.tile):
        pos = torch.arange(start, min(start + c.tile, c.seq_len))
        blocks = c.table.long()[pos // (bs if block_of == "block" else c.tile)]
        k = c.k_cache[blocks, pos % bs].to(dt)[:, heads]  # [t, h, d]
        v = c.v_cache[blocks, pos % bs].to(dt)[:, heads]
        s = torch.einsum("hd,thd->ht", qf, k)
        m_new = torch.maximum(m, s.amax(-1))
        one = torch.ones_like(m)
        alpha = torch.exp(m - m_new) if rescale else one
        if rescale == "inverted":  # (the first tile has nothing summed to rescale)
            alpha = torch.where(m.isinf(), one, torch.exp(m_new - m))
        p = torch.exp(s - m_new[:, None])
        den = den * (alpha if rescale in (True, "l", "inverted") else one) + p.sum(-1)
        acc = acc * (alpha if rescale in (True, "acc", "inverted") else one)[:, None] \
            + torch.einsum("ht,thd->hd", p, v)
        m = m_new
    return (acc / den[:, None]).to(c.q.dtype) if end else torch.zeros_like(c.q)


#: (how the mistake is made, the hint naming it)
_MISTAKES: list[tuple[dict, str]] = [
    (dict(rescale=False), "when a tile raises the running max, the denominator and the "
     "accumulator are rescaled by exp(m_old - m_new); yours rescales neither"),
    (dict(rescale="inverted"), "the rescaling factor is exp(m_old - m_new), at most 1, not "
     "exp(m_new - m_old)"),
    (dict(rescale="l"), "the accumulator is rescaled by exp(m_old - m_new) as the denominator is"),
    (dict(rescale="acc"), "the denominator l is rescaled by exp(m_old - m_new) as the accumulator "
     "is"),
    (dict(block_of="tile"), "a token's block is block_table[pos // block_size], whatever the "
     "tile: a tile may span several blocks"),
    (dict(kv="mod"), "query head h reads KV head h // (num_heads // num_kv_heads); yours read "
     "KV head h % num_kv_heads, as .repeat(...) lays them out (not repeat_interleave)"),
    (dict(scale=False), "scores are q . k / sqrt(head_dim)"),
    (dict(whole_tiles=True), "the last tile holds what is left (seq_len % tile tokens)"),
    (dict(wide=torch.float32), "computed in float32, then cast to float64: compute in float64 "
     "when q is float64"),
]


def _hint(c: Case, p: numeric.Tiles, got: torch.Tensor, want: torch.Tensor, log: TileLog) -> str:
    lo, hi = p.scores()
    if c.seq_len == 0:
        return "a sequence of length 0 has nothing to attend to: return zeros, not 0 / 0"
    made = log.made_nonfinite
    if not got.isfinite().all() and want.isfinite().all() and (made or log.past_end):
        if made is None:
            return ("NaN: a slot past the sequence's end was read (unused slots are NaN): "
                    "read only positions below seq_len")
        if "exp" in made[0] and made[1] == "inf":
            return (f"exp of a raw score overflows (scores here reach {hi:.0f}; float32's exp "
                    "is inf from 89 on): subtract the running max m before exp")
        if made[1] == "nan" and made[2]:  # 0 / 0
            return (f"exp underflowed to 0 for every score of a head (scores down to {lo:.0f}"
                    "), and 0 / 0 is NaN: subtract the running max, starting from -inf (not 0)")
        return (f"{made[0]} turned finite numbers into {made[1]} (scores {lo:.0f} to {hi:.0f}"
                "): keep every exp's argument at most 0 by subtracting the running max")
    slips, hints = {}, {}
    for i, (how, hint) in enumerate(_MISTAKES):
        with contextlib.suppress(IndexError, RuntimeError):
            slips[i], hints[i] = _variant(c, **how).double(), hint
    return numeric.Named(n) if (n := name_slip(got, want, slips, hints)) else (
        "each tile's tokens are gathered from their blocks and folded into the running max, "
        "denominator and accumulator")  # (a Named hint is not replaced by a contrast)


def check_case(fn: Callable, p: numeric.Tiles, name: str | None = None) -> None:
    """``fn`` on ``p``'s case (named ``name``, by default its seed's) against the library."""
    c = Case(**{**p.build(), **({"name": name} if name else {})})
    what = (f"case '{c.name}': attend_tiles(q [{c.q.shape[0]}, {c.q.shape[1]}], table "
            f"{c.table.tolist()}, seq_len={c.seq_len}, tile={c.tile})")
    want = reference(c)
    k_cache, v_cache = c.k_cache.clone(), c.v_cache.clone()  # the learner's to change
    log = TileLog(k_cache, v_cache, c.table, c.seq_len, c.tile, c.q.shape[0])
    try:
        with watching(log, k_cache, v_cache) as (k, v):
            got = fn(c.q.clone(), k, v, c.table.clone(), c.seq_len, c.tile)
    except (CheckFailed, NotImplementedError):
        raise
    except Exception as err:  # noqa: BLE001 - told with the case that raised it
        grading.fail(f"{what}: your function raised {type(err).__name__}: {err}",
                     _MISTAKES[4][1] + "; positions run from 0 to seq_len - 1 only"
                     if isinstance(err, IndexError) else None)
    grading.expect_true(isinstance(got, torch.Tensor), f"{what}: returned "
                        f"{type(got).__name__}", "return a tensor [num_heads, head_dim]")
    got = got.as_subclass(torch.Tensor) if isinstance(got, TileTensor) else got
    grading.expect_true(got.dtype == c.q.dtype and tuple(got.shape) == tuple(c.q.shape),
                        f"{what}: returned {got.dtype} {tuple(got.shape)}, expected "
                        f"{c.q.dtype} {tuple(c.q.shape)}", "the output has q's shape and dtype"
                        + ("" if tuple(got.shape) != tuple(c.q.shape) else ": compute wide, "
                           "then cast the result with .to(q.dtype)"))
    # (float32: an absolute 1e-5, as an output near 0 sums terms of about 1)
    tol = {torch.float64: (1e-10, 1e-12), torch.float16: (2e-3, 2e-3)}.get(c.q.dtype, (1e-5, 1e-5))
    bad = ~torch.isclose(got.double(), want.double(), *tol)
    if bad.any():
        h, i = (int(x) for x in bad.nonzero()[0])
        grading.fail(f"{what}: head {h}, element {i}: expected {float(want[h, i]):.6g}, got "
                     f"{float(got[h, i]):.6g}", _hint(c, p, got, want, log))
    grading.expect_true(log.problem is None, f"{what}: {log.problem}", log.hint)


def check_attend_tiles(fn: Callable[..., torch.Tensor]) -> None:
    """09.3: decode attention over tiles of ``tile`` tokens through a block table."""
    with grading.exercise("09.3"):
        for name, p in CASES:
            check_case(fn, p, name)
        numeric.check("09.3", numeric.tile_cases(), lambda p: check_case(fn, p),
                      (*numeric.TILE_CONTRASTS, _POW2))
