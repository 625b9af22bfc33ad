"""The side-by-side replay behind the chapter 08 check of ``beam_step``.

:func:`run_beam_scenario` starts two worlds, each a prefilled prompt on its own pool
with a :class:`~paged_lib.course.grading.toy_pool.ToyStore`, and steps beam search in
both: the engine's :func:`paged_lib.engine.beam_search.beam_step` in one, the learner's
in the other, on scripted candidates (random ones come in the engine, from the generated
stage). After
every step it compares the chosen (parent, token) pairs and scores, which table each
new beam got, the ref counts and free list; then every new beam appends, and the slots
(copies) and each beam's tokens read back must match. Each difference fails with a hint
that names the mistake. :func:`serve_beams` then serves real beam groups in the engine
with the learner's step.
"""

from __future__ import annotations

import copy
import functools
import struct
from collections.abc import Callable
from typing import Any

from paged_lib.blocks import BlockAllocator, BlockTable
from paged_lib.course import grading
from paged_lib.course.grading import serving
from paged_lib.course.grading.toy_pool import ToyStore, pool_state


class _World:
    """A prefilled prompt on its own pool, plus what every beam should read back."""

    def __init__(self, block_size: int, prompt_len: int, width: int, steps: int):
        self.alloc = BlockAllocator(width * (prompt_len + steps + 2))
        self.store = ToyStore(block_size)
        table = BlockTable(self.alloc, block_size)
        for t in range(prompt_len):
            self.store.write(table.append_token(), t)
        self.tables, self.cum = [table], [0.0]
        self.seqs = [list(range(prompt_len))]

    def state(self) -> tuple[list[int], list[int]]:
        return pool_state(self.alloc)


def on_copies(beam_step: Callable[..., Any]) -> Callable[..., Any]:
    """``beam_step`` handed copies of what it may not keep or change: the tables list, the
    cumulative log-probabilities and every beam's candidate list (an answer that pops from
    them must not change what the grader, the library or the engine reads next). The
    tables themselves are the learner's to fork and free."""
    @functools.wraps(beam_step)
    def step(tables, cum_logprobs, candidates, beam_width):
        return beam_step(list(tables), list(cum_logprobs), copy.deepcopy(candidates),
                         beam_width)
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
            grading.fail(f"{where}: your code raised IndexError ({err}) on candidates "
                         f"{cands}", "a beam may offer fewer than beam_width candidates, or "
                         "none (the engine took out those ending in EOS): use the "
                         "candidates there are")
        except ValueError as err:
            if "freed" not in str(err):
                raise
            grading.fail(f"{where}: your code used a freed table ({err})",
                         "free only the beams nobody continues, after the forks: a table "
                         "that is freed cannot be forked or continued")
        got = _check_picks(got, expected, list(mine.cum), cands, width, where)
        _check_tables(got, old, mine, ref, where, cands)
        for world, result in ((ref, expected), (mine, got)):
            world.seqs = [world.seqs[p] + [1000 * k + i]
                          for i, (p, _, _, _) in enumerate(result)]
            world.tables = [t for _, t, _, _ in result]
            world.cum = [float(c) for _, _, _, c in result]
        _append_and_compare(mine, ref, where)


def _picks(result) -> list[tuple[int, int]]:
    return [(int(p), int(tok)) for p, _, tok, _ in result]


