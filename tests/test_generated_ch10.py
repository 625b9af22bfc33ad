"""Chapter 10's generated stages catch what the fixed cases let through.

10.3's free queue: a ``remove`` that tests "is this block queued?" by the truth of
``next.get(block)`` refuses a queued block whose successor is block 0. The scripted
operations and the worked example never remove the block just before block 0; the random
workloads, served on small pools where evictions and reuse put block 0 anywhere in the
queue, do. (10.1's and 10.2's generated-only wrong answers are in test_generated_small.py,
10.4's in test_generated_stage.py.)
"""

import pytest

import paged_lib  # noqa: F401  # isort: split
from paged_lib.course import grading
from paged_lib.course.grading import ch10, generated
from paged_lib.engine.prefix_cache import FreeBlockQueue

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class RemoveFalsyNext(FreeBlockQueue):
    """popleft as the library's; remove reads "no next entry" from a falsy next.get(...),
    so block 0 as the successor reads as "not queued"."""

    def popleft(self):
        block = self.next[self.HEAD]
        if block == self.TAIL:
            raise IndexError("popleft from an empty free queue")
        after = self.next.pop(block)
        del self.prev[block]
        self.next[self.HEAD], self.prev[after] = after, self.HEAD
        self._len -= 1
        return block

    def remove(self, block_id):
        after = self.next.get(block_id)
        if not after:
            raise ValueError(f"block {block_id} is not in the free queue")
        before = self.prev.pop(block_id)
        del self.next[block_id]
        self.next[before], self.prev[after] = after, before
        self._len -= 1


def verdict(check, fn, monkeypatch=None):
    """(mark, message) of the grader on ``fn``; with ``monkeypatch``, without the random
    stage."""
    if monkeypatch is not None:
        monkeypatch.setattr(generated, "check", lambda *args, **kwargs: None)
    with grading.record_verdicts() as seen:
        check(fn)
    if monkeypatch is not None:
        monkeypatch.undo()
    return seen[-1][0], seen[-1][2]


def test_10_3_a_falsy_successor_check_is_caught_only_by_the_random_workloads(monkeypatch,
                                                                           capsys):
    assert verdict(ch10.check_free_queue, RemoveFalsyNext, monkeypatch)[0] == "✅"
    capsys.readouterr()
    mark, story = verdict(ch10.check_free_queue, RemoveFalsyNext)
    printed = capsys.readouterr().out
    print(story)
    assert mark == "❌" and story.startswith("random workload ") and "shrunk to " in story
    assert "enable_prefix_caching=True" in story
    # the story shows the queue the refused remove was asked on: the block, then block 0
    block = int(story.split("ValueError at engine step ")[1].split("remove(")[1].split(")")[0])
    queue = story.split("on the free queue ")[1].split(" (head first)")[0]
    assert f"{block}, 0" in queue, story
    assert "block 0 too" in printed and "whatever next[block] holds" in printed, printed


def test_10_3_the_workloads_reach_a_hit_on_the_block_before_block_0():
    seen = []

    class Spy(FreeBlockQueue):
        def remove(self, block_id):
            seen.append(self.next[block_id] == 0)
            super().remove(block_id)

    from paged_lib.engine import EngineHooks

    for w in generated.workloads("FreeBlockQueue"):
        generated.serve(w, EngineHooks(FreeBlockQueue=Spy))
    assert any(seen) and len(seen) > 40, (sum(seen), len(seen))
