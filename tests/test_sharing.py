"""Sharing KV blocks: fork, copy-on-write, beam steps, and the savings measurement.

The property tests drive chapter 03's real ``BlockTable``/``BlockAllocator`` with random
mixes of forks, appends, copies and frees, and simulate the cache's *contents* as a dict
``(block, offset) -> token``: every table must read back exactly its own tokens, every
ref count must equal the number of tables holding the block, nothing may leak.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_lib.blocks import BlockAllocator, BlockTable, OutOfBlocks, Slot
from paged_lib.engine.beam_search import beam_step
from paged_lib.studies import sharing
from paged_lib.util import cdiv
from paged_lib.workloads import Request, alpaca_like, sharegpt_like


class Cache:
    """The KV cache's contents, one token id per slot, written the way the engine does."""

    def __init__(self):
        self.slots: dict[tuple[int, int], int] = {}

    def write(self, slot: Slot, token: int, block_size: int) -> None:
        if slot.copy is not None:
            src, dst = slot.copy
            for off in range(block_size):
                if (src, off) in self.slots:
                    self.slots[dst, off] = self.slots[src, off]
                else:
                    self.slots.pop((dst, off), None)
        self.slots[slot.block, slot.offset] = token

    def read(self, table: BlockTable) -> list[int]:
        bs = table.block_size
        return [self.slots[table.blocks[t // bs], t % bs] for t in range(table.num_tokens)]


def check_ref_counts(alloc: BlockAllocator, tables: list[BlockTable]) -> None:
    holders: dict[int, int] = {}
    for t in tables:
        for b in t.blocks:
            holders[b] = holders.get(b, 0) + 1
    for b in range(alloc.num_blocks):
        assert alloc.refcount(b) == holders.get(b, 0), f"block {b}"
    assert sorted(alloc.free_block_ids) == [b for b in range(alloc.num_blocks)
                                            if b not in holders]


# ------------------------------------------------------------------ property tests

OPS = st.lists(st.tuples(st.sampled_from(["append", "append", "append", "fork", "free"]),
                         st.integers(0, 1_000)), min_size=1, max_size=80)


@settings(max_examples=120, deadline=None)
@given(ops=OPS, block_size=st.integers(1, 5), num_blocks=st.integers(1, 12))
def test_random_forks_appends_and_frees(ops, block_size, num_blocks):
    alloc = BlockAllocator(num_blocks)
    cache = Cache()
    tables = [BlockTable(alloc, block_size)]
    tokens: list[list[int]] = [[]]  # what each table must read back
    for i, (op, pick) in enumerate(ops):
        if not tables:
            tables, tokens = [BlockTable(alloc, block_size)], [[]]
        k = pick % len(tables)
        if op == "append":
            before = (list(alloc.ref_counts), list(alloc.free_block_ids), tables[k].blocks)
            try:
                slot = tables[k].append_token()
            except OutOfBlocks:  # nothing may change
                assert (list(alloc.ref_counts), list(alloc.free_block_ids),
                        tables[k].blocks) == before
            else:
                cache.write(slot, i, block_size)
                tokens[k].append(i)
        elif op == "fork":
            tables.append(tables[k].fork())
            tokens.append(list(tokens[k]))
        else:
            tables.pop(k).free()
            tokens.pop(k)
        check_ref_counts(alloc, tables)
        for table, own in zip(tables, tokens, strict=True):
            assert cache.read(table) == own  # no sibling's write shows up here
    for t in tables:
        t.free()
    assert alloc.num_free == num_blocks  # nothing leaked


@settings(max_examples=60, deadline=None)
@given(width=st.integers(1, 4), prompt_len=st.integers(1, 9), block_size=st.integers(1, 4),
       steps=st.integers(1, 8), seed=st.integers(0, 10_000))
def test_beam_steps_keep_every_beam_own_tokens(width, prompt_len, block_size, steps, seed):
    """Random candidates each step through the engine's beam_step, then every new beam
    appends (as in beam_search_usage); contents and ref counts checked after each."""
    rng = np.random.default_rng(seed)
    alloc = BlockAllocator(width * cdiv(prompt_len + steps, block_size) + width)
    cache = Cache()
    table = BlockTable(alloc, block_size)
    for t in range(prompt_len):
        cache.write(table.append_token(), t, block_size)
    tables, seqs, cum = [table], [list(range(prompt_len))], [0.0]
    for step in range(steps):
        logprobs = np.round(rng.normal(size=(len(tables), 5)), 1)  # rounded: ties happen
        new = beam_step(tables, cum, sharing.top_candidates(logprobs, width), width)
        seqs = [seqs[p] + [1000 * (step + 1) + i] for i, (p, _, _, _) in enumerate(new)]
        tables, cum = [t for _, t, _, _ in new], [c for _, _, _, c in new]
        for i, t in enumerate(tables):
            cache.write(t.append_token(), seqs[i][-1], block_size)
        check_ref_counts(alloc, tables)
        assert [cache.read(t) for t in tables] == seqs
    for t in tables:
        t.free()
    assert alloc.num_free == alloc.num_blocks


# ------------------------------------------------------------------ one step by hand


def test_beam_step_then_appends_by_hand():
    """Three beams of 6 tokens (block size 4); beam 0 gets two children, beam 1 dies."""
    alloc = BlockAllocator(12)
    root = BlockTable(alloc, 4)
    for _ in range(6):
        root.append_token()  # blocks [0, 1], block 1 half full
    b1, b2 = root.fork(), root.fork()
    b1.append_token()  # copies block 1 into 2
    b2.append_token()  # copies block 1 into 3
    root.append_token()  # block 1 now root's alone: in place
    assert [root.blocks, b1.blocks, b2.blocks] == [[0, 1], [0, 2], [0, 3]]
    candidates = [[(5, -0.1), (6, -0.2)], [(7, -5.0)], [(8, -0.3)]]
    new = beam_step([root, b1, b2], [0.0, 0.0, 0.0], candidates, 3)
    assert [(p, tok) for p, _, tok, _ in new] == [(0, 5), (0, 6), (2, 8)]
    tables = [t for _, t, _, _ in new]
    assert tables[0] is root and tables[2] is b2
    slots = [t.append_token() for t in tables]
    assert [t.blocks for t in tables] == [[0, 4], [0, 1], [0, 3]]
    # root's first child copied the shared block 1 into the fresh 4 (the block b1 freed,
    # 2, went to the back of the free list); the fork then wrote in place; b2 in place.
    assert [s.copy for s in slots] == [(1, 4), None, None]
    assert alloc.refcount(0) == 3 and alloc.refcount(2) == 0


def test_top_candidates_against_a_sort():
    rng = np.random.default_rng(3)
    logprobs = np.round(rng.normal(size=(3, 6)), 1)  # rounded: some exact ties
    got = sharing.top_candidates(logprobs, 4)
    for row, cands in zip(logprobs, got, strict=True):
        want = sorted(range(6), key=lambda t: (-row[t], t))[:4]
        assert cands == [(t, float(row[t])) for t in want]


# ------------------------------------------------------------------ usage


def test_parallel_sampling_done_when():
    """n=4, 64-token prompt, block size 4, 32 new tokens: peak <= 0.75 of unshared."""
    usage = sharing.parallel_sampling_usage(64, 32, 4, block_size=4)
    # by hand: 16 shared prompt blocks + 4 x 8 own blocks, vs 4 x (16 + 8)
    assert (max(usage.shared), max(usage.unshared)) == (48, 96)
    assert usage.peak_ratio <= 0.75
    assert usage.copies == 0  # the prompt fills its blocks exactly: nothing to copy


def test_parallel_sampling_copies_the_partly_filled_prompt_block():
    usage = sharing.parallel_sampling_usage(6, 1, 3, block_size=4)
    assert usage.copies == 2  # the third writer finds block 1 its own
    assert (usage.shared, usage.unshared) == ([2, 4], [6, 6])


def test_beam_search_never_leaks_and_repeats_with_its_seed():
    frames: list[sharing.BeamFrame] = []
    usage = sharing.beam_search_usage(7, 12, 4, block_size=4, seed=5, record=frames)
    for frame, in_use in zip(frames, usage.shared, strict=True):
        assert in_use == len(frame.ref_counts)  # every used block is held by a beam
        holders: dict[int, int] = {}
        for blocks in frame.blocks:
            for b in blocks:
                holders[b] = holders.get(b, 0) + 1
        assert frame.ref_counts == holders
    again: list[sharing.BeamFrame] = []
    sharing.beam_search_usage(7, 12, 4, block_size=4, seed=5, record=again)
    assert again == frames
    other: list[sharing.BeamFrame] = []
    sharing.beam_search_usage(7, 12, 4, block_size=4, seed=6, record=other)
    assert [f.parents for f in other] != [f.parents for f in frames]
    assert any(len(set(f.parents)) < len(f.parents) for f in frames)  # some beams fork
    assert any(f.freed_beams for f in frames)  # and some die


def test_beam_search_shares_at_least_the_prompt():
    usage = sharing.beam_search_usage(32, 16, 4, block_size=4, seed=0)
    # 8 full prompt blocks shared by 4 beams saves at least 3 x 8 blocks at every step
    assert all(u - s >= 24 for s, u in zip(usage.shared[1:], usage.unshared[1:], strict=True))


@pytest.fixture(scope="module")
def small_table():
    traces = {"alpaca": alpaca_like(30, seed=1), "sharegpt": sharegpt_like(6, seed=1)}
    return sharing.savings_table(traces, widths=(2, 6))


def test_savings_grow_with_width_and_beams_save_more(small_table):
    for trace in ("alpaca", "sharegpt"):
        for mode in sharing.MODES:
            two, six = small_table[trace, mode, 2], small_table[trace, mode, 6]
            assert 0 < two.mean_saving < six.mean_saving < 1
            assert 0 < two.peak_saving < 1
        for w in (2, 6):
            assert small_table[trace, "beam", w].mean_saving > \
                small_table[trace, "parallel", w].mean_saving


def test_trace_savings_overlays_arrivals():
    reqs = [Request(4, 2, 0.0), Request(4, 2, 10.0)]  # never overlap
    s = sharing.trace_savings(reqs, "parallel", 2, block_size=4)
    one = sharing.parallel_sampling_usage(4, 2, 2, block_size=4)
    assert (s.peak_shared, s.peak_unshared) == (max(one.shared), max(one.unshared))
    together = sharing.trace_savings([Request(4, 2, 0.0)] * 2, "parallel", 2, block_size=4)
    assert together.peak_shared == 2 * max(one.shared)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown mode"):
        sharing.request_usage(Request(4, 2, 0.0), "greedy", 2)
    with pytest.raises(ValueError, match="width must be >= 1"):
        sharing.parallel_sampling_usage(4, 2, 0)
    with pytest.raises(ValueError, match="at least one request"):
        sharing.trace_savings([], "beam", 2)


# ------------------------------------------------------------------ pictures


@pytest.fixture
def close_figures():
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


@pytest.fixture(scope="module")
def recorded():
    return sharing.record_beam_search(prompt_len=6, output_len=10, beam_width=3,
                                      block_size=4, seed=0)


def test_describe_step_names_forks_deaths_copies_and_frees(recorded):
    from paged_lib.course.viz import sharing as viz

    frames, _ = recorded
    assert viz.describe_step(frames[0]) == "step 0: the prompt (6 tokens) in blocks [0, 1]"
    # step 1: three children of the prompt; the first two writers copy its half-full
    # block 1, the third writes in place
    assert frames[1].parents == [0, 0, 0] and frames[1].copies == [(1, 2), (1, 3)]
    assert viz.describe_step(frames[1]) == ("step 1: forked 0->0,1,2 | none died | "
                                            "copied 1->2, 1->3 | no block freed")
    for f in frames[1:]:
        text = viz.describe_step(f)
        assert ("none died" not in text) == bool(f.freed_beams)
        for src, dst in f.copies:
            assert f"{src}->{dst}" in text


def test_draw_beam_tree_colours_blocks_by_ref_count(recorded, close_figures):
    from matplotlib.figure import Figure

    from paged_lib.course.viz import sharing as viz

    frames, _ = recorded
    fig = viz.draw_beam_tree(frames, upto=1)
    assert isinstance(fig, Figure)
    blocks_ax = fig.axes[1]
    labels = [t.get_text() for t in blocks_ax.texts]
    assert labels == [f"#{b}" for blocks in frames[1].blocks for b in blocks]
    cmap, norm = viz.ref_colormap(3)
    filled = [p for p in blocks_ax.patches if p.get_facecolor()[:3] != (0.0, 0.0, 0.0)
              and p.get_fill() and p.get_width() > 0]
    shared_color = cmap(norm(3))  # block 0 is held by all three beams
    assert any(tuple(p.get_facecolor()) == tuple(shared_color) for p in filled)
    assert isinstance(viz.draw_beam_tree(frames), Figure)
    with pytest.raises(ValueError, match="upto must be in 0..10"):
        viz.draw_beam_tree(frames, upto=11)
    with pytest.raises(ValueError, match="at least one recorded frame"):
        viz.draw_beam_tree([])


def test_stepper_replays_the_beam_search(recorded, close_figures):
    import ipywidgets

    from paged_lib.course.viz import sharing as viz

    frames, _ = recorded
    widget = viz.stepper(frames)
    assert isinstance(widget, ipywidgets.VBox)
    play, slider = widget.children[0].children
    assert slider.max == play.max == len(frames) - 1
    slider.value = 4  # redraws without error


def test_plot_savings_draws_every_measurement(small_table, close_figures):
    from paged_lib.course.viz import sharing as viz

    fig = viz.plot_savings(small_table)
    assert len(fig.axes) == 2
    heights = sorted(round(bar.get_height(), 9) for ax in fig.axes
                     for container in ax.containers for bar in container)
    assert heights == sorted(round(s.mean_saving, 9) for s in small_table.values())


# ------------------------------------------------------------------ the cache side


def test_parallel_sampling_demo_matches_sdpa_on_each_sample():
    demo = sharing.parallel_sampling_demo()
    assert demo.max_error < 1e-5
    assert demo.copies == [(1, 2), (1, 3), (1, 4)]  # 4 samples, the last writes in place
    assert (demo.blocks_in_use, demo.blocks_unshared) == (9, 12)
    assert all(blocks[0] == 0 for blocks in demo.blocks)  # the full prompt block is shared


def test_parallel_sampling_demo_catches_a_write_without_copy():
    def no_copy(k_cache, v_cache, slot, key, value):
        k_cache[slot.block, slot.offset] = key
        v_cache[slot.block, slot.offset] = value

    demo = sharing.parallel_sampling_demo(no_copy)
    assert not demo.max_error < 1e-3  # NaN or a large error


def test_per_request_saving_counts_each_request_once():
    reqs = [Request(16, 16, 0.0), Request(4, 60, 0.0)]
    s = sharing.trace_savings(reqs, "parallel", 2, block_size=4)
    own = [sharing.parallel_sampling_usage(r.prompt_len, r.output_len, 2, 4) for r in reqs]
    each = [1 - sum(u.shared) / sum(u.unshared) for u in own]
    assert s.per_request_saving == pytest.approx(sum(each) / 2)
    assert s.mean_saving < s.per_request_saving  # the long, short-prompt request weighs more


# ------------------------------------------------------------------ real beams (engine)


@pytest.fixture(scope="module")
def random_llama():
    return sharing.tiny_random_llama(seed=0)[1]


def test_engine_beam_usage_reads_the_engine_s_own_blocks(random_llama):
    import torch

    from paged_lib.engine import LLMEngine, SamplingParams
    from paged_lib.studies.sharing_engine import engine_beam_usage, time_averaged_saving

    torch.set_num_threads(1)
    prompt, width, new, bs = list(range(1, 22)), 3, 12, 4
    usage, short = engine_beam_usage(random_llama, [prompt, prompt[:9]], width, new, bs)
    alone = LLMEngine(random_llama, 200, bs, watermark=0.0)
    alone.generate([prompt], SamplingParams(max_tokens=new, beam_width=width, ignore_eos=True))
    # the same blocks the engine counted, step for step, for a request served alone
    assert len(usage.shared) >= new - 1
    assert usage.shared == alone.stats.blocks_used[:len(usage.shared)]
    assert usage.shared[0] == cdiv(len(prompt), bs) == usage.unshared[0]
    for t in range(1, len(usage.unshared)):  # every beam its own copy of prompt + t tokens
        assert usage.unshared[t] == width * cdiv(len(prompt) + t, bs)
        assert usage.shared[t] < usage.unshared[t]
    assert short.unshared[1] == width * cdiv(9 + 1, bs)
    assert usage.copies > 0
    saving = time_averaged_saving([usage, short])
    assert saving == pytest.approx(1 - (sum(usage.shared) + sum(short.shared))
                                   / (sum(usage.unshared) + sum(short.unshared)))
    assert 0 < saving < 1 - 1 / width


def test_time_averaged_saving_of_no_sharing_is_zero():
    from paged_lib.studies.sharing_engine import time_averaged_saving

    assert time_averaged_saving([sharing.Usage([2, 3], [2, 3], 0)]) == 0.0
    assert time_averaged_saving([sharing.Usage([1, 1], [2, 2], 0)]) == 0.5


def test_beam_blocks_plot_draws_one_unshared_line_for_equal_lengths():
    from paged_lib.course.viz import sharing as viz

    a = sharing.Usage([2, 3, 3], [2, 6, 6], 1)
    b = sharing.Usage([2, 4, 3], [2, 6, 6], 2)
    c = sharing.Usage([2, 4], [2, 4], 0)
    fig = viz.plot_beam_blocks({"real": a, "synthetic": b})
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["real: shared", "real and synthetic: each beam its own copy",
                      "synthetic: shared"]
    fig = viz.plot_beam_blocks({"real": a, "other": c})
    assert len(fig.axes[0].get_lines()) == 4
