"""The step's read-only view for hooks and graders: who was admitted or preempted so far,
the tokens scheduled for a group, the CPU pool's free blocks (no private state needed)."""

from __future__ import annotations

from paged_lib.engine import policy
from paged_lib.engine.block_manager import BlockManager
from paged_lib.engine.hooks import EngineHooks
from paged_lib.engine.scheduler import Scheduler
from paged_lib.engine.sequence import SamplingParams, Sequence, SequenceGroup


def _group(rid: int, prompt_len: int, max_tokens: int = 8) -> SequenceGroup:
    return SequenceGroup(rid, [Sequence(rid, list(range(10, 10 + prompt_len)))],
                         SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _serve(hooks: EngineHooks, num_blocks: int, num_cpu_blocks: int, groups, steps: int):
    bm = BlockManager(num_blocks, 4, num_cpu_blocks=num_cpu_blocks, hooks=hooks)
    sched = Scheduler(bm, hooks=hooks, preemption="swap" if num_cpu_blocks else "recompute")
    for g in groups:
        sched.add(g)
    for _ in range(steps):
        out = sched.schedule()
        sched.update(out, [[(3, 0.0)] for _ in out.scheduled], None)


def test_waiting_step_shows_admitted_groups_and_their_tokens():
    seen = []

    def schedule_waiting(waiting, step):
        before = step.admitted
        policy.schedule_waiting(waiting, step)
        seen.append((before, [(g.request_id, step.tokens_scheduled(g)) for g in step.admitted]))

    _serve(EngineHooks(schedule_waiting=schedule_waiting), 32, 0,
           [_group(0, 5), _group(1, 3)], 1)
    assert seen == [((), [(0, 5), (1, 3)])]


def test_running_step_shows_victims_and_the_cpu_pool():
    seen = []

    def preempt_until_fits(group, step):
        free_cpu = step.cpu_free_blocks
        runs = policy.preempt_until_fits(group, step)
        seen.append((free_cpu, [g.request_id for g in step.preempted], step.cpu_free_blocks))
        assert isinstance(step.preempted, tuple)  # a copy: the step's list stays its own
        return runs

    _serve(EngineHooks(preempt_until_fits=preempt_until_fits), 4, 8,
           [_group(0, 4, 12), _group(1, 4, 12)], 12)
    first = next(s for s in seen if s[1])  # the first call that preempted
    assert first[0] == 8 and first[1] == [1] and first[2] < 8
    seen.clear()
    _serve(EngineHooks(preempt_until_fits=preempt_until_fits), 4, 0,
           [_group(0, 4, 12), _group(1, 4, 12)], 12)
    first = next(s for s in seen if s[1])
    assert first[0] is None and first[1] == [1] and first[2] is None
