"""Chapter 13 met as a learner meets it: pieces edited by hand in ``mine/`` after their
check passed are told in their own words, on one line, never as a traceback or a hung cell."""

from __future__ import annotations

import pytest
from test_your_engine_blame import (
    APPEND_TOKEN,
    BLOCK_HASHES,
    CAN_ADMIT,
    CHOOSE_VICTIM,
    KERNEL,
    RANK_ATTENTION,
    save_alone,
)

from paged_lib.course import mine
from paged_lib.course.demos import your_engine, your_engine_scenarios

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RIGHT_CAN_ADMIT = CAN_ADMIT.format(
    watermark="budget.watermark_blocks", seqs="<=",
    tokens="budget.num_batched_tokens + num_tokens <= budget.max_num_batched_tokens")


def test_a_copy_given_as_a_list_is_told_as_such(tmp_path, monkeypatch):
    """Slot(block, offset, [src, dst]): the copy is there, as a list; the story says so,
    not that no copy was made."""
    as_list = APPEND_TOKEN.format(shared="table.allocator.refcount(table._blocks[-1]) > 1"
                                  ).replace("copy = (src, dst)", "copy = [src, dst]")
    save_alone(tmp_path / "mine", "03.1", as_list)
    monkeypatch.setenv(mine.ENV, str(tmp_path / "mine"))
    pieces, _ = your_engine.gather()
    verdict = your_engine_scenarios.check_piece("03.1", pieces["03.1"])
    assert verdict is not None and "(source, destination) tuples" in verdict, verdict
    assert "nobody wrote" not in verdict, verdict


def test_a_section_whose_def_was_renamed_is_not_told_unpassed(tmp_path, monkeypatch):
    save_alone(tmp_path / "mine", "06.3", RIGHT_CAN_ADMIT.replace("def can_admit(",
                                                                   "def can_admit_v2("))
    monkeypatch.setenv(mine.ENV, str(tmp_path / "mine"))
    pieces, parts = your_engine.gather()
    part = next(p for p in parts if p.ex_id == "06.3")
    assert "06.3" not in pieces and not part.yours
    assert "defines no can_admit" in part.note and "not passed" not in part.note, part.note


def test_a_piece_that_never_returns_is_named_not_waited_for(tmp_path, monkeypatch, capsys):
    """A loop that never ends (edited by hand into mine/, or on a state its exercise never
    gave): after PIECE_TIME_LIMIT_S the check names the piece in one line."""
    import signal

    save_alone(tmp_path / "mine", "07.2", CHOOSE_VICTIM.format(which="running[-1]").replace(
        "    return", "    while len(running) > 1:\n        pass\n    return"))
    monkeypatch.setenv(mine.ENV, str(tmp_path / "mine"))
    monkeypatch.setattr(your_engine_scenarios, "PIECE_TIME_LIMIT_S", 2.0)
    pieces, _ = your_engine.gather()
    handler = signal.getsignal(signal.SIGALRM)
    verdicts = your_engine_scenarios.check_pieces(pieces)
    out = capsys.readouterr().out.splitlines()
    assert verdicts[0][1] is not None and "still running at engine step" in verdicts[0][1]
    assert out == [f"❌ your 07.2 (preemption: which group to preempt) {verdicts[0][1]}"]
    assert signal.getsignal(signal.SIGALRM) is handler and signal.getitimer(
        signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_two_line_message_from_the_random_stage_stays_one_line(tmp_path, monkeypatch,
                                                                  capsys):
    """Right on the scenarios (block size 4), raising a message of two lines on random
    workloads of another block size: the ❌ is still one line."""
    save_alone(tmp_path / "mine", "10.1", BLOCK_HASHES.format(
        count="len(token_ids) // block_size", parent="parent").replace(
        "    hashes, parent = [], None", "    if block_size != 4:\n        raise ValueError("
        "'block size\\nnot 4')\n    hashes, parent = [], None"))
    monkeypatch.setenv(mine.ENV, str(tmp_path / "mine"))
    verdicts = your_engine_scenarios.check_pieces(your_engine.gather()[0])
    out = capsys.readouterr().out.splitlines()
    assert verdicts[0][1] is not None and "block size not 4" in verdicts[0][1], verdicts
    assert out == [f"❌ your 10.1 (prefix cache: chained block hashes) {verdicts[0][1]}"]


@pytest.mark.slow
def test_a_rank_that_raises_is_told_with_its_error(tmp_path, monkeypatch):
    """12.3 raising on rank 1: the line names the rank's error, not only 'Its traceback:'."""
    raising = "    if rank == 1:\n        raise ValueError('my bug')\n    q_heads,"
    save_alone(tmp_path / "mine", "12.3", RANK_ATTENTION.format(
        rank="rank", reduce="all_reduce").replace("    q_heads,", raising))
    monkeypatch.setenv(mine.ENV, str(tmp_path / "mine"))
    pieces, _ = your_engine.gather()
    verdict = your_engine_scenarios.check_piece("12.3", pieces["12.3"])
    assert verdict is not None and "rank 1" in verdict and "ValueError: my bug" in verdict


def test_a_kernel_wrong_only_for_a_padded_group_is_named(tmp_path, monkeypatch):
    """The tiny model's group (2) needs no padding; SmolLM2's (3) does: an unmasked store of
    the padded heads passes the scenario and is named on the padded call."""
    right = KERNEL.format(cmp="<", scale="scale")
    for source, named in ((right, False), (right.replace(", mask=real)\n", ")\n"), True)):
        save_alone(tmp_path / "mine", "05.5", source)
        monkeypatch.setenv(mine.ENV, str(tmp_path / "mine"))
        verdict = your_engine_scenarios.check_piece("05.5", your_engine.gather()[0]["05.5"])
        assert (verdict is not None) == named, verdict
        assert not named or "padded to 4): your kernel wrote outside" in verdict, verdict


def test_a_kernel_raising_without_a_message_is_told_not_a_traceback():
    """A bare ``assert`` (an AssertionError with no message) in a learner's kernel, on the
    real layer's call: one line, where ``splitlines()[0]`` raised IndexError."""
    import torch

    from paged_lib.course.demos import your_engine_check

    class Bare:  # kernel[grid](...) raises AssertionError()
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise AssertionError
            return launch

    k = torch.zeros(4, 4, 2, 8)
    call = dict(q=torch.zeros(1, 4, 8), k_cache=k, v_cache=k,
                block_tables=torch.tensor([[0]], dtype=torch.int32),
                seq_lens=torch.tensor([3], dtype=torch.int32), out=torch.zeros(1, 4, 8))
    run = your_engine_check.kernel_on_one_layer(Bare(), call)
    assert run.problem == "raised AssertionError: "
    assert your_engine.error_line(RuntimeError("rank 1 failed. Its traceback:\n"
                                                         "  File x\nValueError: bug")) == \
        "rank 1 failed. Its traceback: ValueError: bug"
