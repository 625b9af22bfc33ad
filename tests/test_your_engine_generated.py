"""Chapter 13's random workloads: wrong pieces its named scenarios let through.

Each piece here is wrong only in a state chapter 13's scenarios never reach (a token budget
already spent by decodes, a head that does not fit under chunked prefill, requests that
arrive out of order, a victim whose blocks a prefix hit shares, a block size that is not a
power of two). Saved alone into ``mine/``, it passes every scenario of
:mod:`~paged_lib.course.demos.your_engine_scenarios`; the random workloads served after
them (:func:`~paged_lib.course.demos.your_engine_scenarios.generated_verdict`) name it,
with the shrunk workload that shows it, and name no other piece.
"""

from __future__ import annotations

import pytest
from test_your_engine_blame import save_alone

from paged_lib.course import mine
from paged_lib.course.demos import your_engine, your_engine_scenarios
from paged_lib.course.exercises import SAVED

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CAN_ADMIT = '''
def can_admit(blocks_needed, num_seqs, num_tokens, budget):
    # one token per sequence already in the step counted as free
    b = budget
    return (b.free_blocks - blocks_needed >= b.watermark_blocks
            and b.num_seqs + num_seqs <= b.max_num_seqs
            and b.num_batched_tokens - b.num_seqs + num_tokens <= b.max_num_batched_tokens)
'''
SCHEDULE_WAITING = '''
def schedule_waiting(waiting, step):
    # with chunked prefill, a head that does not fit lets the groups behind it try
    if step.swapped or step.num_preempted:
        return
    for group in list(waiting):
        if any(seq.output_token_ids for seq in group.seqs):
            num_seqs = len(group.live_seqs())
        else:
            num_seqs = max(len(group.live_seqs()), group.params.num_seqs)
        tokens = step.prefill_tokens(group)
        if step.chunked_prefill:
            tokens = min(tokens, step.tokens_left)
            if tokens < 1:
                return
        need = step.blocks_needed(group, tokens)
        tokens_ok = tokens <= step.tokens_left
        fits = (step.free_blocks - need >= step.watermark_blocks
                and step.num_seqs + num_seqs <= step.max_num_seqs and tokens_ok)
        alone = (step.is_empty() and (not step.prefill_first or not step.running)
                 and need <= step.free_blocks and tokens_ok)
        if not (fits or alone):
            if step.chunked_prefill:
                continue
            return
        step.admit(group, tokens)
'''
CHOOSE_VICTIM = '''
def choose_victim(running):
    # the latest admission step, then the highest request id (ids need not follow arrival)
    return max(running, key=lambda g: (g.timeline.admitted_steps[-1], g.request_id))
'''
PREEMPT_UNTIL_FITS = '''
def preempt_until_fits(group, step):
    # what is missing counted once, then each victim's blocks taken off it
    short = step.blocks_needed - step.free_blocks
    while short > 0:
        later = step.running[step.running.index(group) + 1:]
        victim = step.hooks.choose_victim([group, *[g for g in later if not step.ran(g)]])
        held = len({b for s in victim.live_seqs() if s.block_table
                    for b in s.block_table.blocks})
        step.running.remove(victim)
        if step.preemption == "swap" and step.is_decoding(victim) and \\
                step.can_swap_out(victim):
            step.swap_out(victim)
            step.swapped.appendleft(victim)
        else:
            step.free(victim)
            step.waiting.appendleft(victim)
        if victim is group:
            return False
        short -= held
    return True
'''
DROP_OLDEST = '''
from paged_lib.blocks import BlockTable
from paged_lib.engine.window import WindowOp

def drop_oldest(table, num_sink_tokens):
    # block and offset by shifts and masks: right for powers of two only
    bs, sinks, pool = table.block_size, num_sink_tokens, table.allocator
    if table.num_tokens < sinks + bs:
        raise ValueError("too short")
    k, mask = bs.bit_length() - 1, bs - 1
    blocks, gone = table.blocks, sinks >> k
    if any(pool.refcount(b) > 1 for b in blocks[gone:]):
        raise ValueError("shared")
    kept = blocks[:gone] + blocks[gone + 1:]
    new = BlockTable(pool, bs, kept, table.num_tokens - bs)
    pool.free(blocks[gone])
    rotate = tuple((kept[x >> k] << k) + (x & mask) for x in range(sinks, new.num_tokens))
    if sinks & mask:
        return new, WindowOp(rotate, bs, blocks[gone], blocks[gone + 1], sinks & mask)
    return new, WindowOp(rotate, bs)
'''

#: (exercise, the state only random workloads reach, the saved source)
ONLY_GENERATED = [
    ("06.3", "a token budget already spent by decodes", CAN_ADMIT),
    ("06.4", "a head that does not fit under chunked prefill", SCHEDULE_WAITING),
    ("07.2", "requests admitted together out of id order", CHOOSE_VICTIM),
    ("07.3", "a victim sharing blocks through a prefix hit", PREEMPT_UNTIL_FITS),
    ("11.4", "block sizes that are not powers of two", DROP_OLDEST),
]


@pytest.mark.parametrize("ex_id, state, source", ONLY_GENERATED,
                         ids=[f"{e} {s}" for e, s, _ in ONLY_GENERATED])
def test_a_piece_wrong_only_in_random_workloads_is_named(tmp_path, monkeypatch, capsys,
                                                         ex_id, state, source):
    save_alone(tmp_path / "mine", ex_id, source)
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