def _check_picks(got, expected, cum, cands, width, where: str):
    if not isinstance(got, list | tuple) or not all(
            isinstance(b, tuple) and len(b) == 4 for b in got):
        grading.fail(f"{where}: expected a list of (parent, table, token, cum_logprob) "
                     f"tuples, got {type(got).__name__}",
                     "return one 4-tuple per new beam, best first")
    if len(got) > width:
        offered = sum(len(c) for c in cands)
        grading.fail(f"{where}: {len(got)} new beams from {len(cands)} beam(s) offering "
                     f"{offered} candidates, at width {width}",
                     f"the width bounds the whole search: {width} beams in all, the best "
                     "continuations of every beam together, not each beam's own best")
    grading.expect_equal(len(got), len(expected), f"{where}: number of new beams",
                         "keep beam_width continuations (fewer only if there are fewer "
                         "candidates in all)")
    mine, want = _picks(got), _picks(expected)
    if mine != want:
        grading.fail(f"{where}: new beams as (parent, token) {mine}, expected {want}",
                     _pick_hint(mine, want, cum, cands, width))
    for i, ((_, _, _, c), (_, _, _, e)) in enumerate(zip(got, expected, strict=True)):
        grading.expect_close(c, e, f"{where}: new beam {i}'s cum_logprob", rel=1e-9,
                             abs_=1e-9, hint="cum_logprob = cum_logprobs[parent] + the "
                             "candidate's logprob (the whole sequence's log-probability)")
    return list(got)


def _score(pick: tuple[int, int], cum, cands) -> float | None:
    """cum_logprob of beam ``pick[0]`` continued by token ``pick[1]`` (None: not offered)."""
    parent, token = pick
    if not 0 <= parent < len(cands):
        return None
    return next((cum[parent] + lp for tok, lp in cands[parent] if tok == token), None)


def _tie_hint(mine, want, cum, cands) -> str | None:
    """The hint when the picks score exactly as the library's and only tied ones differ."""
    scores = [_score(p, cum, cands) for p in mine]
    if None in scores or scores != [_score(p, cum, cands) for p in want]:
        return None
    j = next(j for j, (a, b) in enumerate(zip(mine, want, strict=True)) if a != b)
    (p, tok), (q, first) = mine[j], want[j]
    same = (f"beam {q}'s tokens {first} and {tok} both score {scores[j]!r}, and beam {q} "
            f"lists token {first} first" if p == q else
            f"beam {q}'s token {first} and beam {p}'s token {tok} both score {scores[j]!r}")
    put = f"token {tok}" if p == q else f"beam {p}'s"
    return (f"your new beams are in score order, but an exact tie goes the other way: {same}; "
            f"you put {put} first. On an exact tie the lower beam index goes first, then "
            "the earlier candidate in that beam's list (sort(reverse=True) on (score, beam, "
            "candidate) tuples reverses that tie order too; the token id does not decide)")


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _pick_hint(mine, want, cum, cands, width) -> str:
    flat = [(i, r, tok, lp) for i, opts in enumerate(cands) for r, (tok, lp) in enumerate(opts)]

    def top(key: Callable) -> list[tuple[int, int]]:
        """The (beam, token) picks of ``flat`` sorted by ``key(score, beam, rank, token,
        logprob)``, the first ``width``."""
        return [(i, tok) for i, r, tok, lp in sorted(flat, key=lambda c: key(
            cum[c[0]] + c[3], *c))][:width]

    if mine == top(lambda s, i, r, t, lp: (-_float32(s), i, r)):
        return ("two scores here differ by less than float32 can tell: rank the Python "
                "floats cum_logprobs[beam] + logprob themselves (float64), not a float32 "
                "tensor of them (torch.tensor of Python floats is float32) nor rounded "
                "scores; only an exact tie goes to the lower beam")
    rank_first = top(lambda s, i, r, t, lp: (-s, r, i))
    if mine == top(lambda s, i, r, t, lp: (-s, i, t)) and mine != rank_first:
        return ("an exact tie goes to the earlier candidate in the beam's list (its rank), "
                "not to the lower token id: here the tied candidates come in descending "
                "token order")
    if mine == top(lambda s, i, r, t, lp: (-lp, i, r)):
        return ("rank candidates by cum_logprobs[beam] + logprob (the whole sequence), not "
                "by this step's logprob alone")
    if mine == top(lambda s, i, r, t, lp: (s, i, r)):
        return "best first: the highest cumulative log-probability wins"
    if mine == rank_first:
        return ("an exact tie goes to the lower beam index first, then to the earlier "
                "candidate in that beam's list (not to the better-ranked candidate)")
    tie = _tie_hint(mine, want, cum, cands)
    if tie:
        return tie
    if sorted(mine) == sorted(top(lambda s, i, r, t, lp: (-s, i, r))) and \
            mine == sorted(mine, key=lambda p: p[0]):
        return "list the new beams best first (by cum_logprob), not by parent"
    per_beam = [(i, opts[0][0]) for i, opts in enumerate(cands) if opts]
    if mine[:len(per_beam)] == per_beam[:width]:
        return ("compete across all beams: one beam may keep several children and another "
                "none")
    return ("rank every (beam, candidate) by cum_logprobs[beam] + logprob across all beams, "
            "best first; ties: lower beam index, then the candidate's order")


