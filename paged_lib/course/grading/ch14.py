"""Exercise 14.1: an incremental detokenizer with stop strings, ``cls(decode, stop=())``
with ``add(token_ids) -> str``, ``finish() -> str``, ``text`` and ``stopped`` (as
:class:`paged_lib.serve.detokenize.IncrementalDetokenizer`), on generated streams of the tiny
model's byte tokens (:class:`Stream`). After every ``add`` the text sent must be what is
decided: cut before the stop that completes first (ties: the first listed, as vLLM's
``check_stop_strings``), else all but the last ``len(longest stop) - 1`` characters.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.generated.numeric import fewer
from paged_lib.serve.detokenize import IncrementalDetokenizer
from paged_lib.tokenizer import ByteTokenizer

__all__ = ["EQUIVALENT_MUTANTS", "check_detokenizer", "stream_cases"]

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


@dataclass(frozen=True)
class Stream:
    """One generated case of 14.1: ``text`` streamed ``per_add`` byte tokens at a time."""

    seed: int
    text: str
    stops: tuple[str, ...]
    per_add: int

    def tie(self) -> tuple[str, str] | None:
        """Two stops that begin at the earliest stop's index (the first listed first)."""
        found = [(self.text.find(s), s) for s in self.stops if s and s in self.text]
        at = [s for i, s in found if i == min(found)[0]] if found else []
        return (at[0], at[1]) if len(at) > 1 else None

    def describe(self) -> str:
        tie = self.tie()
        return (f"text {self.text!r}, stop={list(self.stops)}, {self.per_add} token(s) per "
                "add" + (f" ({tie[0]!r} and {tie[1]!r} both start at the earliest stop's "
                         f"index; {tie[0]!r} is listed first)" if tie else ""))

    def states(self) -> list[str]:
        tie = self.tie()
        return (["a tie, the shorter stop listed first"] * bool(tie and len(tie[0]) <
                                                                 len(tie[1]))
                + ["a tie"] * bool(tie) + [f"{len(self.stops)} stops"] * (len(self.stops) > 2)
                + ["a stop of 4 or more characters"] * any(len(s) > 3 for s in self.stops)
                + [f"{self.per_add} tokens per add"] * (self.per_add > 3))

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
    text = "".join(rng.choice("ab é日🎉\n") for _ in range(rng.randint(3, 16)))
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


