"""Grading a scheduler loop (06.4 ``schedule_waiting``, 07.3 ``preempt_until_fits``) by
serving it next to the library's, call by call: the first call that differs fails with the
state the hook saw, both decisions and the chapter's hint (scenarios, then random
workloads, shrunk)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from paged_lib.course import grading
from paged_lib.course.grading import generated, serving
from paged_lib.engine.block_manager import BlockManager
from paged_lib.engine.hooks import EngineHooks
from paged_lib.engine.sampler import num_samples
from paged_lib.engine.scheduler import Scheduler
from paged_lib.engine.sequence import SamplingParams, Sequence, SequenceGroup


class Record(NamedTuple):
    step: int
    state: Any  # what the hook saw
    decision: Any  # what it did


#: hook name -> (snapshot(args) -> state, decision(args, before, result) -> decision,
#: describe(state) -> str, show(decision) -> str, hint(state, lib, yours) -> str)
LOOPS: dict[str, tuple[Callable, ...]] = {}


def recorder(name: str, fn: Callable, log: list[Record], where: list,
             reference: list[Record] | None = None, label: str = "") -> Callable:
    """``fn`` wrapped: every call is appended to ``log``; with ``reference`` (the
    library's records of the same run), the first call that differs fails the check."""
    snapshot, decide, describe, show, why = LOOPS[name]

    def call(*args: Any) -> Any:
        step = where[0].step
        state = snapshot(*args)
        before = len(args[-1].admitted), len(args[-1].preempted)  # the step's so far
        k = len(log)
        lib = reference[k] if reference is not None and k < len(reference) else None
        story = f"{label}, at engine step {step}"
        if reference is not None and lib is None:
            grading.fail(f"{story}: the engine asked {name} more often than with the "
                         "library's (the schedules drifted apart before)")
        if lib is not None and (lib.step, lib.state) != (step, state):
            grading.fail(f"{story}: the engine reached a state the library's run never "
                         f"did ({describe(state)}; the library's run had "
                         f"{describe(lib.state)} at step {lib.step})", "an earlier decision "
                         "of yours changed something the comparison does not see: compare "
                         "the steps before")
        try:
            result = fn(*args)
        except (NotImplementedError, grading.TwinCalled):
            raise  # not attempted yet; the library's twin called (the verdict says so)
        except Exception as err:  # noqa: BLE001 - the learner's bug, told as a story
            if reference is None:
                raise
            grading.fail(f"{story}, with {describe(state)}: your {name} raised "
                         f"{type(err).__name__}: {err}", why(state, lib.decision, err))
        got = decide(args, before, result)
        log.append(Record(step, state, got))
        if lib is not None and got != lib.decision:
            grading.fail(f"{story}, with {describe(state)}: the library "
                         f"{show(lib.decision)}; yours {show(got)}", why(state, lib.decision, got))
        return result

    return call


# ------------------------------------------------------------------ serving


@dataclass(frozen=True)
class Scenario:
    """Requests served by the scheduler alone: ``requests`` (prompt length or token ids,
    max_tokens, arrival step, n (-n: n beams)[, stop token: the j-th sample draws ``3 + j``]);
    ``options``: the Scheduler's and BlockManager's keywords; ``hooks``: other engine
    hooks for both runs."""

    name: str
    options: dict
    requests: tuple
    hooks: tuple = ()  # (hook name, function) pairs


def serve_scenario(sc: Scenario, hooks: EngineHooks, where: list, max_steps: int = 300) -> tuple:
    """(tokens per request, free blocks at the end, steps, (finish steps, tokens
    recomputed)) of ``sc``, every token 3."""
    opts = dict(sc.options)
    bm = BlockManager(opts.pop("num_blocks"), opts.pop("block_size"),
                      num_cpu_blocks=opts.pop("num_cpu_blocks", 0),
                      enable_prefix_caching=opts.pop("enable_prefix_caching", False),
                      hooks=hooks)
    sched = where[0] = Scheduler(bm, hooks=hooks, **opts)
    groups: dict[int, SequenceGroup] = {}
    recomputed = 0
    for _ in range(max_steps):
        for rid, (prompt, max_tokens, arrival, n, *stop) in enumerate(sc.requests):
            if arrival == sched.step:
                text = list(prompt) if not isinstance(prompt, int) else \
                    [10 + (7 * rid + t) % 50 for t in range(prompt)]
                groups[rid] = SequenceGroup(rid, [Sequence(rid * 10, text)], SamplingParams(
                    max_tokens=max_tokens, ignore_eos=True, n=max(n, 1), stop_token_ids=stop
                    or None, temperature=1.0 if n > 1 else 0.0, seed=rid if n > 1 else None,
                    beam_width=-n if n < 0 else None))
                sched.add(groups[rid])
        if len(groups) == len(sc.requests) and not sched.has_unfinished():
            break
        out = sched.schedule()
        recomputed += out.recomputed_tokens
        sched.update(out, [_draws(s) for s in out.scheduled], None)
    tokens = [[s.output_token_ids for s in g.seqs] for _, g in sorted(groups.items())]
    return tokens, bm.num_free_blocks, sched.step, (
        {rid: g.timeline.finished_step for rid, g in sorted(groups.items())}, recomputed)


def _draws(s) -> list[tuple[int, float]]:
    k, group, w = num_samples(s), s.group, s.group.params.beam_width  # beams: w + 1 best
    if w or not group.params.stop_token_ids:
        return [(3 + j, -j / 8) for j in range(w + 1)] if w else [(3, 0.0)] * k
    return [(3 + j, 0.0) for j in range(k)] if k > 1 else \
        [(3 + next(j for j, q in enumerate(group.seqs) if q is s.seq), 0.0)]


_LIBRARY: dict[tuple[str, str], tuple[list[Record], tuple]] = {}


def _compare(name: str, fn: Callable, label: str, serve: Callable, others: dict) -> Any:
    """Serve with the library's hook ``name`` (once per process and ``label``), then with
    ``fn`` compared call by call; what ``serve`` returned for each."""
    if (name, label) not in _LIBRARY:
        ref, where = [], [None]
        lib = recorder(name, getattr(EngineHooks(), name), ref, where)
        _LIBRARY[name, label] = ref, serve(EngineHooks(**others, **{name: lib}), where)
    ref, want = _LIBRARY[name, label]
    log, where = [], [None]
    try:
        got = serve(EngineHooks(**others, **{name: recorder(name, fn, log, where, ref, label)}),
                    where)
    except ValueError as err:  # the scheduler's checks of the hook's answer
        grading.fail(f"{label}, at engine step {where[0].step}: {err}")
    grading.expect_equal(len(log), len(ref), f"{label}: calls to {name}",
                         "the engine asked fewer times: the run ended differently")
    return got, want


def run_scheduler(name: str, fn: Callable, scenarios: list[Scenario], hint: str) -> None:
    """Each scenario, then the random workloads (the first that differs shrunk and served
    again call by call), with the library's hook ``name`` and with ``fn``."""
    with serving.one_thread():
        for sc in scenarios:
            at = f"serving with your {name}: in '{sc.name}'"
            got, want = _compare(name, fn, at, functools.partial(serve_scenario, sc),
                                 dict(sc.hooks))
            for what, k, why in (("the tokens", 0, "same decisions, different tokens: a "
                                  "group must sample exactly when the library's does"),
                                 ("free blocks at the end", 1, "every block comes back when "
                                  "every request is done"), ("steps", 2, None)):
                grading.expect_equal(got[k], want[k], f"{at}: {what}", why)

    def tell(label: str, small: Any) -> None:  # the shrunk workload, call by call
        def serve(hooks: EngineHooks, where: list) -> Any:
            return generated.serve(small, hooks, ready=lambda e: where.__setitem__(
                0, e.scheduler))
        with serving.one_thread():
            _compare(name, fn, label, serve, {})
    generated.check(name, fn, hint, tell=tell)