def _check_tables(got, old, mine: _World, ref: _World, where: str, cands) -> None:
    seen: set[int] = set()
    for i, (p, table, _, _) in enumerate(got):
        first = p not in seen
        seen.add(p)
        if first and table is not old[p] and getattr(old[p], "_freed", False):
            grading.fail(f"{where}: beam {p} goes on, but you freed its table and gave its "
                         f"first child (new beam {i}) a fork of it",
                         "a fork for every child, then a free of every old table: a "
                         "reference taken and given back on each of the parent's blocks, "
                         "for nothing; the first child continues its parent's own table "
                         "(the same object), only the further children fork it")
        if first and table is not old[p]:
            grading.fail(f"{where}: new beam {i} is the first child of beam {p} but got a new "
                         "table", "the first child continues its parent's own table (the "
                         "same object); only the further children fork it")
        if not first and any(table is t for t in old):
            grading.fail(f"{where}: new beam {i} is a further child of beam {p} but reuses "
                         "an old table", "each child after the first gets parent.fork()")
        if not isinstance(table, BlockTable):
            grading.fail(f"{where}: new beam {i}'s table is a {type(table).__name__}",
                         "return the BlockTable itself")
    for i, (p, table, _, _) in enumerate(got):
        if getattr(table, "_freed", False):
            grading.fail(f"{where}: new beam {i} (a child of beam {p}) got a freed table",
                         f"beam {p} goes on: its table carries its first child, and the "
                         "engine writes the next token through it; free only the tables "
                         "of the beams nobody continues")
    _check_holders(got, mine, where)
    kept = [i for i, t in enumerate(old) if not getattr(t, "_freed", False)
            and not cands[i] and not any(t is b[1] for b in got)]
    if mine.alloc.num_free < ref.alloc.num_free and kept:
        grading.fail(f"{where}: beam(s) {kept} offered no candidates and still hold their "
                     "blocks", "a beam with no candidates has no continuation either: it "
                     "dies like any beam nobody continues, free() its table")
    if mine.alloc.num_free < ref.alloc.num_free:
        grading.fail(f"{where}: {mine.alloc.num_free} free blocks afterwards, expected "
                     f"{ref.alloc.num_free}: blocks leaked",
                     "free() the table of every old beam that nobody continues")
    if mine.alloc.num_free > ref.alloc.num_free:
        grading.fail(f"{where}: {mine.alloc.num_free} free blocks afterwards, expected "
                     f"{ref.alloc.num_free}: a block a new beam holds went back to the pool",
                     "free only the beams nobody continues; a fork holds its own references")
    _free_order(mine, ref, where)
    grading.expect_equal(mine.state(), ref.state(), f"{where}: (ref counts, free list)",
                         "fork with table.fork() (no incref by hand) and free each dead "
                         "beam's table exactly once")


