"""Grading by replay: every call the library's engine makes to a hook, asked of yours.

A fixed list of cases reaches only the states its author thought of. The engine reaches
others: a prefill that starts in the middle of a sequence (a prefix hit, a recompute's
tail, a chunk), groups admitted in the same step, blocks shared by a forked group in
every pattern, a budget half spent by decodes. So a grader here serves a few workloads
that use every feature of the engine (parallel sampling, beams, prefix hits in the same
step and later, chunked prefill, both preemptions, ``prefill_first``, a sliding window)
with the library's pieces, records each call the engine makes to the hook under test
(:class:`~paged_lib.engine.hooks.EngineHooks`), replays the calls on the learner's
function and compares each answer with the library's. The first difference is told as
a short story: the workload, the engine step, what the engine asked, the two answers.

A wrong rule then passes only if no state the engine reaches tells it from the library's.
The recording runs once per process (a few seconds on the shipped tiny model).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from paged_lib.course import grading
from paged_lib.course.exercises import REPLAYED  # the hooks this module replays
from paged_lib.course.grading import serving
from paged_lib.engine.sequence import Sequence, SequenceGroup


@dataclass
class Call:
    workload: str
    step: int
    args: tuple          # a snapshot: replaying cannot change what was recorded
    result: Any          # the library's answer, in comparable form
    extra: Any = None    # what the hook's callbacks answered (allocate, lookup)


@dataclass(frozen=True)
class Workload:
    name: str
    options: dict
    prompts: list
    params: list
    arrivals: list


def workloads() -> list[Workload]:
    """Small workloads that together reach every feature of the engine."""
    from paged_lib.engine import SamplingParams as P

    g = torch.Generator().manual_seed(26)

    def text(n: int, base: list[int] = ()) -> list[int]:
        return list(base) + torch.randint(32, 127, (n,), generator=g).tolist()

    prefix = text(12)
    mixed = [text(5, prefix), text(17), text(3, prefix), text(9), text(26), text(7, prefix)]
    mixed_params = [P(max_tokens=8, temperature=1.0, n=2, seed=1), P(max_tokens=6, beam_width=2),
                    P(max_tokens=9, temperature=0.0), P(max_tokens=7, temperature=0.9, n=3, seed=2),
                    P(max_tokens=5, beam_width=3), P(max_tokens=10, temperature=0.0)]
    arrivals = [0, 0, 1, 2, 2, 4]
    same_step = [text(k, prefix) for k in (3, 6, 2, 9)] + [text(4, prefix), text(20)]
    greedy = [P(max_tokens=6, ignore_eos=True, temperature=0.0)] * len(same_step)
    return [
        Workload("samples and beams, recompute, 16 blocks of 4", dict(
            num_blocks=16, block_size=4, watermark=0), mixed, mixed_params, arrivals),
        Workload("samples and beams, swap, 16 blocks of 4 (CPU pool 64)", dict(
            num_blocks=16, block_size=4, watermark=0, preemption="swap",
            num_cpu_blocks=64), mixed, mixed_params, arrivals),
        Workload("prefix caching and chunks of 10 tokens, 14 blocks of 4", dict(
            num_blocks=14, block_size=4, watermark=0, enable_prefix_caching=True,
            enable_chunked_prefill=True, max_num_batched_tokens=10, max_num_seqs=6),
            same_step, greedy, [0, 0, 0, 0, 3, 5]),
        Workload("prefill_first, watermark 0.2, 20 blocks of 4", dict(
            num_blocks=20, block_size=4, watermark=0.2, scheduling="prefill_first",
            max_num_seqs=5), mixed, mixed_params, [0, 0, 0, 1, 1, 1]),
        Workload("beams of 3 and 4 and samples, swap, chunks of 8, 14 blocks of 2", dict(
            num_blocks=14, block_size=2, watermark=0, preemption="swap", num_cpu_blocks=64,
            enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=8),
            [text(5), text(3), text(9), text(4)],
            [P(max_tokens=7, beam_width=4), P(max_tokens=6, beam_width=3),
             P(max_tokens=5, temperature=1.0, n=3, seed=3),
             P(max_tokens=8, beam_width=3)], [0, 0, 1, 3]),
        Workload("a sliding window of 12 with 2 sinks, 12 blocks of 4", dict(
            num_blocks=12, block_size=4, sliding_window=12, num_sink_tokens=2, watermark=0),
            [text(6), text(10), text(4)], [P(max_tokens=30, ignore_eos=True, temperature=0.0)] * 3,
            [0, 1, 1]),
    ]


# ------------------------------------------------------------------ snapshots


def _table(t: Any) -> Any:
    return None if t is None else SimpleNamespace(blocks=list(t.blocks),
                                                  num_tokens=t.num_tokens,
                                                  block_size=t.block_size)


def _group(g: SequenceGroup) -> SequenceGroup:
    """A copy a learner's function may read (its tables as plain ``blocks``/``num_tokens``)
    without reaching the engine's objects."""
    seqs = [Sequence(s.seq_id, list(s.prompt_token_ids), list(s.output_token_ids),
                     s.cumulative_logprob, _table(s.block_table), s.num_cached, s.status)
            for s in g.seqs]
    return SequenceGroup(g.request_id, seqs, g.params, None, copy.deepcopy(g.timeline),
                         g.error, list(g.beam_done), g.awaiting_tails)


