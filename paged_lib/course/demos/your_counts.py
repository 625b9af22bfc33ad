"""The chapters' demos on the learner's own counting pieces (chapters 00-03, 09, 11, 12).

Each ``chapter_NN`` runs at the end of chapter NN's exercise notebook: the chapter's
experiment or picture again, with the learner's functions in place of the library's, and a
line that says whether they agree. A piece not written yet gets ⏳ and one that raises gets
❌ (:func:`paged_lib.course.grading.on_learner_code`), never a traceback.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from paged_lib.accounting import SPECS, ModelSpec, get_spec, kv_bytes_per_token
from paged_lib.blocks import BlockTable
from paged_lib.course import grading
from paged_lib.course.grading.ch11 import DEPLOYMENT, LEVELS, reference_levels
from paged_lib.course.grading.generated.small_sim import SIM_KEYS, reference_paged
from paged_lib.course.grading.toy_pool import busy_pool, with_free
from paged_lib.parallel import kv_bytes_per_rank
from paged_lib.studies.block_size import KERNEL_BLOCK_SIZES, choose_block_size, internal_waste
from paged_lib.workloads import alpaca_like, sharegpt_like

#: chapter 12's shipped model (the tiny code Llama, fp32) as a spec
TINY = ModelSpec("tiny-code-llama (fp32)", num_layers=4, hidden_size=256, num_heads=8,
                 num_kv_heads=2, head_dim=32, dtype_bytes=4)


def chapter_00(ceil_div: Callable[[int, int], int], n: int = 1000, block: int = 128) -> None:
    """The chapter's vector add, launched with the learner's ``ceil_div`` as the grid size.

    Too few programs leave the tail of the output unwritten; the demo says how much.
    """
    import torch

    from paged_lib.course.demos.tour import add_kernel

    programs = grading.on_learner_code(lambda: ceil_div(n, block), "exercise 00.1",
                                       "the kernel launch your ceil_div sizes")
    if programs is None:
        return
    x = torch.arange(n, dtype=torch.float32)
    out = torch.zeros_like(x)
    add_kernel[(int(programs),)](x, x, out, n, BLOCK=block)
    wrong = int((out != 2 * x).sum())
    print(f"add(x, x) for {n} elements, {block} per program: your ceil_div launched "
          f"{programs} programs; {n - wrong} of {n} outputs written correctly")


def chapter_01(kv_bytes_per_token: Callable[[ModelSpec], int]) -> Any:
    """The chapter's bar chart of KV bytes per token, drawn with the learner's function."""
    from paged_lib.accounting import kv_bytes_per_token as library
    from paged_lib.course.viz import accounting as viz

    same = grading.on_learner_code(
        lambda: all(kv_bytes_per_token(s) == library(s) for s in SPECS.values()),
        "exercise 01.1", "the chapter's chart drawn by your kv_bytes_per_token")
    if same is None:
        return None
    print(f"your kv_bytes_per_token on all {len(SPECS)} models of the chapter: "
          f"{'every one equals' if same else 'some differ from'} the library's")
    return viz.kv_per_token_bars(per_token=kv_bytes_per_token,
                                 title="KV bytes per token, computed by your function")


def chapter_02(simulate_paged: Callable[..., Any]) -> Any:
    """The chapter's Fig. 2 experiment with the learner's simulator as the paged policy."""
    from paged_lib import accounting
    from paged_lib.course.viz import fragmentation as viz
    from paged_lib.fragmentation import Breakdown, simulate

    requests = sharegpt_like(600, seed=0)
    opt = accounting.SPECS["opt-13b"]  # the paper's Fig. 2 pool: OPT-13B on a 40 GB A100
    slots = (40 * accounting.GiB - accounting.weight_bytes(opt)) // \
        accounting.kv_bytes_per_token(opt)
    got = grading.on_learner_code(lambda: simulate_paged(requests, slots, 16),
                                  "exercise 02.5", "the chapter's vLLM bar from your simulator")
    if got is None:
        return None
    total = sum(got[c] for c in ("token_states", "reserved", "internal", "external"))
    yours = Breakdown(*(got[c] / total for c in ("token_states", "reserved", "internal",
                                                  "external")))
    same = {k: got[k] for k in SIM_KEYS} == reference_paged(requests, slots, 16)
    print(f"your simulator: {yours.token_states:.1%} token states, {got['preemptions']} "
          f"preemptions, {got['num_steps']} steps "
          f"({'the same as' if same else 'different from'} the library's)")
    results = {p: simulate(requests, p, slots) for p in ("orca-max", "orca-pow2",
                                                        "orca-oracle")}
    results["paged"] = yours
    return viz.plot_breakdown(results, title="Fig. 2 with your paged simulator")


def chapter_03(append_token: Callable[..., Any], fork: Callable[..., Any],
               free_block: Callable[..., Any]) -> list[Any]:
    """The chapter's two scenarios, driven by the learner's table and allocator.

    Prints whether every frame matches the library's, and returns the figures (the
    decode loop with three requests, then parallel sampling with copy-on-write).
    """
    from paged_lib.course.viz import blocks as viz

    learner_table = type("YourBlockTable", (BlockTable,),
                         {"append_token": append_token, "fork": fork})
    frames = grading.on_learner_code(
        lambda: (list(viz.grow_requests(table_cls=learner_table,
                                        allocator=with_free(busy_pool(5), free_block))),
                 viz.fork_and_write(table_cls=learner_table,
                                    allocator=with_free(busy_pool(8), free_block))),
        "exercises 03.1-03.3", "the chapter's drawings driven by your table and allocator")
    if frames is None:
        return []
    grown, forked = frames
    same = grown == list(viz.grow_requests()) and forked == viz.fork_and_write()
    print(f"your code drove {len(grown) + len(forked)} frames; "
          f"{'every frame equals' if same else 'some frames differ from'} the library's")
    finished = next(i for i, s in enumerate(grown) if "finished" in s.caption)
    return [viz.draw_frames([grown[finished], grown[finished + 1]]),
            viz.draw_frames([forked[1], forked[2], forked[4]])]


def chapter_09(internal_waste_fn: Callable[..., float],
               choose_block_size_fn: Callable[..., int]) -> None:
    """The learner's functions on the chapter's two traces, next to the library's."""

    traces = {"sharegpt": sharegpt_like(120, seed=0),
              "alpaca": alpaca_like(400, seed=0, rate=16)}
    lengths = {name: [r.final_len for r in trace] for name, trace in traces.items()}

    def waste() -> None:
        for name, lens in lengths.items():
            mine = [internal_waste_fn(lens, b) for b in (16, 64, 256)]
            ref = [internal_waste(lens, b) for b in (16, 64, 256)]
            print(f"{name}: waste at blocks of 16 / 64 / 256 tokens, yours "
                  + " / ".join(f"{w:.1%}" for w in mine) + ", library "
                  + " / ".join(f"{w:.1%}" for w in ref))

    def choice() -> None:
        for name, lens in lengths.items():
            for kernel, sizes in KERNEL_BLOCK_SIZES.items():
                b = choose_block_size_fn(lens, list(sizes), 0.05)
                lib = choose_block_size(lens, list(sizes), 0.05)
                print(f"{name}, {kernel} {sizes}, budget 5%: you choose {b} (library: {lib})")

    grading.on_learner_code(waste, "exercise 09.1", "the traces' waste with your function")
    grading.on_learner_code(choice, "exercises 09.1 and 09.2", "your block-size choices")


