"""Exercise 14.1: an incremental detokenizer with stop strings, ``cls(decode, stop=())``
with ``add(token_ids) -> str``, ``finish() -> str``, ``text`` and ``stopped`` (the
behaviour of :class:`paged_lib.serve.detokenize.IncrementalDetokenizer`).

Tokens are the tiny model's bytes, so é is two tokens, 日 three, 🎉 four. Generated cases
(:class:`Stream`: stops cut from the text itself, up to four, often one a prefix of
another, listed in either order; one to eight tokens per ``add``) run through
:func:`_run_case`: after every ``add`` the text sent must be what is decided (the text cut
before the stop that completes first, ties to the first listed, as vLLM's
``check_stop_strings``; else all but the last ``len(longest stop) - 1`` characters), and a
wrong piece is named by its mistake; the first failing case is shrunk.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.generated.numeric import Contrast, fewer
from paged_lib.serve.detokenize import IncrementalDetokenizer
from paged_lib.tokenizer import ByteTokenizer

__all__ = ["EQUIVALENT_MUTANTS", "STREAM_CONTRASTS", "Stream", "check_detokenizer",
           "stream_cases"]

#: Mutants of the solution that cannot change any graded answer (tools/mutants.py skips
#: them). The check streams the bytes of whole UTF-8 texts and reads ``text`` and
#: ``stopped`` after ``finish()`` only, as the spec says.
EQUIVALENT_MUTANTS: dict[str, dict[str, str]] = {"14.1": {
    "drop: `if self.stopped is not None:` -> `pass`":
    "after a stop, the text decoded again still holds the same first stop at the same "
    "place, so the text is cut at the same end and the piece from `sent` to it is empty",
    "drop: `self.text = ''` -> `pass` in `self.text = \"\"`":
    "add() and finish() set text before anything reads it",
    "drop: `self.text = self.decode(self.ids)` -> `pass`":
    "the last add() decoded the same ids; only a character still arriving at the end "
    "(trailing U+FFFD) would differ, and the checked streams end on whole characters",
}}


_TOK = ByteTokenizer()

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
        yield from fewer(self, per_add=[1] if self.per_add > 1 else [])


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


def _cut(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """The text up to the stop that completes first, and which stop (ties: the first
    listed). On the whole text this is what an incremental search finds: a stop that
    completed in an earlier add would have ended the text there."""
    found = [(i + len(s), k, i, s) for k, s in enumerate(stops) if s and (i := text.find(s)) >= 0]
    if not found:
        return text, None
    _, _, i, s = min(found)
    return text[:i], s


def _decided(data: bytes, stops: Sequence[str]) -> tuple[str, str | None]:
    """What may be released once ``data`` arrived, and the stop if one has appeared."""
    text = data.decode("utf-8", "ignore")
    cut, stop = _cut(text, stops)
    if stop is not None:
        return cut, stop
    hold = max((len(s) for s in stops if s), default=1) - 1
    return text[:max(0, len(text) - hold)], None


def _describe(got: str, want: str, text: str, stops: Sequence[str], sofar: bytes,
              final: bool) -> str:
    """A hint naming the mistake that turns ``want`` into ``got``."""
    hold = max((len(s) for s in stops if s), default=1) - 1
    whole = sofar.decode("utf-8", "ignore")
    cut, stop = _cut(whole if not final else text, stops)
    if "\ufffd" in got:
        return ("half a character went out as U+FFFD: a byte token can end half way "
                "through a character; keep the incomplete tail (decoded as U+FFFD) until "
                "its other bytes arrive")
    other = next((s for s in stops if s and s != stop and s in whole
                  and got == whole[:whole.find(s)]), None) if stop is not None else None
    if other is not None:
        return _stopped_hint(other, stop, whole, stops)
    if stop is not None and got.startswith(cut + stop):
        return "the stop string itself was sent: cut the text just before the stop"
    if stop is not None and got.startswith(cut) and len(got) > len(cut):
        return ("text after a stop string was sent: once a stop appears, the text ends "
                "before it and later tokens are ignored")
    if stop is None and not final and got.startswith(want) and len(got) > len(want):
        return (f"no hold-back: text that may begin a stop string was sent before it was "
                f"decided; hold back the last len(longest stop) - 1 = {hold} characters")
    if final and want.startswith(got):
        return "finish must return everything still held back (no stop came)"
    if want.startswith(got) and not final and stop is None:
        if not stops:
            return ("text held back with no stop strings: each character goes out as "
                    "soon as its bytes are all there")
        return (f"too much held back: only the last len(longest stop) - 1 = {hold} "
                "characters may still become a stop")
    return "compare the released text with the spec: whole characters, cut at the stop"


def _run_case(cls: Any, text: str, stops: list[str], per_add: int) -> None:
    data = text.encode()
    det = cls(_TOK.decode, stops)
    out, ended, stop = "", None, None
    for k in range(0, len(data), per_add):
        chunk = list(data[k:k + per_add])
        piece = det.add(chunk)
        grading.expect_true(isinstance(piece, str), f"add returned {piece!r}, not a str",
                            "add returns the newly decided text, '' when none")
        out += piece
        if ended is None:
            want, stop = _decided(data[:k + per_add], stops)
            ended = want if stop is not None else None
        if out != want:
            grading.fail(f"after {k + len(chunk)} tokens the text sent is {out!r}, expected "
                         f"{want!r}", _describe(out, want, text, stops, data[:k + per_add],
                                                False))
    last = det.finish()
    grading.expect_true(isinstance(last, str), f"finish returned {last!r}, not a str",
                        "finish returns the text still held ('' when none)")
    out += last
    want = ended if ended is not None else text
    if out != want:
        grading.fail(f"after finish the text sent is {out!r}, expected {want!r}",
                     _describe(out, want, text, stops, data, True))
    grading.expect_equal(det.stopped, stop, "stopped",
                         _stopped_hint(det.stopped, stop, text, stops))
    grading.expect_equal(det.text, want, "the text attribute",
                         "text is all the text decided, cut before the stop")
    grading.expect_equal((det.add(list(b"more")), det.finish()) if stop else ("", ""),
                         ("", ""), "add and finish after the stop",
                         "after a stop, the sequence is over: add and finish return ''")


def _stopped_hint(got: Any, want: str | None, text: str, stops: Sequence[str]) -> str:
    """Why ``stopped`` is ``got`` and not ``want``, when both are stops found in ``text``."""
    if want is None or got not in stops or got == want or text.find(got) < 0:
        return "stopped names the stop string that ended the text (None if none)"
    got_end, want_end = text.find(got) + len(got), text.find(want) + len(want)
    if got_end == want_end:
        return ("two stops complete at the same character: the one listed first in stop "
                "wins, not the longer, nor the one that starts first (vLLM's "
                "check_stop_strings)")
    return (f"{want!r} completes before {got!r} (it ends earlier in the text): the text "
            "ends before the stop that *completes* first, not the first of the list found, "
            "nor the one that starts first (vLLM's check_stop_strings)")


def check_detokenizer(cls: Any) -> None:
    """``cls``: the learner's class, ``cls(decode, stop)`` with ``add`` and ``finish``."""
    with grading.exercise("14.1"):
        grading.expect_true(isinstance(cls, type), f"expected a class, got {cls!r}",
                            "pass the class itself (check_detokenizer(MyDetokenizer)), not "
                            "an instance")
        for name in ("add", "finish"):
            grading.expect_true(
                not (issubclass(cls, IncrementalDetokenizer)
                     and getattr(cls, name) is getattr(IncrementalDetokenizer, name)),
                f"your class inherits the library's IncrementalDetokenizer.{name}",
                f"define {name} in your own class: that is the exercise")
        numeric.check("14.1", stream_cases(), lambda p: _run_case(
            cls, p.text, list(p.stops), p.per_add), STREAM_CONTRASTS)
