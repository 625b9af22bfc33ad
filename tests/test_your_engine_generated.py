"""Chapter 13's random workloads: wrong pieces its named scenarios let through.

Each piece here is wrong only in a state chapter 13's scenarios never reach (a token budget
already spent by decodes, a head that does not fit under chunked prefill, requests that
arrive out of order, a victim whose blocks a prefix hit shares, a hash cached in two
blocks, a block size that is not a power of two): the wrong pieces that only the random
stage of their exercises' checks catches (``tests/test_generated_stage.py``). Saved alone
into ``mine/``, it passes every scenario of
:mod:`~paged_lib.course.demos.your_engine_scenarios`; the random workloads served after
them (:mod:`~paged_lib.course.demos.your_engine_random`) name it, with the shrunk
workload that shows it, and name no other piece.
"""

from __future__ import annotations

import inspect
import textwrap

import pytest
import test_generated_stage as stage
from test_your_engine_blame import save_alone

from paged_lib.course import mine
from paged_lib.course.demos import your_engine, your_engine_scenarios
from paged_lib.course.exercises import SAVED

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IMPORTS = ("from paged_lib.blocks import BlockTable\n"
           "from paged_lib.engine.window import WindowOp\n\n")


def saved_as(fn, name: str) -> str:
    """The source of one of test_generated_stage's wrong pieces, renamed as its stub's
    ``name`` (what ``mine/`` loads), with the imports it uses."""
    source = textwrap.dedent(inspect.getsource(fn))
    return IMPORTS + source.replace(f"def {fn.__name__}(", f"def {name}(", 1)


#: (exercise, the state only random workloads reach, the wrong piece)
ONLY_GENERATED = [
    ("06.3", "a token budget already spent by decodes", stage.can_admit_decode_tokens_free),
    ("06.4", "a head that does not fit under chunked prefill",
     stage.schedule_waiting_chunks_skip_ahead),
    ("07.2", "requests admitted together out of id order",
     stage.victim_latest_step_then_latest_id),
    ("07.3", "a victim sharing blocks through a prefix hit",
     stage.preempt_counting_what_victims_hold),
    ("10.4", "one hash cached in two blocks", stage.alloc_by_a_hash_map),
    ("11.4", "block sizes that are not powers of two", stage.drop_oldest_by_shifts),
]


@pytest.mark.parametrize("ex_id, state, wrong", ONLY_GENERATED,
                         ids=[f"{e} {s}" for e, s, _ in ONLY_GENERATED])
def test_a_piece_wrong_only_in_random_workloads_is_named(tmp_path, monkeypatch, capsys,
                                                         ex_id, state, wrong):
    save_alone(tmp_path / "mine", ex_id, saved_as(wrong, SAVED[ex_id].name))
    monkeypatch.setenv(mine.ENV, str(tmp_path / "mine"))
    pieces, _ = your_engine.gather()
    assert list(pieces) == [ex_id]
    with monkeypatch.context() as m:  # the scenarios alone let it through
        m.setattr(your_engine_scenarios, "NOT_GENERATED", tuple(SAVED))
        assert your_engine_scenarios.check_piece(ex_id, pieces[ex_id]) is None, state
    verdicts = your_engine_scenarios.check_pieces(pieces)
    out = capsys.readouterr().out.splitlines()
    assert verdicts[0][0] == ex_id and verdicts[0][1] is not None, f"{state}: not caught"
    story = verdicts[0][1]
    assert out == [f"❌ your {ex_id} ({SAVED[ex_id].role}) {story}"]
    assert story.startswith("on random workload ") and "(the workload, shrunk: " in story
    assert "engine step " in story and "Traceback" not in story and len(out[0]) < 900
    print(story)
