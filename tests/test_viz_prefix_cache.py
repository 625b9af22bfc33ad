"""Chapter 10's pictures: each returns a Figure drawn from the data it was given."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest
from matplotlib.figure import Figure

from paged_lib.course.demos import prefix_cache as demo
from paged_lib.course.viz import prefix_cache as viz
from paged_lib.studies.radix_tree import RadixTree


def _texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts)


def test_hash_chain_shows_shared_blocks_and_partial_ones():
    prompts = {"A": list(range(10)), "B": list(range(8)) + [5, 5, 5, 5, 6]}
    rows = demo.hash_chain_rows(prompts, 4)
    assert [b.physical for b in rows["A"]] == [0, 1, 2]
    assert [b.physical for b in rows["B"]][:2] == [0, 1]  # shared prefix, same blocks
    assert [b.hit for b in rows["B"]] == [True, True, False, False]
    assert rows["A"][2].hash_value is None and rows["B"][3].hash_value is None
    assert rows["A"][0].hash_value == rows["B"][0].hash_value
    fig = viz.draw_hash_chain(rows)
    text = _texts(fig)
    assert "-> block 0" in text and "no hash (partial)" in text
    plt.close(fig)
    with pytest.raises(ValueError):
        viz.draw_hash_chain({})


def test_free_queue_picture_follows_the_worked_example():
    frames = demo.worked_example()
    fig = viz.draw_free_queue(frames)
    text = _texts(fig)
    assert "evicted [3]" in text and "hit [0, 1, 2]" in text
    assert all(f.title in text for f in frames)
    plt.close(fig)


def test_radix_tree_drawing_names_each_edge():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    tree.insert([1, 2, 7], [10, 11, 20])
    _, node = tree.match_prefix([1, 2, 7])
    tree.inc_lock_ref(node)
    fig = viz.draw_radix_tree(tree, decode=lambda t: "".join(chr(96 + x) for x in t))
    text = _texts(fig)
    assert "ab\n2 tok, lock 1" in text and "cd\n2 tok, lock 0" in text and "root" in text
    plt.close(fig)


def test_savings_and_stalls_plots():
    fig = viz.plot_prefix_savings({"chat": {"hash": 0.5, "radix": 0.6}},
                                  {"chat": {"hash": 100, "radix": 120}})
    assert "50%" in _texts(fig) and "120" in _texts(fig)
    plt.close(fig)
    fig = viz.plot_decode_stalls({"whole prompts": [(40, 0, 0), (0, 1, 0), (30, 0, 1)],
                                  "chunked": [(16, 0, 0), (15, 1, 0), (14, 1, 0)]})
    titles = [ax.get_title() for ax in fig.axes]
    assert "1 with decodes stalled" in titles[0] and "0 with decodes stalled" in titles[1]
    plt.close(fig)
    with pytest.raises(ValueError):
        viz.plot_decode_stalls({"empty": []})


def test_step_loads_see_the_stalls_chunked_prefill_removes():
    import torch

    from paged_lib.engine import LLMEngine
    from paged_lib.model import TinyLlama, TinyLlamaConfig

    torch.manual_seed(0)
    cfg = TinyLlamaConfig(name="stand-in", num_layers=1, hidden_size=32, num_heads=2,
                          num_kv_heads=1, head_dim=16, vocab_size=264, intermediate_size=32,
                          max_position=256)
    model = TinyLlama(cfg).eval()
    prompts, params, arrivals = demo.long_prompt_trace()
    loads, tokens = {}, {}
    for name, kw in (("first", dict(scheduling="prefill_first")),
                     ("chunked", dict(enable_chunked_prefill=True, max_num_batched_tokens=48,
                                             max_num_seqs=48))):
        engine = LLMEngine(model, 64, 8, **kw)
        tokens[name] = [o.outputs[0].token_ids for o in engine.generate(prompts, params, arrivals)]
        loads[name] = demo.step_loads(engine.stats)
        assert sum(p + d for p, d, _ in loads[name]) == sum(engine.stats.computed_tokens)
    assert tokens["first"] == tokens["chunked"]
    # each long prompt's prefill step keeps the 4 short requests waiting
    assert sum(w for *_, w in loads["first"]) == 12
    assert sum(w for *_, w in loads["chunked"]) == 0
    assert max(p + d for p, d, _ in loads["chunked"]) <= 48 < max(p for p, _, _ in loads["first"])


def test_shared_prefix_prompts_share_exactly_five_blocks_of_eight():
    prompts = demo.shared_prefix_prompts()
    n = demo.SHARED_PREFIX_LEN
    assert n == 40 and len(prompts) == 6
    assert all(p[:n] == prompts[0][:n] for p in prompts)
    assert len({tuple(p[n:n + 8]) for p in prompts}) == 6  # block 5 differs in every prompt