def _free_order(mine: _World, ref: _World, where: str) -> None:
    """Right ref counts and the right free blocks, in another order: name the order."""
    (my_refs, my_free), (ref_refs, ref_free) = mine.state(), ref.state()
    if my_refs == ref_refs and my_free != ref_free and sorted(my_free) == sorted(ref_free):
        grading.fail(f"{where}: your ref counts are right and the same blocks are free, "
                     f"but the free list ends {list(my_free[-4:])}, the library's "
                     f"{list(ref_free[-4:])}",
                     "free the dead beams' tables in ascending beam index: the free list's "
                     "order decides which blocks the next allocations take, and the "
                     "engine's schedule is compared block by block")


def _check_holders(got, mine: _World, where: str) -> None:
    """A block the pool counts fewer holders for than the new beams' tables holding it."""
    holders: dict[int, int] = {}
    for _, table, _, _ in got:
        for block in table.blocks:
            holders[block] = holders.get(block, 0) + 1
    for block, n in sorted(holders.items()):
        refs = mine.alloc.refcount(block)
        if refs < n:
            grading.fail(f"{where}: block {block} is in {n} new beams' tables but its ref "
                         f"count is {refs}",
                         "a table that holds a block must be counted as its holder, or the "
                         "first free or copy-on-write write takes the block from the others: "
                         "a second table on the same blocks comes from table.fork() (a copy "
                         "of the object adds no holder, nor does a BlockTable built on its blocks "
                         "without an incref)")


def _append_and_compare(mine: _World, ref: _World, where: str) -> None:
    """Each new beam writes its token, as the engine does next; who copies what?"""
    for world in (ref, mine):
        world.slots = [t.append_token() for t in world.tables]
        for slot, seq in zip(world.slots, world.seqs, strict=True):
            world.store.write(slot, seq[-1])
    grading.expect_equal([(s.block, s.offset, s.copy) for s in mine.slots],
                         [(s.block, s.offset, s.copy) for s in ref.slots],
                         f"{where}: then each new beam appends; slots (block, offset, copy)",
                         "a new beam's table must hold exactly its parent's blocks and tokens")
    for i, table in enumerate(mine.tables):
        grading.expect_equal(mine.store.read(table), mine.seqs[i],
                             f"{where}: beam {i} reads back", "a fork must share its "
                             "parent's blocks: never hand two new beams the same table")
    grading.expect_equal(mine.state(), ref.state(), f"{where}: after the appends, "
                         "(ref counts, free list)", "free each dead beam exactly once")


# ------------------------------------------------------------------ in the engine


def serve_beams(beam_step: Callable[..., Any]) -> None:
    """Real beam groups in the engine: serving.beam_workload (beams of 3 and 4, parallel
    samples, swaps, chunks) served with the learner's step; the beams and each step's
    schedule must be the library engine's."""
    name, want, want_steps = _library_beams()
    _, got, got_steps = _served_beams(beam_step)
    for k, (a, b) in enumerate(zip(want_steps, got_steps, strict=False)):
        if a != b:
            grading.fail(f"serving '{name}' with your beam_step: at engine step {k} the "
                         f"library runs (request, sequence, tokens) {a}, yours {b}",
                         "in the engine a beam's table is the one you return: its forks and "
                         "frees decide which blocks the next step writes")
    grading.expect_equal(got, want, f"serving '{name}' with your beam_step: the beams",
                         "the engine's beams must be the library's on the same candidates")


@functools.cache
def _library_beams() -> tuple[str, list, list]:
    return _served_beams(None)


def _served_beams(beam_step: Callable[..., Any] | None) -> tuple[str, list, list]:
    """(the workload's name, each request's outputs, each step's (request, sequence,
    tokens)) of serving.beam_workload served with ``beam_step`` (None: the library's)."""
    from paged_lib.engine import EngineHooks
    from paged_lib.model import load_tiny_code_llama

    w = serving.beam_workload()
    hooks = None if beam_step is None else EngineHooks(beam_step=on_copies(beam_step))
    steps: list = []
    with serving.one_thread():
        tokens, _ = serving.serve(load_tiny_code_llama(), w, hooks, on_step=lambda out, _:
                                  steps.append(serving.schedule_of(out)))
    return w.name, tokens, steps
