"""Checks for chapter 08 (sharing: copy-on-write, parallel sampling, beam search).

* 08.1 ``apply_slot``: chapter 08's example (four samples share block 7, sample 3 writes
  first) in a NaN cache next to the library's, every write compared (the block others
  still read, the copy, the token, the whole cache); then the generated runs
  (:class:`Cow`): forks, frees, blocks taken again, stale caches, three layouts, every
  live sequence reading its K/V back after each write.
* 08.2 ``beam_step``: the scripted scenarios below, replayed next to the engine's step by
  :mod:`~paged_lib.course.grading.ch08_beam_replay` (exact ties; a near tie that float32
  calls one, which the engine's real scores never come near; beams that offer fewer
  candidates than the width, or none); then random beam workloads served in the engine
  (:mod:`paged_lib.course.grading.generated`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from paged_lib.blocks import BlockTable, OutOfBlocks, Slot
from paged_lib.course import grading
from paged_lib.course.grading import generated, serving
from paged_lib.course.grading.ch08_beam_replay import on_copies, run_beam_scenario
from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.generated.small_attention import rng
from paged_lib.course.grading.toy_pool import busy_pool
from paged_lib.studies import sharing

#: Mutants of the solution that compute the same thing (see ``tools/mutants.py``).
EQUIVALENT_MUTANTS: dict[str, dict[str, str]] = {
    "08.2": {
        "constant: `2` -> `1` in `scored.sort(key=lambda c: (-c[0], c[1], c[2]))`":
            "Python's sort is stable and the candidates are listed beam by beam in their "
            "own order, so breaking ties by the beam index twice keeps the candidate order",
    },
}


# ------------------------------------------------------------------ 08.1 apply_slot

def check_apply_slot(apply_slot: Callable[..., Any]) -> None:
    """``apply_slot(k_cache, v_cache, slot, key, value) -> None`` (in place)."""
    with grading.exercise("08.1"):
        _cow_replay(_EXAMPLE, apply_slot)
        numeric.check("08.1", cow_cases(), lambda p: _cow_replay(p, apply_slot),
                      (_STALE, _VIEWS))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(torch.nan_to_num(a, nan=1e9), torch.nan_to_num(b, nan=1e9)))


def _compare(caches, slot: Slot, where: str) -> None:
    (mk, mv), (rk, rv) = caches["mine"], caches["ref"]
    if slot.copy is not None:
        src, dst = slot.copy
        for which, mine, ref in (("K", mk, rk), ("V", mv, rv)):
            if not _same(mine[src], ref[src]):
                grading.fail(f"{where}: block {src}'s {which} changed, but the other "
                             "samples still read it",
                             f"other samples still read block {src}, so it stays as it is: "
                             f"the copy goes from src to dst (cache[{dst}] = cache[{src}]), "
                             "and the new token goes into slot.block, never into the shared "
                             "src")
        for which, mine, ref in (("K", mk, rk), ("V", mv, rv)):
            if not _same(mine[dst, :slot.offset], ref[dst, :slot.offset]):
                grading.fail(f"{where}: the first {slot.offset} slot(s) of block {dst} ({which}) "
                             f"do not hold the tokens copied from block {src}",
                             f"copy the whole block src into dst first, in K *and* V, in "
                             f"place: the sample's earlier tokens must be in its new block "
                             f"{dst} (an out-of-place op, index_copy or torch.where, returns "
                             "a new tensor the engine never reads)")
    for which, mine, ref in (("key", mk, rk), ("value", mv, rv)):
        if not _same(mine[slot.block, slot.offset], ref[slot.block, slot.offset]):
            grading.fail(f"{where}: the new token's {which} is not at block {slot.block}, "
                         f"offset {slot.offset}",
                         "write key into k_cache[slot.block, slot.offset] and value into "
                         "v_cache[...] after copying (a copy made afterwards overwrites it)")
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
        return [x for x, on in ((f"block size {self.block_size}", self.block_size in (
            3, 5, 6, 7, 12)), ("a cache of earlier requests' K/V", self.stale), (
            "a sequence freed mid-run", any(s[0] == "free" for s in self.steps)), (
            _LAYOUTS["vllm"], self.layout == "vllm"), (f"{self.kv_heads} KV head(s)",
                                                        self.kv_heads != 2)) if on]

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
    """08.1's generated runs (seeds 0, 1, ...)."""
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
    "it passes on separate K and V tensors and fails where k_cache and v_cache are views of "
    "one tensor, as an engine may hold them: write through indexing (cache[block, offset] = "
    "...); .reshape(), .contiguous() or assigning .data may write into a copy the engine "
    "never reads")
