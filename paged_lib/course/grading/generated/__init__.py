"""Random workloads served side by side: the last stage of the engine pieces' graders.

Seeded workloads (:mod:`.workload`: samples, beams, chunks, prefix caching, both
preemptions, watermarks, tight pools, arrivals out of order, stop tokens, windows, int8,
fp16) are served with the library's pieces and with the learner's piece in its hook,
and compared step by step through the engine's ``on_step``: who ran, was admitted,
preempted, swapped, copied, hit the prefix cache, the blocks in use, the tokens drawn.
The first workload that differs is shrunk (as hypothesis shrinks an example) and told as
one story: the workload, the engine step, what each engine did.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from paged_lib.course import grading
from paged_lib.course.grading import serving
from paged_lib.course.grading.generated.workload import (
    Request,
    Workload,
    candidates,
    draw,
)

#: Workloads drawn per exercise, and the most pairs of runs a shrink may try (then the
#: most it may try on the pool's size alone).
NUM_WORKLOADS, MAX_SHRINK_RUNS, POOL_SHRINK_RUNS = 16, 60, 16


# ------------------------------------------------------------------ serving


@functools.cache
def _model(dtype: str):
    """The shipped tiny model cut to its first layer: the pieces graded here decide
    schedules, blocks and slots, which one layer reads and writes as four would (a
    wrong slot still changes its tokens), in a quarter of the time."""
    from paged_lib.model import load_tiny_code_llama

    model = load_tiny_code_llama(torch.float16 if dtype == "fp16" else torch.float32)
    model.layers = torch.nn.ModuleList(list(model.layers)[:1])
    model.config = dataclasses.replace(model.config, num_layers=1)
    return model


def _engine(w: Workload, hooks: Any, on_step: Callable):
    """The engine ``w`` is served on: ``hooks`` is an :class:`EngineHooks` (or ``None``,
    the library's), or a function that builds the engine from the model, the pool's size
    and the options (chapter 13's engine of saved pieces, some of which are not hooks)."""
    from paged_lib.engine import EngineHooks, LLMEngine

    opts = dict(w.options)
    model = _model(opts.pop("dtype", "fp32"))
    if hooks is not None and not isinstance(hooks, EngineHooks):
        return hooks(model, w.num_blocks, w.block_size, attention_backend="torch",
                     on_step=on_step, **opts)
    return LLMEngine(model, w.num_blocks, w.block_size, attention_backend="torch",
                     hooks=hooks, on_step=on_step, **opts)


def _record(out: Any, stats: Any) -> tuple:
    """One step as plain data: what the library's run and the learner's are compared on."""
    ran = tuple((s.group.request_id, s.seq.seq_id, s.num_new_tokens) for s in out.scheduled)
    drawn = tuple((s.group.request_id, s.seq.seq_id, tuple(s.seq.output_token_ids[-1:]))
                  for s in out.scheduled if s.sample)
    return (out.step, ran, tuple(g.request_id for g in out.admitted),
            tuple(g.request_id for g in out.preempted), tuple(out.swap_out),
            tuple(out.swap_in), tuple(out.blocks_to_copy), out.prefix_cache_hit_tokens,
            stats.blocks_used[-1], drawn)


_FIELDS = ("ran (request, sequence, tokens)", "admitted", "preempted", "swapped out "
           "(GPU block, CPU block)", "swapped in (CPU block, GPU block)",
           "copy-on-write copies (src, dst)", "prompt tokens from the prefix cache",
           "blocks in use after the step", "tokens drawn (request, sequence, token)")


class _Differs(Exception):
    """The learner's run left the library's: no need to serve the rest."""


def serve(w: Workload, hooks: Any = None, reference: list[tuple] | None = None,
          limit: int | None = None, ready: Callable | None = None) -> tuple[list[tuple], Any]:
    """(the steps' records, the outputs' tokens or the error that stopped the run, or
    ``None`` when it was cut short): with ``reference`` (the library's records) the run
    stops at the first step that differs, with ``limit`` after that many steps;
    ``ready(engine)`` runs before the first step."""
    steps: list[tuple] = []
    engine = None

    def on_step(out: Any, stats: Any) -> None:
        steps.append(_record(out, stats))
        k = len(steps) - 1
        if reference is not None and (k >= len(reference) or steps[k] != reference[k]):
            raise _Differs
        if limit is not None and len(steps) >= limit:
            raise _Differs

    try:
        engine = _engine(w, hooks, on_step)
        if ready is not None:
            ready(engine)
        outs = engine.generate([list(r.prompt) for r in w.requests], [
            _sampling(r) for r in w.requests], arrival_steps=[r.arrival for r in w.requests])
        end: Any = [(o.error, [c.token_ids for c in o.outputs]) for o in outs]
    except _Differs:
        end = None
    except (NotImplementedError, grading.CheckFailed):
        raise  # not attempted yet, or the library's twin called: the verdict says so
    except Exception as err:  # noqa: BLE001 - the learner's piece, or what the engine checks
        step = engine.scheduler.step if engine is not None else "start"
        end = _Raised(f"{type(err).__name__} at engine step {step}: {err}")
    finally:
        if engine is not None:
            engine.close()
    return steps, end


@dataclass(frozen=True)
class _Raised:
    what: str


def _sampling(r: Request):
    from paged_lib.engine import SamplingParams

    p = dict(r.params)
    if "stop_token_ids" in p:
        p["stop_token_ids"] = list(p["stop_token_ids"])
    return SamplingParams(**p)


_LIBRARY: dict[tuple[Workload, int | None], tuple[list[tuple], Any]] = {}


def _library(w: Workload, limit: int | None = None) -> tuple[list[tuple], Any]:
    """The library's run of ``w``, served once per process (every check compares with it)."""
    if (w, limit) not in _LIBRARY:
        _LIBRARY[w, limit] = serve(w, limit=limit)
    return _LIBRARY[w, limit]


def valid(w: Workload) -> bool:
    """The library's engine serves ``w`` without an error (options that combine)."""
    return not isinstance(_library(w)[1], _Raised)


def difference(w: Workload, hooks: Any, limit: int | None = None) -> tuple[int, str] | None:
    """(how many steps in, the story) of the first step (or the end) where ``w`` served
    with ``hooks`` differs from the library's run; ``None`` when it serves the same (in
    its first ``limit`` steps, when given)."""
    want, want_end = _library(w, limit)
    got, got_end = serve(w, hooks, want, limit)
    for k, (lib, mine) in enumerate(zip(want, got, strict=False)):
        if lib != mine:
            if lib[0] != mine[0]:
                return k, (f"the library's engine ran engine step {lib[0]} next; yours ran "
                           f"step {mine[0]}")
            parts = [f"{name}: the library's {a!r}, yours {b!r}"
                     for name, a, b in zip(_FIELDS, lib[1:], mine[1:], strict=True) if a != b]
            return k, f"at engine step {lib[0]}, " + "; ".join(parts)
    if isinstance(got_end, _Raised):
        return len(got), f"serving stopped with {got_end.what}"
    if want_end is None:  # both cut short at the limit, the same so far
        return None
    if len(got) != len(want):
        return min(len(got), len(want)), (f"the library's engine took {len(want)} steps "
                                          f"that ran something, yours {len(got)}")
    if got_end != want_end:
        return len(got), f"the outputs differ: the library's {want_end!r}, yours {got_end!r}"
    return None


def shrink(w: Workload, hooks: Any, found: tuple[int, str],
           max_runs: int = MAX_SHRINK_RUNS) -> tuple[Workload, str]:
    """The smallest workload found that still differs, and its difference. A candidate
    is served only as far as the difference found so far (a later one is no smaller).
    Requests, options and lengths first (:func:`candidates`), then the pool, with runs of
    its own: halved, cut by a quarter, by one block, while the difference stays."""
    for simpler, cap in ((candidates, max_runs), (_smaller_pools, POOL_SHRINK_RUNS)):
        runs, changed = 0, True
        while changed and runs < cap:
            changed = False
            for smaller in simpler(w):
                if runs >= cap:
                    break
                runs += 1
                if isinstance(_library(smaller, found[0] + 1)[1], _Raised):
                    continue  # options that do not combine, or a request the engine refuses
                again = difference(smaller, hooks, found[0] + 1)
                if again is not None:
                    w, found, changed = smaller, again, True
                    break
    return w, found[1]


def _smaller_pools(w: Workload):
    if w.num_blocks > 4:
        for n in sorted({max(4, w.num_blocks // 2), max(4, w.num_blocks * 3 // 4),
                         w.num_blocks - 1}):
            if n < w.num_blocks:
                yield dataclasses.replace(w, num_blocks=n)


# ------------------------------------------------------------------ the stage


def workloads(hook: str, count: int = NUM_WORKLOADS) -> list[Workload]:
    """The first ``count`` valid workloads drawn for ``hook`` (seeds 0, 1, ...)."""
    out, seed = [], 0
    while len(out) < count:
        w = draw(seed, hook)
        seed += 1
        if valid(w):
            out.append(w)
    return out


def find(hook: str, hooks: Any,
         count: int = NUM_WORKLOADS) -> tuple[Workload, Workload, str] | None:
    """Serve ``count`` random workloads drawn for ``hook`` with ``hooks`` (see
    :func:`_engine`) next to the library's; the first that differs as (the workload
    drawn, the workload it shrank to, what differs there), or ``None``."""
    with serving.one_thread():
        for w in workloads(hook, count):
            found = difference(w, hooks)
            if found is not None:
                drawn = set(_LIBRARY)
                small, story = shrink(w, hooks, found)
                for key in set(_LIBRARY) - drawn:  # the shrink's runs are not asked again;
                    del _LIBRARY[key]  # the drawn ones are, by the next check
                return w, small, story
    return None


def check(hook: str, piece: Any, hint: str, count: int = NUM_WORKLOADS,
          tell: Callable[[str, Workload], None] | None = None) -> None:
    """Serve ``count`` random workloads with ``piece`` as hook ``hook`` next to the
    library's; at the first that differs, shrink it and fail with its story and ``hint``
    (``tell(label, shrunk workload)``, when given, may fail first with a finer story)."""
    from paged_lib.engine import EngineHooks

    found = find(hook, EngineHooks(**{hook: piece}), count)
    if found is not None:
        drawn, small, story = found
        label = f"random workload {drawn.seed} for your {hook}, shrunk to {small.describe()}"
        if tell is not None:
            tell(label, small)
        grading.fail(f"{label}: {story}", hint)


def states(hook: str, count: int = NUM_WORKLOADS) -> dict[str, int]:
    """How often the library's runs of ``hook``'s workloads reach the states this stage
    is for (steps, preemptions, steps with several victims, swaps out and in, copies,
    prompt tokens from the prefix cache, admissions next to decodes, requests refused)."""
    seen = dict.fromkeys(("steps", "preempted", "several victims in one step", "swaps out",
                          "swaps in", "copy-on-write copies", "prefix-cache hit tokens",
                          "admitted next to decodes", "requests refused"), 0)
    for w in workloads(hook, count):
        steps, end = _library(w)
        for _, ran, admitted, preempted, out, back, copies, hits, _, _ in steps:
            for key, n in (("steps", 1), ("preempted", len(preempted)),
                           ("several victims in one step", len(preempted) > 1),
                           ("swaps out", bool(out)), ("swaps in", bool(back)),
                           ("copy-on-write copies", len(copies)),
                           ("prefix-cache hit tokens", hits),
                           ("admitted next to decodes",
                            bool(admitted) and any(r not in admitted for r, _, _ in ran))):
                seen[key] += n
        seen["requests refused"] += sum(error is not None for error, _ in end)
    return seen
