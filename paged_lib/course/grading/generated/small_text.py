"""Generated inputs for 14.1 (streaming text with stop strings), on the harness of
:mod:`~paged_lib.course.grading.generated.numeric`: stops cut from the text itself (up to
four, of one to six characters, often one a prefix of another, so both start at one
index, listed in either order), one to eight tokens per ``add``, each run through the
grader's own per-case check, the first failure shrunk.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.generated.numeric import Contrast

__all__ = ["Stream", "stream_cases", "stream_stage"]

_ALPHABET = "ab é日🎉\n"


@dataclass(frozen=True)
class Stream:
    """One generated case of 14.1: ``text`` streamed ``per_add`` byte tokens at a time."""

    seed: int
    text: str
    stops: tuple[str, ...]
    per_add: int

    def tie(self) -> tuple[str, str] | None:
        """Two stops that begin at the earliest stop's index (the first listed first)."""
        found = [(self.text.find(s), k) for k, s in enumerate(self.stops)
                 if s and s in self.text]
        if not found:
            return None
        first = min(i for i, _ in found)
        at = [self.stops[k] for i, k in found if i == first]
        return (at[0], at[1]) if len(at) > 1 else None

    def describe(self) -> str:
        tie = self.tie()
        return (f"text {self.text!r}, stop={list(self.stops)}, {self.per_add} token(s) per "
                "add" + (f" ({tie[0]!r} and {tie[1]!r} both start at the earliest stop's "
                         f"index; {tie[0]!r} is listed first)" if tie else ""))

    def states(self) -> list[str]:
        tie = self.tie()
        out = ["a tie, the shorter stop listed first"] if tie and len(tie[0]) < len(
            tie[1]) else []
        out += ["a tie"] if tie else []
        out += [f"{len(self.stops)} stops"] if len(self.stops) > 2 else []
        out += ["a stop of 4 or more characters"] if any(len(s) > 3 for s in self.stops) \
            else []
        out += [f"{self.per_add} tokens per add"] if self.per_add > 3 else []
        return out

    def smaller(self) -> Iterator[Stream]:
        for k in range(len(self.stops)):
            yield dataclasses.replace(self, stops=self.stops[:k] + self.stops[k + 1:])
        n = len(self.text)
        for a, b in ((0, n // 2), (n // 2, n), (0, 1), (n - 1, n)):
            if 0 <= a < b <= n and b - a < n:
                yield dataclasses.replace(self, text=self.text[:a] + self.text[b:])
        yield from numeric.fewer(self, per_add=[1] if self.per_add > 1 else [])


def _draw(seed: int) -> Stream:
    rng = random.Random(1401 + seed)
    text = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(3, 16)))
    stops: list[str] = []
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(text))
        stops.append(text[i:i + rng.randint(1, 6)])
    if seed % 6 == 1:  # no stop, or one that never comes (no x in the text)
        stops = [] if seed % 12 == 1 else [stops[0] + "x"]
    if seed % 6 == 5:  # an empty stop is ignored
        stops.insert(0, "")
    if seed % 2 == 0:  # a stop and a longer one that it begins: both start at one index
        base = min(stops, key=text.find)
        i = text.find(base)
        longer = text[i:i + len(base) + rng.randint(1, 3)]
        pair = [base, longer] if seed % 4 == 0 else [longer, base]
        stops = [s for s in stops if s not in pair] + pair
        rng.shuffle(stops) if seed % 3 == 0 else None
    return Stream(seed, text, tuple(dict.fromkeys(stops)), rng.choice([1, 2, 3, 4, 5, 8]))


def stream_cases(count: int = 60) -> list[Stream]:
    return [_draw(seed) for seed in range(count)]


def _longer_first(p: Stream) -> Stream | None:
    tie = p.tie()
    if tie is None or len(tie[0]) >= len(tie[1]):
        return None
    stops = list(p.stops)
    i, j = stops.index(tie[0]), stops.index(tie[1])
    stops[i], stops[j] = stops[j], stops[i]
    return dataclasses.replace(p, stops=tuple(stops))


STREAM_CONTRASTS = (
    Contrast(_longer_first,
             "it passes when the longer of two stops at the same index is listed first and "
             "fails when the shorter is: the one listed first in stop wins, whatever its "
             "length (vLLM takes the first of its list)"),
)


def stream_stage(cls: type, run_case: Callable) -> None:
    """14.1's generated stage; ``run_case(cls, text, stops, per_add)``: the grader's own
    per-case check."""
    numeric.check("14.1", stream_cases(), lambda p: run_case(
        cls, p.text, list(p.stops), p.per_add), STREAM_CONTRASTS)