_STALE = numeric.Contrast(
    lambda p: dataclasses.replace(p, stale=False) if p.stale else None,
    "it passes on a cache of NaN and fails on one whose blocks hold earlier requests' K/V "
    "(a freed block keeps them: nothing clears it, and the next request takes it): copy "
    "and write whatever the slots hold; never test a slot for NaN (or zeros) to decide")


# ------------------------------------------------------------------ 08.2 beam_step


Candidates = list[list[tuple[int, float]]]
#: name, block size, prompt length, width, candidates per step
_SCRIPTED: list[tuple[str, int, int, int, list[Candidates]]] = [
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
        generated.check("beam_step", on_copies(beam_step), "the best beam_width "
                        "continuations of all beams by cumulative log-probability; a parent "
                        "chosen again is forked, its own table goes to its best child; the "
                        "tables nobody continues are freed, in beam order, tail first")


def run_beam_search(beam_step: Callable[..., Any], **kw) -> list[sharing.BeamFrame]:
    """A whole (synthetic) beam search driven by the learner's step, recorded."""
    frames, _ = sharing.record_beam_search(step_fn=on_copies(beam_step), **kw)
    return frames


# ------------------------------------------------------------------ the chapter's demos


def run_demo(apply_slot: Callable[..., Any], beam_step: Callable[..., Any]) -> list[Any]:
    """The chapter's demos on the learner's two functions; returns the beam-tree figure.

    Parallel sampling on a NaN-filled cache written by ``apply_slot``; a synthetic beam
    search and its saving on 20 Alpaca-like requests, then a real one in the engine
    (width 4 on the chapter's tiny random Llama), both driven by ``beam_step`` and
    compared with the library's.
    """
    from paged_lib.course.viz import sharing as viz
    from paged_lib.engine import EngineHooks, SamplingParams
    from paged_lib.workloads import alpaca_like

    def sampling() -> None:
        demo = sharing.parallel_sampling_demo(apply_slot)
        ok = demo.max_error < 1e-5
        print(f"parallel sampling, your apply_slot: copies {demo.copies}; paged attention "
              f"{'equals' if ok else 'DIFFERS from'} SDPA on each sample's own tokens")

    def synthetic() -> list[Any]:
        frames = run_beam_search(beam_step, prompt_len=6, output_len=10, beam_width=3,
                                 block_size=4, seed=0)
        same = frames == sharing.record_beam_search(seed=0)[0]
        shared = unshared = 0
        for i, r in enumerate(alpaca_like(20, seed=0)):
            u = sharing.beam_search_usage(r.prompt_len, r.output_len, 4, block_size=16,
                                          seed=i, step_fn=beam_step)
            shared, unshared = shared + sum(u.shared), unshared + sum(u.unshared)
        print(f"synthetic beam search, your beam_step: tree {'equals' if same else 'DIFFERS from'}"
              f" the library's; width 4 on 20 Alpaca-like requests saves "
              f"{1 - shared / unshared:.1%} of the block-steps")
        return [viz.draw_beam_tree(frames, upto=6)]

    def engine() -> None:
        import torch

        _, model = sharing.tiny_random_llama()
        prompt = torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(1)).tolist()
        params = SamplingParams(max_tokens=12, beam_width=4)
        run = serving.side_by_side(model, 64, 4, [prompt], params,
                                   EngineHooks(beam_step=on_copies(beam_step)))
        print(f"engine beam search (width 4), your beam_step: beams "
              f"{'equal' if run.same_tokens else 'DIFFER from'} the engine's own; peak blocks "
              f"{run.yours.stats.peak_blocks_used} vs {run.library.stats.peak_blocks_used}")

    grading.on_learner_code(sampling, "exercise 08.1", "parallel sampling")
    figs = grading.on_learner_code(synthetic, "exercise 08.2", "synthetic beam search") or []
    grading.on_learner_code(engine, "exercise 08.2", "engine beam search")
    return figs
