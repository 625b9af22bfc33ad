"""Chapter 07's swap_mapping (07.1) against a wrong answer only the random workloads catch.

The fixed scenarios give each call a fresh destination pool; only a served engine calls
the learner's function again and again with the same pool's ``allocate``, while the block
ids it freed come back. A mapping that remembers copies across calls is right on every
call taken alone and wrong there.
"""

import functools

import pytest

import paged_lib  # noqa: F401  # isort: split
from paged_lib.course import grading
from paged_lib.course.grading import ch07, generated

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def swap_mapping_memoized():
    """Each block's copy memoized with functools.cache, keyed by (block, allocate), "so
    that a block is copied once": right within one call, but the engine's allocate is the
    same pool's every time, so a block id swapped out again gets an earlier copy."""
    @functools.cache
    def copy_of(block, allocate):
        return allocate()

    def swap_mapping(tables, allocate):
        pairs, seen = [], set()
        for table in tables:
            for block in table:
                if block not in seen:
                    seen.add(block)
                    pairs.append((block, copy_of(block, allocate)))
        return pairs
    return swap_mapping


def verdict(fn, monkeypatch=None):
    """07.1's verdict on ``fn``; with ``monkeypatch``, without the random stage."""
    if monkeypatch is not None:
        monkeypatch.setattr(generated, "check", lambda *args, **kwargs: None)
    with grading.record_verdicts() as seen:
        ch07.check_swap_mapping(fn)
    if monkeypatch is not None:
        monkeypatch.undo()
    return seen[-1]


def test_07_1_a_mapping_that_remembers_copies_passes_the_fixed_stages(monkeypatch):
    mark, _, told = verdict(swap_mapping_memoized(), monkeypatch)
    assert mark == "✅", f"the fixed scenarios already catch it: {told}"


def test_07_1_the_random_workloads_catch_it_with_a_shrunk_story(capsys):
    ch07.check_swap_mapping(swap_mapping_memoized())
    verdict_line, hint = capsys.readouterr().out.splitlines()
    print(verdict_line, hint, sep="\n")
    assert verdict_line.startswith("❌ [07.1]") and "random workload " in verdict_line
    assert "shrunk to " in verdict_line and "preemption='swap'" in verdict_line
    assert "at engine step " in verdict_line
    assert "nothing carries over from an earlier call" in hint, hint


def test_the_swap_workloads_swap_a_block_id_out_twice():
    """The state that exposes it: the same GPU block id copied out in two steps of one
    served workload (to the same CPU pool), which no fixed scenario gives the learner's
    function."""
    twice = 0
    for w in generated.workloads("swap_mapping"):
        steps, _ = generated.serve(w)
        out = [{src for src, _ in step[4]} for step in steps if step[4]]
        twice += any(a & b for i, a in enumerate(out) for b in out[i + 1:])
    assert twice > 0
