"""Chapter 13: how a run of a scenario with the learner's pieces differs from the
library's, in one sentence (:func:`difference`): the first step whose schedule differs
(who ran, how many tokens, into which blocks; preemptions, swaps, copies, prefix-cache
hits, blocks in use), else the first token, else a log-probability."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Served:
    tokens: list[list[list[int]]]                     # request -> completion -> tokens
    steps: list[dict] = field(default_factory=list)   # one record per engine step
    logprobs: list[list[float]] = field(default_factory=list)  # cumulative, per completion


def _one(entry: tuple | None) -> str:
    if entry is None:
        return "did not run it"
    _, _, n, kind, blocks = entry
    where = f" into block{'s' if len(set(blocks)) > 1 else ''} " \
        f"{', '.join(map(str, sorted(set(blocks))))}" if blocks else ""
    return f"ran a {kind} of {n} token{'s' if n > 1 else ''}{where}"


def _ran(want: list, got: list) -> str:
    """The first sequence the two steps ran differently."""
    w, g = ({(e[0], e[1]): e for e in x} for x in (want, got))
    for key in [*w, *(k for k in g if k not in w)]:
        if w.get(key) != g.get(key):
            return (f"request {key[0]} (sequence {key[1]}): the library "
                    f"{_one(w.get(key))}, yours {_one(g.get(key))}")
    return (f"the batch's order of (request, sequence): the library's {list(w)}, "
            f"yours {list(g)}")


def difference(want: Served, got: Served, numeric: bool = False) -> str | None:
    """The first difference between two runs of one scenario, in a sentence (None: same);
    ``numeric``: the completions' log-probabilities too (the K/V the model read)."""
    for i, (w, g) in enumerate(zip(want.steps, got.steps, strict=False)):
        for key in w:
            if w[key] != g[key]:
                if key == "ran":
                    return f"at engine step {i}, {_ran(w[key], g[key])}"
                return (f"at engine step {i}, {key}: the library's {w[key]!r}, "
                        f"yours {g[key]!r}")
    if len(want.steps) != len(got.steps):
        return f"the library took {len(want.steps)} steps, yours {len(got.steps)}"
    for r, (w, g) in enumerate(zip(want.tokens, got.tokens, strict=True)):
        for k, (wt, gt) in enumerate(zip(w, g, strict=False)):
            if wt != gt:
                at = next((j for j, (x, y) in enumerate(zip(wt, gt, strict=False)) if x != y),
                          min(len(wt), len(gt)))
                return (f"request {r} completion {k}: token {at} is "
                        f"{wt[at] if at < len(wt) else 'the end'} with the library's "
                        f"pieces, {gt[at] if at < len(gt) else 'the end'} with yours")
        if len(w) != len(g):
            return f"request {r}: the library returns {len(w)} completions, yours {len(g)}"
    for r, (w, g) in enumerate(zip(want.logprobs, got.logprobs, strict=True) if numeric
                               else ()):
        for k, (x, y) in enumerate(zip(w, g, strict=True)):
            if not abs(x - y) <= 1e-5:
                return (f"request {r} completion {k}: the same tokens, but log-probability "
                        f"{x:.6f} with the library's pieces, {y:.6f} with yours (the "
                        "model read other K/V values)")
    return None


class PieceDiffers(ValueError):
    """A piece answered one call otherwise than the library's twin (told in its words)."""