def _recorder(name: str, fn: Callable, log: dict, where: list) -> Callable:
    def record(*args: Any) -> Any:
        workload, engine = where
        step = engine.scheduler.step if engine is not None else -1
        extra = None
        if name == "swap_mapping":
            tables, allocate = args
            handed: list[int] = []

            def allocating() -> int:
                handed.append(allocate())
                return handed[-1]
            result = fn(tables, allocating)
            snap, extra = ([list(t) for t in tables],), handed
        elif name == "longest_cache_hit":
            hashes, lookup, num_tokens, block_size = args
            extra = {h: lookup(h) for h in hashes}
            result = fn(*args)
            snap = (list(hashes), num_tokens, block_size)
        elif name == "num_required_blocks":
            snap = (_group(args[0]), args[1])
            result = fn(*args)
        elif name == "choose_victim":
            snap = ([_group(g) for g in args[0]],)
            result = fn(*args)
            log[name].append(Call(workload, step, snap, [g is result for g in args[0]]
                                  .index(True)))
            return result
        else:  # pure: ints, a frozen Budget, lists of ints
            snap = copy.deepcopy(args)
            result = fn(*args)
        log[name].append(Call(workload, step, snap, _comparable(name, result), extra))
        return result

    return record


def _comparable(name: str, result: Any) -> Any:
    if name == "build_metadata":
        return {f: getattr(result, f).tolist() for f in
                ("slot_mapping", "block_tables", "seq_lens", "query_lens", "positions")}
    if name in ("swap_mapping", "longest_cache_hit", "block_hashes"):
        return [tuple(x) if isinstance(x, list) else x for x in result]
    return result


@functools.cache
def recorded() -> dict[str, list[Call]]:
    """Every call the library's engine makes to each replayed hook, on :func:`workloads`
    (the shipped tiny model, the library's pieces), once per process."""
    from paged_lib.engine import EngineHooks
    from paged_lib.model import load_tiny_code_llama

    model, library = load_tiny_code_llama(), EngineHooks()
    log: dict[str, list[Call]] = {name: [] for name in REPLAYED}
    with serving.one_thread():
        for w in workloads():
            where: list = [w.name, None]
            hooks = EngineHooks(**{n: _recorder(n, getattr(library, n), log, where)
                                   for n in REPLAYED})
            serving.serve(model, w, hooks, ready=lambda e, where=where: where.__setitem__(1, e))
    return log


# ------------------------------------------------------------------ replay


def _ask(name: str, fn: Callable, call: Call) -> Any:
    """The learner's answer to one recorded call, in comparable form."""
    if name == "swap_mapping":
        handed = iter(call.extra)

        def allocate() -> int:
            try:
                return next(handed)
            except StopIteration:
                grading.fail(f"{call.workload}, engine step {call.step}: swap_mapping"
                             f"({call.args[0]}, allocate) called allocate() more than "
                             f"{len(call.extra)} times, once per distinct block",
                             "a block shared by several tables is copied once")
            return -1
        return _comparable(name, fn([list(t) for t in call.args[0]], allocate))
    if name == "longest_cache_hit":
        hashes, num_tokens, block_size = call.args
        return _comparable(name, fn(list(hashes), call.extra.get, num_tokens, block_size))
    if name == "choose_victim":
        groups = [_group(g) for g in call.args[0]]
        got = fn(list(groups))
        found = [g is got for g in groups]
        return found.index(True) if any(found) else got
    args = copy.deepcopy(call.args)
    if name == "num_required_blocks":
        args = (_group(args[0]), args[1])
    return _comparable(name, fn(*args))


def _describe(name: str, call: Call) -> str:
    if name == "choose_victim":
        return "choose_victim([" + ", ".join(
            f"request {g.request_id} ({len(g.live_seqs())} live sequence(s), admitted at "
            f"step {g.timeline.admitted_steps[-1]})" for g in call.args[0]) + "])"
    if name == "num_required_blocks":
        g, bs = call.args
        tails = [len(s.output_token_ids) for s in g.live_seqs()]
        return (f"num_required_blocks(request {g.request_id}: prompt of "
                f"{len(g.prompt_token_ids)} tokens, {len(g.live_seqs())} live sequence(s) "
                f"with {tails} generated, n={g.params.n}, beam_width={g.params.beam_width}, "
                f"block_size={bs})")
    if name == "longest_cache_hit":
        hashes, n, bs = call.args
        cached = [call.extra[h] for h in hashes]
        return (f"longest_cache_hit({len(hashes)} hashes whose lookups give {cached}, "
                f"num_tokens={n}, block_size={bs})")
    if name == "block_hashes":
        tokens, bs = call.args[:2]
        return f"block_hashes({len(tokens)} token ids, block_size={bs})"
    shown = ", ".join(repr(a) for a in call.args)
    return f"{name}({shown if len(shown) < 300 else shown[:300] + ' ...'})"


def _show(name: str, call: Call, answer: Any) -> str:
    if name == "choose_victim" and isinstance(answer, int):
        return f"request {call.args[0][answer].request_id}"
    if name == "block_hashes" and isinstance(answer, list):
        return f"{len(answer)} hashes" + (f" starting {answer[0]!r}" if answer else "")
    return repr(answer)


def check_replay(name: str, fn: Callable, hint: str | Callable[[Call, Any], str]) -> None:
    """Replay every recorded call to hook ``name`` on ``fn``; fail at the first answer
    that differs from the library's, with the story of that call and ``hint`` (or
    ``hint(call, answer)``). Called from inside an exercise's checks, after its cases."""
    for call in recorded()[name]:
        got = _ask(name, fn, call)
        if got != call.result:
            grading.fail(f"replaying the engine: in '{call.workload}', at engine step "
                         f"{call.step}, it asked {_describe(name, call)}; the library "
                         f"answers {_show(name, call, call.result)}, yours "
                         f"{_show(name, call, got)}",
                         hint(call, got) if callable(hint) else hint)
