"""Chapter 08 (sharing): 08.1 ``apply_slot`` on chapter 08's example, then :class:`Cow` runs;
08.2 ``beam_step`` on :data:`_SCRIPTED` next to the library's, then beam workloads."""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from paged_lib.blocks import BlockAllocator, BlockTable, OutOfBlocks, Slot
from paged_lib.course import grading
from paged_lib.course.grading import generated
from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.generated.small_attention import rng
from paged_lib.course.grading.toy_pool import busy_pool, pool_state
from paged_lib.studies import sharing


class _World:
    """A prefilled prompt on its own pool: the beams' tables and scores."""

    def __init__(self, block_size: int, prompt_len: int, width: int, steps: int):
        self.alloc = BlockAllocator(width * (prompt_len + steps + 2))
        table = BlockTable(self.alloc, block_size)
        for _ in range(prompt_len):
            table.append_token()
        self.tables, self.cum = [table], [0.0]


def on_copies(beam_step: Callable[..., Any]) -> Callable[..., Any]:
    """``beam_step`` handed copies of the lists it may not keep or change (tables, scores,
    candidates); the tables themselves are the learner's to fork and free."""
    @functools.wraps(beam_step)
    def step(tables, cum_logprobs, candidates, beam_width):
        return beam_step(list(tables), list(cum_logprobs), copy.deepcopy(candidates), beam_width)
    return step


def run_beam_scenario(beam_step, name, block_size, prompt_len, width, steps):
    from paged_lib.engine.beam_search import beam_step as ref_step

    beam_step = on_copies(beam_step)
    ref, mine = (_World(block_size, prompt_len, width, len(steps)) for _ in "ab")
    for k, cands in enumerate(steps, 1):
        where = f"scenario '{name}', step {k}"
        expected = ref_step(list(ref.tables), list(ref.cum), cands, width)
        old = list(mine.tables)
        try:
            got = beam_step(list(mine.tables), list(mine.cum), cands, width)
        except IndexError as err:
            if all(len(c) >= width for c in cands):
                raise
            grading.fail(f"{where}: your code raised IndexError ({err}) on candidates {cands}",
                         "a beam may offer fewer than beam_width candidates, or none (the "
                         "engine took out those ending in EOS): use the candidates there are")
        except ValueError as err:
            if "freed" not in str(err):
                raise
            grading.fail(f"{where}: your code used a freed table ({err})", _FREE)
        _check_picks(got, expected, list(mine.cum), cands, width, where)
        _check_tables(list(got), old, mine, ref, where, cands)
        for world, result in ((ref, expected), (mine, got)):
            world.tables = [t for _, t, _, _ in result]
            world.cum = [float(c) for _, _, _, c in result]
            for t in world.tables:  # each new beam writes its token, as the engine does next
                t.append_token()


_TIE = ("your new beams are in score order, but an exact tie goes the other way: the lower beam "
        "index goes first, then the earlier candidate in that beam's list (its rank), not to the "
        "lower token id, nor to another beam's better-ranked candidate (the token id does not "
        "decide; sort(reverse=True) on (score, beam, candidate) tuples reverses that order)")
#: wrong rankings: (sort key on (score, beam, rank in the beam's list, token, this step's
#: logprob), the hint naming it), tried in order on the (parent, token) picks
_RANKINGS: list[tuple[Callable[..., tuple], str]] = [
    (lambda s, i, r, t, lp: (-float(torch.tensor(s, dtype=torch.float32)), i, r), "two "
     "scores here differ by less than float32 can tell: rank the Python floats cum_logprobs"
     "[beam] + logprob themselves (float64), not a float32 tensor of them (torch.tensor of "
     "Python floats is float32) nor rounded scores; only an exact tie goes to the lower beam"),
    (lambda s, i, r, t, lp: (-lp, i, r), "rank candidates by cum_logprobs[beam] + logprob "
     "(the whole sequence), not by this step's logprob alone"),
    (lambda s, i, r, t, lp: (s, i, r), "best first: the highest cumulative log-probability wins"),
]


