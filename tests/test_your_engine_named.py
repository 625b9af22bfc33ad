"""Chapter 13 names what a learner meets in the words of the piece that caused it.

A piece its scenarios named wrong is not handed to ``YourLLM`` (the library's runs in its
place, as in the chat workload); a wrong 10.2 is told in 10.2's words, not in those of
10.4's allocation that takes its hit; a block given for copy-on-write but never copied is
named as such, not as torch's "probability tensor contains inf/nan"; a Triton kernel that
reads outside its tensors reads NaN fences (caught, not a crash) and a kernel that differs
on the real layer gets ❌ and a hint.
"""

import pytest
from test_your_engine_blame import APPEND_TOKEN, KERNEL, LONGEST_CACHE_HIT, SLOT_MAPPING, save_alone

from paged_lib.course import mine
from paged_lib.course.demos import your_engine, your_engine_check, your_engine_scenarios
from paged_lib.engine import SamplingParams
from paged_lib.model import load_tiny_code_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _piece(tmp_path, monkeypatch, ex_id, source):
    folder = tmp_path / "mine"
    save_alone(folder, ex_id, source)
    monkeypatch.setenv(mine.ENV, str(folder))
    pieces, _ = your_engine.gather()
    assert list(pieces) == [ex_id]
    return pieces


def test_your_llm_runs_the_library_in_place_of_a_piece_named_wrong(tmp_path, monkeypatch,
                                                                     capsys):
    pieces = _piece(tmp_path, monkeypatch, "05.6", SLOT_MAPPING.format(
        index="pos // block_size", offset="pos"))
    verdicts = your_engine_scenarios.check_pieces(pieces)
    assert verdicts[0][1] is not None
    capsys.readouterr()
    llm = your_engine.YourLLM(load_tiny_code_llama(), pieces, num_blocks=64, block_size=4)
    assert "the library's 05.6 in place of yours" in capsys.readouterr().out
    out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=8, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 8


def test_a_wrong_10_2_is_told_in_its_own_words(tmp_path, monkeypatch):
    pieces = _piece(tmp_path, monkeypatch, "10.2", LONGEST_CACHE_HIT.format(
        cap="num_tokens // block_size - 1", miss="break"))
    verdict = your_engine_scenarios.check_piece("10.2", pieces["10.2"])
    assert verdict is not None and "longest_cache_hit (10.2)" in verdict, verdict
    assert "allocate_slots" not in verdict, verdict


def test_a_block_given_for_copy_on_write_but_not_copied_is_named(tmp_path, monkeypatch):
    no_copy = APPEND_TOKEN.format(shared="table.allocator.refcount(table._blocks[-1]) > 1"
                                  ).replace("        copy = (src, dst)\n", "")
    pieces = _piece(tmp_path, monkeypatch, "03.1", no_copy)
    verdict = your_engine_scenarios.check_piece("03.1", pieces["03.1"])
    assert verdict is not None and "copy-on-write" in verdict and "Slot's copy" in verdict
    assert "probability tensor" not in verdict, verdict


OUT_OF_BOUNDS = KERNEL.format(cmp="<", scale="scale").replace(
    "range(0, tl.cdiv(seq_len, BLOCK_SIZE))", "range(0, tl.cdiv(seq_len, BLOCK_SIZE) + 1)"
).replace(", mask=valid[:, None], other=0.0)", ")")


def test_a_kernel_reading_past_its_table_reads_the_fences(tmp_path, monkeypatch):
    """One block past the sequence's last, unmasked: the table's next entry, then a block
    id of the fence (-1), whose K/V are the NaN before the cache, not memory it does not
    own."""
    assert OUT_OF_BOUNDS != KERNEL.format(cmp="<", scale="scale")
    pieces = _piece(tmp_path, monkeypatch, "05.5", OUT_OF_BOUNDS)
    verdict = your_engine_scenarios.check_piece("05.5", pieces["05.5"])
    assert verdict is not None and "it read outside what the sequence holds" in verdict


def test_a_kernel_that_differs_on_the_real_layer_gets_a_cross_and_a_hint(tmp_path,
                                                                         monkeypatch):
    import torch

    pieces = _piece(tmp_path, monkeypatch, "05.5", KERNEL.format(cmp="<", scale="1.0"))
    g = torch.Generator().manual_seed(0)
    k = torch.randn(6, 4, 2, 8, generator=g)
    call = dict(q=torch.randn(2, 4, 8, generator=g), k_cache=k, v_cache=torch.randn_like(k),
                block_tables=torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32),
                seq_lens=torch.tensor([9, 12], dtype=torch.int32))
    from paged_lib.kernels import paged_attention

    call["out"] = paged_attention(*(call[x] for x in ("q", "k_cache", "v_cache",
                                                      "block_tables", "seq_lens")),
                                  backend="torch")
    for kernel, mark in ((pieces["05.5"], "❌"), (None, "✅")):
        run = your_engine_check.kernel_on_one_layer(kernel, call)
        story = your_engine_check.kernel_story(kernel, call, run)
        assert story.startswith(mark) and "your's" not in story, story
    assert "hint: " in your_engine_check.kernel_story(
        pieces["05.5"], call, your_engine_check.kernel_on_one_layer(pieces["05.5"], call))
