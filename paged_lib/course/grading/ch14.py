"""Exercise 14.1: an incremental detokenizer with stop strings, ``cls(decode, stop=())``
with ``add(token_ids) -> str``, ``finish() -> str``, ``text`` and ``stopped`` (the
behaviour of :class:`paged_lib.serve.detokenize.IncrementalDetokenizer`).

Tokens are the tiny model's bytes, so é is two tokens, 日 three, 🎉 four. Generated cases
(:mod:`~paged_lib.course.grading.generated.small_text`) run through :func:`_run_case`:
after every ``add`` the text sent must be what is decided, computed
here from the bytes (the text cut before the stop that completes first, ties to the
first listed, as vLLM's ``check_stop_strings``; else all but the last
``len(longest stop) - 1`` characters), and a wrong piece is matched to its mistake.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from paged_lib.course import grading
from paged_lib.course.grading.generated import small_text
from paged_lib.serve.detokenize import IncrementalDetokenizer
from paged_lib.tokenizer import ByteTokenizer

__all__ = ["check_detokenizer", "run_demo"]


_TOK = ByteTokenizer()

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
        small_text.stream_stage(cls, _run_case)


def run_demo(cls: Any, prompt: str = "def add(a, b):", max_tokens: int = 60,
             stop: Sequence[str] = ("string",)) -> None:
    """Stream the tiny model's greedy answer through the learner's class, a token at a
    time, and print each piece the client would get (in brackets) and why it ended."""

    def run() -> None:
        from paged_lib.engine import LLMEngine, SamplingParams
        from paged_lib.model import load_tiny_code_llama

        engine = LLMEngine(load_tiny_code_llama(), 64, 16)
        out = engine.generate([_TOK.encode(prompt)],
                              SamplingParams(max_tokens=max_tokens, temperature=0.0))
        det = cls(_TOK.decode, list(stop))
        pieces = [det.add([t]) for t in out[0].outputs[0].token_ids]
        pieces.append(det.finish())
        print(f"{sum(1 for p in pieces if p)} pieces from "
              f"{len(out[0].outputs[0].token_ids)} tokens:")
        print("".join(f"[{p}]" for p in pieces if p))
        print(f"stopped at {det.stopped!r}")

    grading.on_learner_code(run, "exercise 14.1", "the streaming demo")