def _check_picks(got, expected, cum, cands, width, where: str) -> None:
    grading.expect_true(isinstance(got, list | tuple) and all(
        isinstance(b, tuple) and len(b) == 4 for b in got),
        f"{where}: expected a list of (parent, table, token, cum_logprob) tuples, got "
        f"{type(got).__name__}", "return one 4-tuple per new beam, best first")
    grading.expect_true(len(got) <= width, f"{where}: {len(got)} new beams from {len(cands)} "
                        f"beam(s) offering {sum(map(len, cands))} candidates, at width {width}",
                        f"the width bounds the whole search: {width} beams in all, the best "
                        "continuations of every beam together, not each beam's own best")
    grading.expect_equal(len(got), len(expected), f"{where}: number of new beams",
                         "keep beam_width continuations (fewer only if there are fewer "
                         "candidates in all)")
    mine, want = ([(int(p), int(tok)) for p, _, tok, _ in r] for r in (got, expected))
    if mine != want:
        flat = [(i, r, tok, lp) for i, opts in enumerate(cands)
                for r, (tok, lp) in enumerate(opts)]
        score = {(i, tok): cum[i] + lp for i, _, tok, lp in flat}
        per_beam = [(i, opts[0][0]) for i, opts in enumerate(cands) if opts]
        named = [(mine == [(i, tok) for i, r, tok, lp in sorted(flat, key=lambda c: key(
            cum[c[0]] + c[3], *c))][:width], hint) for key, hint in _RANKINGS] + [
            (None not in map(score.get, mine) and [score.get(p) for p in mine] == [
                score.get(p) for p in want], _TIE),
            (sorted(mine) == sorted(want) and mine == sorted(mine, key=lambda p: p[0]),
             "list the new beams best first (by cum_logprob), not by parent"),
            (mine[:len(per_beam)] == per_beam[:width], "compete across all beams: one beam "
             "may keep several children and another none"),
            (True, "rank every (beam, candidate) by cum_logprobs[beam] + logprob across all "
             "beams, best first; ties: lower beam index, then the candidate's order")]
        grading.fail(f"{where}: new beams as (parent, token) {mine}, expected {want}",
                     next(hint for hit, hint in named if hit))
    for i, ((_, _, _, c), (_, _, _, e)) in enumerate(zip(got, expected, strict=True)):
        near = isinstance(c, int | float) and abs(c - e) <= 1e-6 * max(1.0, abs(e))
        grading.expect_close(c, e, f"{where}: new beam {i}'s cum_logprob", rel=1e-9,
                             abs_=1e-9, hint="cum_logprob = cum_logprobs[parent] + the "
                             "candidate's logprob (the whole sequence's log-probability)" + (
                                 ", added as Python floats (float64): a float32 tensor "
                                 "(torch.tensor's default) rounds it at the 7th digit, which "
                                 "reorders near ties" if near else ""))


#: one hint per rule of the tables: who forks, who frees
_FORK = ("the first child continues its parent's own table (the same object); each child "
         "after the first gets parent.fork(), which counts the new table as a holder of every "
         "block (a copy of the object adds no holder, nor does a BlockTable built on its "
         "blocks without an incref); a fork for every child, then a free of every old table, "
         "is a reference taken and given back on each of the parent's blocks, for nothing")
_FREE = ("free only the beams nobody continues, after the forks: free() the table of every old "
         "beam that nobody continues (a beam with no candidates has no continuation either), "
         "exactly once; free the dead beams' tables in ascending beam index (the free list's order "
         "decides which blocks the next allocations take, and the engine's schedule is compared "
         "block by block); a beam that goes on keeps its table, which carries its first child")