def _cut(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """The text up to the stop that completes first, and which stop (ties: the first
    listed)."""
    found = [(i + len(s), k, i, s) for k, s in enumerate(stops) if s and (i := text.find(s)) >= 0]
    return (text[:min(found)[2]], min(found)[3]) if found else (text, None)


def _hold(stops: Sequence[str]) -> int:
    return max((len(s) for s in stops if s), default=1) - 1


def _loses(cls: Any) -> bool:
    """Does ``cls``, sent "é日x" a byte at a time (stop "x"), lose or garble "é日"?"""
    try:
        det = cls(_TOK.decode, ["x"])
        return "".join([det.add([b]) for b in "é日x".encode()] + [det.finish()])[:2] != "é日"
    except Exception:  # noqa: BLE001 - the learner's class: the other hints then
        return False


def _describe(got: str, want: str, text: str, stops: Sequence[str], sofar: bytes,
              final: bool, det: Any) -> str:
    """A hint naming the mistake that turns ``want`` into ``got``."""
    whole = sofar.decode("utf-8", "ignore")
    cut, stop = _cut(whole if not final else text, stops)
    other = next((s for s in stops if s and s != stop and s in whole
                  and got == whole[:whole.find(s)]), None) if stop is not None else None
    for wrong, hint in [
        (getattr(det, "stopped", None) == "", "an empty stop string is ignored (\"\" is in "
         "every text, it would stop at once): stop only on the non-empty ones"),
        ("\ufffd" in got or _loses(type(det)), "a character whose bytes came in different adds "
         "went out as U+FFFD or was lost: decode all the ids since the last whole character "
         "together, and keep an incomplete tail (U+FFFD) until its other bytes arrive"),
        (other is not None, _stopped_hint(other, stop, whole, stops)),
        (stop is not None and got == whole[:whole.rfind(stop)] != cut, "the text was cut at "
         "the stop's last occurrence (rfind): it ends before its first (str.find)"),
        (stop is not None and got.startswith(cut + stop),
         "the stop string itself was sent: cut the text just before the stop"),
        (stop is not None and got.startswith(cut) and len(got) > len(cut), f"part of the stop "
         f"{stop!r} was sent: it was missed when it completed; search the held-back text too "
         "(a stop can straddle adds)"),
        (stop is None and not final and got.startswith(want) and len(got) > len(want),
         f"held back too little: text that may begin a stop went out undecided; hold back the "
         f"last len(longest stop) - 1 = {_hold(stops)} characters (characters, not tokens; the "
         "longest stop, not the shortest)"),
        (final and (want.startswith(got) or got.endswith(want)), "finish must return "
         "everything still held back, and nothing already sent"),
        (want.startswith(got) and stop is None and not stops, "text held back with no stop "
         "strings: each character goes out as soon as its bytes are all there"),
        (want.startswith(got) and stop is None, f"too much held back: only the last "
         f"len(longest stop) - 1 = {_hold(stops)} characters may still become a stop")]:
        if wrong:
            return hint
    return "compare the released text with the spec: whole characters, cut at the stop"


def _run_case(cls: Any, text: str, stops: list[str], per_add: int) -> None:
    data = text.encode()
    det = cls(_TOK.decode, stops)
    out, ended, stop = "", None, None
    for k in range(0, len(data), per_add):
        piece = det.add(list(data[k:k + per_add]))
        grading.expect_true(isinstance(piece, str), f"add returned {piece!r}, not a str",
                            "add returns the newly decided text, '' when none")
        out += piece
        if ended is None:
            sofar = data[:k + per_add].decode("utf-8", "ignore")
            want, stop = _cut(sofar, stops)
            want, ended = (want, want) if stop else (sofar[:max(0, len(sofar) -
                                                                 _hold(stops))], None)
        if out != want:
            grading.fail(f"after {min(k + per_add, len(data))} tokens the text sent is "
                         f"{out!r}, expected {want!r}",
                         _describe(out, want, text, stops, data[:k + per_add], False, det))
    last = det.finish()
    grading.expect_true(isinstance(last, str), f"finish returned {last!r}, not a str",
                        "finish returns the text still held ('' when none)")
    out += last
    want = ended if ended is not None else text
    if out != want:
        grading.fail(f"after finish the text sent is {out!r}, expected {want!r}",
                     _describe(out, want, text, stops, data, True, det))
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
    if text.find(got) + len(got) == text.find(want) + len(want):
        return ("two stops complete at the same character: the one listed first in stop "
                "wins, not the longer, nor the one that starts first")
    return (f"{want!r} completes before {got!r}: the text ends before the stop that "
            "*completes* first, not the first of the list found, nor the one that starts "
            "first (vLLM's check_stop_strings)")


def check_detokenizer(cls: Any) -> None:
    """``cls``: the learner's class, ``cls(decode, stop)`` with ``add`` and ``finish``."""
    with grading.exercise("14.1"):
        grading.expect_true(isinstance(cls, type), f"expected a class, got {cls!r}",
                            "pass the class itself, not an instance")
        for name in ("add", "finish"):
            grading.expect_true(getattr(cls, name, None) is not getattr(IncrementalDetokenizer,
                                                                        name),
                                f"your class inherits the library's IncrementalDetokenizer."
                                f"{name}", f"define {name} in your own class: that is the exercise")
        numeric.check("14.1", stream_cases(), lambda p: _run_case(
            cls, p.text, list(p.stops), p.per_add))