def chapter_11(kv_levels_fn: Callable[..., Any],
               kv_bytes_per_token_fn: Callable[[ModelSpec], Any]) -> None:
    """The learner's functions on the chapter's deployment and models, beside the library's
    (pictures: the levels and the bytes-per-token bars)."""
    from paged_lib.course.viz import kv_landscape as viz

    lengths = [r.final_len for r in sharegpt_like(64, seed=0)]
    kw = {k: v for k, v in DEPLOYMENT.items() if k != "spec"}
    spec = get_spec(DEPLOYMENT["spec"])

    def levels() -> None:
        mine = kv_levels_fn(spec, list(lengths), **kw)
        ref = reference_levels(spec, lengths, kw["max_len"], kw["kv_dtype_bytes"], kw["block_size"],
                               kw["window"], kw["sinks"])
        print(f"{spec.name}, 64 requests (synthetic ShareGPT-like lengths), "
              f"max_len {kw['max_len']}, {kw['kv_dtype_bytes']} B per value, window "
              f"{kw['window']} + {kw['sinks']} sinks, blocks of {kw['block_size']}:")
        for name, m, r in zip(LEVELS, mine, ref, strict=True):
            print(f"  {name:<22} yours {m / 2**30:8.3f} GiB   library pieces "
                  f"{r / 2**30:8.3f} GiB")
        if all(isinstance(m, numbers.Integral) and not isinstance(m, bool) for m in mine):
            viz.levels_bars(dict(zip(LEVELS, mine, strict=True)),
                            f"{spec.name}: your levels for the chapter's deployment")

    def per_token() -> None:
        models = ["llama-2-7b", "llama-3-8b", "falcon-7b", "deepseek-llm-67b", "deepseek-v2"]
        for name in models:
            s = get_spec(name)
            print(f"  {name:<17} {s.attention}: yours {kv_bytes_per_token_fn(s):>9,} B, "
                  f"library {kv_bytes_per_token(s):>9,} B")
        viz.bytes_per_token_bars(models, per_token=kv_bytes_per_token_fn)

    grading.on_learner_code(levels, "exercise 11.1", "the deployment's levels")
    grading.on_learner_code(per_token, "exercise 11.2", "bytes per token with your function")


def chapter_12(kv_bytes_per_rank_fn: Callable[..., int],
               rank_heads_fn: Callable[..., tuple[list[int], list[int]]]):
    """The learner's two functions on the shipped model's shape (8 query heads, 2 KV
    heads) at 1, 2, 4 and 8 ranks, next to the library's; returns the heads picture."""
    from paged_lib.course.viz import parallel as viz

    def table() -> None:
        for tp in (1, 2, 4, 8):
            mine = kv_bytes_per_rank_fn(TINY, tp, 2048)
            lib = kv_bytes_per_rank(TINY, tp, 2048)
            q, k = rank_heads_fn(8, 2, tp, tp - 1)
            print(f"{tp} rank(s): {mine / 2**20:.2f} MiB per rank for 2048 tokens "
                  f"(library {lib / 2**20:.2f}); the last rank owns query heads {q}, "
                  f"KV heads {k}")

    grading.on_learner_code(table, "exercises 12.1 and 12.2", "the shipped model's shards")
    return grading.on_learner_code(lambda: viz.heads_by_rank(8, 2, 4, owners=rank_heads_fn),
                                   "exercise 12.2", "the heads picture from your function")