def _check_tables(got, old, mine: _World, ref: _World, where: str, cands) -> None:
    seen: set[int] = set()
    for i, (p, table, _, _) in enumerate(got):
        grading.expect_true(isinstance(table, BlockTable), f"{where}: new beam {i}'s table "
                            f"is a {type(table).__name__}", "return the BlockTable itself")
        first, forked = p not in seen, table is not old[p]
        seen.add(p)
        for bad, what, hint in (
                (first and forked and old[p].freed, f"beam {p} goes on, but you freed its "
                 f"table and gave its first child (new beam {i}) a fork of it", _FORK),
                (first and forked, f"new beam {i} is the first child of beam {p} but got a "
                 "new table", _FORK),
                (not first and any(table is t for t in old), f"new beam {i} is a further "
                 f"child of beam {p} but reuses an old table", _FORK),
                (table.freed, f"new beam {i} (a child of beam {p}) got a freed table", _FREE)):
            grading.expect_true(not bad, f"{where}: {what}", hint)
    holders = collections.Counter(b for _, table, _, _ in got for b in table.blocks)
    for block, n in sorted(holders.items()):
        grading.expect_true(mine.alloc.refcount(block) >= n, f"{where}: block {block} is in "
                            f"{n} new beams' tables but its ref count is "
                            f"{mine.alloc.refcount(block)}", _FORK)
    kept = [i for i, t in enumerate(old) if not t.freed and not cands[i]
            and not any(t is b[1] for b in got)]
    left, want = mine.alloc.num_free, ref.alloc.num_free
    (my_refs, my_free), (ref_refs, ref_free) = pool_state(mine.alloc), pool_state(ref.alloc)
    for bad, what in (
            (left < want and kept, f"beam(s) {kept} offered no candidates and still hold "
             "their blocks"),
            (left < want, f"{left} free blocks afterwards, expected {want}: blocks leaked"),
            (left > want, f"{left} free blocks afterwards, expected {want}: a block a new "
             "beam holds went back to the pool"),
            (my_refs == ref_refs and my_free != ref_free and sorted(my_free) == sorted(
                ref_free), "your ref counts are right and the same blocks are free, but the "
             f"free list ends {list(my_free[-4:])}, the library's {list(ref_free[-4:])}"),
            ((my_refs, my_free) != (ref_refs, ref_free), f"(ref counts, free list) "
             f"{(my_refs, my_free)}, expected {(ref_refs, ref_free)}")):
        grading.expect_true(not bad, f"{where}: {what}", _FREE)


#: Mutants of the solution that compute the same thing (see ``tools/mutants.py``).
EQUIVALENT_MUTANTS: dict[str, dict[str, str]] = {"08.2": {
    "constant: `2` -> `1` in `scored.sort(key=lambda c: (-c[0], c[1], c[2]))`":
        "Python's sort is stable and the candidates are listed beam by beam in their own order, "
        "so breaking ties by the beam index twice keeps the candidate order"}}


# ------------------------------------------------------------------ 08.1 apply_slot

def check_apply_slot(apply_slot: Callable[..., Any]) -> None:
    """``apply_slot(k_cache, v_cache, slot, key, value) -> None`` (in place)."""
    with grading.exercise("08.1"):
        _cow_replay(_EXAMPLE, apply_slot)
        numeric.check("08.1", cow_cases(), lambda p: _cow_replay(p, apply_slot), (_STALE, _VIEWS))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(torch.nan_to_num(a, nan=1e9), torch.nan_to_num(b, nan=1e9)))


def _compare(caches, slot: Slot, where: str) -> None:
    (mk, mv), (rk, rv) = caches["mine"], caches["ref"]
    src, dst = slot.copy or (None, None)
    rows = [] if slot.copy is None else [
        ((src,), f"block {src}'s {{}} changed, but the other samples still read it",
         f"other samples still read block {src}, so it stays as it is: the copy goes from "
         f"src to dst (cache[{dst}] = cache[{src}]), and the new token goes into slot.block, "
         "never into the shared src"),
        ((dst, slice(slot.offset)), f"the first {slot.offset} slot(s) of block {dst} ({{}}) "
         f"do not hold the tokens copied from block {src}", "copy the whole block src into "
         "dst first, in K *and* V, in place: the sample's earlier tokens must be in its new "
         f"block {dst} (an out-of-place op, index_copy or torch.where, returns a new tensor "
         "the engine never reads)")]
    at = (slot.block, slot.offset)
    rounded = all(torch.allclose(m[at].double(), r[at].double(), rtol=1e-2, atol=1e-3)
                  for m, r in ((mk, rk), (mv, rv)))
    rows.append((at, f"the new token's {{}} is not at block {slot.block}, offset "
                 f"{slot.offset}" + " (it is there, rounded)" * rounded, "assign key and value "
                 "as given (the cache casts them once), not through another dtype such as "
                 "float16" if rounded else "write key into k_cache[slot.block, slot.offset] "
                 "and value into v_cache[...] after copying (a copy made afterwards "
                 "overwrites it)"))
    for at, what, hint in rows:
        for which, mine, ref in (("K", mk, rk), ("V", mv, rv)):
            grading.expect_true(_same(mine[at], ref[at]), f"{where}: {what.format(which)}", hint)
    for which, mine, ref in (("k_cache", mk, rk), ("v_cache", mv, rv)):
        if mine.dtype != ref.dtype or not _same(mine, ref):
            bad = [b for b in range(len(ref)) if not _same(mine[b].to(ref.dtype), ref[b])]
            grading.fail(f"{where}: {which} ({mine.dtype}) differs from the expected cache "
                         f"in block(s) {bad}",
                         "touch only block dst (the copy) and the slot (block, offset); "
                         "the cache is updated in place and keeps its dtype")


# ------------------------------------------------------------------ 08.1 generated

@dataclass(frozen=True)
class Cow:
    """One run of 08.1 on a pool whose free list is ``free``: steps ("prompt", name, tokens),
    ("fork", parent, child), ("append", name), ("free", name), in a cache that starts NaN or
    ``stale`` (every block holding an earlier request's K/V, as a busy engine's)."""

    seed: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str
    layout: str
    stale: bool
    free: tuple[int, ...]
    steps: tuple[tuple, ...]
    name: str = ""  # a named case: its caches are compared whole after every write

    def describe(self) -> str:
        return (f"block size {self.block_size}, {self.kv_heads} KV head(s) of {self.head_dim}, "
                f"{self.dtype}, {_LAYOUTS[self.layout]}, a cache of " + ("earlier requests' "
                "K/V" if self.stale else "NaN") + f", free list {list(self.free)}, steps "
                f"{list(self.steps)}")

    def states(self) -> list[str]:
        return numeric.reached(
            (f"block size {self.block_size}", self.block_size in (3, 5, 6, 7, 12)),
            ("a cache of earlier requests' K/V", self.stale),
            ("a sequence freed mid-run", any(s[0] == "free" for s in self.steps)),
            (_LAYOUTS["vllm"], self.layout == "vllm"),
            (f"{self.kv_heads} KV head(s)", self.kv_heads != 2))

    def smaller(self) -> Iterator[Cow]:
        def steps() -> Iterator[Cow]:
            for k, step in enumerate(self.steps):
                yield dataclasses.replace(self, steps=self.steps[:k] + self.steps[k + 1:])
                for n in numeric.shorter(step[2]) if step[0] == "prompt" else ():
                    yield dataclasses.replace(self, steps=self.steps[:k] + (
                        step[:2] + (n,),) + self.steps[k + 1:])
            if len(self.free) > 1:
                yield dataclasses.replace(self, free=self.free[:-1])
        yield from filter(_cow_valid, steps())
        yield from numeric.fewer(self, kv_heads=[1], head_dim=[2], dtype=["float32"],
                                 layout=["separate"])


#: chapter 08's example: four samples share block 7 (the prompt's 3 tokens); sample 3
#: writes first, then 1, 2 and 4, three tokens each
_EXAMPLE = Cow(0, 4, 2, 8, "float32", "separate", False, (7, 3, 9, 10, 11, 4, 2, 8, 5, 6, 0, 1),
               (("prompt", "s1", 3), *(("fork", "s1", f"s{i}") for i in (2, 3, 4)),
                *[("append", f"s{i}") for i in (3, 1, 2, 4)] * 3),
               "chapter 08's example: 4 samples share block 7 (block size 4, prompt of 3)")
_LAYOUTS = {"separate": "separate K and V tensors", "flashinfer": "K and V as views of one "
            "[num_blocks, 2, ...] tensor (FlashInfer's)", "vllm": "K and V as views of one "
            "[2, num_blocks, ...] tensor (vLLM's)"}


def _cow_valid(p: Cow) -> bool:
    """Every step names a live sequence, and the pool holds what the steps need."""
    try:
        _cow_replay(p, None)
    except (KeyError, OutOfBlocks):
        return False
    return True


def _draw_cow(seed: int) -> Cow:
    pick = rng(801 + seed)
    bs = pick([1, 2, 3, 4, 5, 6, 7, 8, 12, 16])
    steps, live = [("prompt", "s0", pick([1, bs + 1, 2 * bs - 1]))], ["s0"]
    for n in range(1, pick([8, 11, 14])):
        who, kind = pick(live), pick(["append"] * 4 + ["fork"] * 2 + ["free", "prompt"])
        if kind == "fork" and len(live) < 5:  # both then write: one of them copies
            steps += [("fork", who, f"s{n}"), ("append", f"s{n}"), ("append", who)]
        elif kind == "free" and len(live) > 1:
            steps.append(("free", who))
            live.remove(who)
        elif kind == "prompt":
            steps.append(("prompt", f"s{n}", pick([1, bs, bs + 2])))
        else:
            steps.append(("append", who))
        live += [f"s{n}"] if steps[-1][0] == "prompt" or steps[-3:-2] == [
            ("fork", who, f"s{n}")] else []
    tokens = sum(s[2] if s[0] == "prompt" else s[0] == "append" for s in steps)
    order = torch.randperm(tokens + 3, generator=torch.Generator().manual_seed(seed)).tolist()
    p = Cow(seed, bs, pick([1, 2, 3, 4]), pick([4, 6, 8, 12]),
            pick(["float32", "float16", "bfloat16"]), pick(list(_LAYOUTS)), seed % 4 != 3,
            tuple(order[:tokens]), tuple(steps))
    need = _cow_replay(p, None)  # the most blocks in use at once: a pool that tight (or
    return dataclasses.replace(p, free=p.free[:need + pick([0, 0, 1])])  # one more)


def cow_cases(count: int = 24) -> list[Cow]:
    return [_draw_cow(seed) for seed in range(count)]


def _cow_replay(p: Cow, apply_slot: Callable[..., Any] | None) -> int:
    """Run ``p``'s steps, each token written by the library and by ``apply_slot`` (None:
    the library's alone) into caches of their own; after each write every live sequence
    reads its K and V back through its table from both. Returns the most blocks in use."""
    g = torch.Generator().manual_seed(p.seed)
    dtype, num = getattr(torch, p.dtype), max(p.free, default=0) + 1
    shape = (num, p.block_size, p.kv_heads, p.head_dim)

    def cache() -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:  # K and V, read afresh
        full = (torch.randn((2, *shape), generator=g) if p.stale else
                torch.full((2, *shape), float("nan"))).to(dtype)
        if p.layout == "flashinfer":
            full = full.transpose(0, 1).contiguous().transpose(0, 1)
        elif p.layout == "separate":
            pair = full[0].clone(), full[1].clone()
            return lambda: pair
        return lambda: (full[0], full[1])

    read = {"ref": cache()}
    if apply_slot is not None:
        read["mine"] = cache()
        for a, b in zip(read["mine"](), read["ref"](), strict=True):
            a.copy_(b)
    handed = {who: read[who]() for who in read}  # what each apply_slot is given, once
    alloc, tables, peak = busy_pool(num, p.free), {}, 0
    for k, (kind, who, *rest) in enumerate(p.steps):
        peak = max(peak, len(p.free) - alloc.num_free)
        if kind == "fork":  # (a step of a sequence a shrink dropped: KeyError)
            tables[rest[0]] = tables[who].fork()
        elif kind == "free":
            tables.pop(who).free()
        else:
            if kind == "prompt":
                tables[who] = BlockTable(alloc, p.block_size)
            for _ in range(rest[0] if kind == "prompt" else 1):
                key, value = (torch.randn(p.kv_heads, p.head_dim, generator=g).to(dtype)
                              for _ in "kv")
                slot = tables[who].append_token()
                sharing.apply_slot(*handed["ref"], slot, key.clone(), value.clone())
                if apply_slot is None:
                    continue
                apply_slot(*handed["mine"], slot, key.clone(), value.clone())
                where = f"at step {k} ({kind} {who}), token {tables[who].num_tokens - 1} " \
                    f"({slot})"
                caches = {who: read[who]() for who in read}
                if p.name:
                    _compare(caches, slot, f"scenario '{p.name}', {where}")
                _cow_reads(caches, tables, where)
    return max(peak, len(p.free) - alloc.num_free)


def _cow_reads(caches: dict, tables: dict, where: str) -> None:
    (rk, rv), (mk, mv) = caches["ref"], caches["mine"]
    for name, table in tables.items():
        pos = torch.arange(table.num_tokens)
        blocks = torch.tensor(table.blocks, dtype=torch.long)[pos // table.block_size]
        for which, ref, mine in (("K", rk, mk), ("V", rv, mv)):
            a, b = ref[blocks, pos % table.block_size], mine[blocks, pos % table.block_size]
            same = (torch.nan_to_num(a.float(), 1e9) == torch.nan_to_num(b.float(), 1e9)
                    ).flatten(1).all(1)
            if not bool(same.all()):
                i = int((~same).nonzero()[0])
                grading.fail(f"{where}: sequence {name} reads its token {i}'s {which} from "
                             f"block {int(blocks[i])}: the library's cache holds "
                             f"{a[i].flatten()[0].item():.4g}..., yours "
                             f"{b[i].flatten()[0].item():.4g}...", "copy all of block src into "
                             "dst (K and V), then write the token at (slot.block, "
                             "slot.offset), whatever those slots held")


_VIEWS = numeric.Contrast(
    lambda p: dataclasses.replace(p, layout="separate") if p.layout != "separate" else None,
    "it passes on separate K and V tensors and fails where k_cache and v_cache are views of one "
    "tensor, as an engine may hold them: write through indexing (cache[block, offset] = ...); "
    ".reshape(), .contiguous() or assigning .data may write into a copy the engine never reads")
_STALE = numeric.Contrast(
    lambda p: dataclasses.replace(p, stale=False) if p.stale else None,
    "it passes on a cache of NaN and fails on one whose blocks hold earlier requests' K/V "
    "(a freed block keeps them: nothing clears it, and the next request takes it): copy "
    "and write whatever the slots hold; never test a slot for NaN (or zeros) to decide")


# ------------------------------------------------------------------ 08.2 beam_step

#: name, block size, prompt length, width, candidates per step
_SCRIPTED: list[tuple[str, int, int, int, list]] = [
    ("cumulative scores decide (a beam far behind loses even its best token)", 4, 5, 3,
     [[[(1, -0.1), (2, -1.5), (3, -3.0)]],
      [[(4, -0.7)], [(5, -0.1)], [(6, -0.05)]],
      [[(7, -0.2), (8, -0.3)], [(9, -0.1)], [(10, -0.1)]]]),
    ("exact ties: lower beam first, then the candidate's order", 2, 3, 3,
     [[[(1, -0.5), (2, -0.5), (3, -0.5)]],
      [[(4, -1.0), (5, -1.0)], [(6, -1.0)], [(7, -1.0)]]]),
    ("exact ties with candidates listed in descending token order", 2, 3, 3,
     [[[(9, -0.5), (4, -0.5), (2, -0.5)]],
      [[(8, -1.0), (3, -1.0)], [(7, -0.5)], [(6, -1.0), (1, -1.0)]]]),
    ("EOS took candidates: beam 1 offers none, then beams offer fewer than the width; "
     "a tie the lower beam wins with its second candidate", 4, 6, 2,
     [[[(5, -0.25), (6, -0.75)]],
      [[(1, -0.25)], []],
      [[(2, -0.125), (3, -0.5)]],
      [[(4, -0.5)], [(9, -0.0625), (8, -0.125)]],
      [[(1, -0.5), (2, -0.5625)], [(3, -0.5)]]]),
    ("fewer candidates in all than the width (3): 2 beams, then 3, then 1", 4, 5, 3,
     [[[(1, -0.5), (2, -1.0)]],
      [[(3, -0.25)], [(4, -0.25), (5, -0.5)]],
      [[], [(6, -0.5)], []]]),
    ("two beams die at once: beam 1's one candidate loses, beam 2 offers none (EOS took "
     "them); both are freed in beam order", 2, 3, 3,
     [[[(1, -0.1), (2, -0.2), (3, -0.3)]],
      [[(4, -0.1), (5, -0.2), (7, -0.3)], [(6, -5.0)], []]]),
    ("a near tie: beam 1's token 4 scores 1e-9 above beam 0's tokens 3 and 5 (equal in "
     "float32, not in the float64 of Python's floats)", 4, 5, 2,
     [[[(1, -0.5), (2, -0.7)]],
      [[(3, -1.0), (5, -1.0)], [(4, -0.799999999)]]]),
]


def check_beam_step(beam_step: Callable[..., Any]) -> None:
    """``beam_step(tables, cum_logprobs, candidates, beam_width) -> [(parent, table, token,
    cum_logprob), ...]`` (the engine's :func:`paged_lib.engine.beam_search.beam_step`)."""
    with grading.exercise("08.2"):
        for name, block_size, prompt_len, width, steps in _SCRIPTED:
            run_beam_scenario(beam_step, name, block_size, prompt_len, width, steps)
        generated.check("beam_step", on_copies(beam_step), "the best beam_width continuations "
                        "of all beams by cumulative log-probability; a parent chosen again is "
                        "forked, its own table goes to its best child; the tables nobody "
                        "continues are freed, in beam order, tail first")


def run_beam_search(beam_step: Callable[..., Any], **kw) -> list[sharing.BeamFrame]:
    """A whole (synthetic) beam search driven by the learner's step, recorded."""
    frames, _ = sharing.record_beam_search(step_fn=on_copies(beam_step), **kw)
    return frames
