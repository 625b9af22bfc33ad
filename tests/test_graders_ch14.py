"""Chapter 14's grader (14.1, the incremental detokenizer with stop strings) against typical
wrong answers: each gets ❌ with a hint naming the mistake; a right answer written
differently from the library's gets ✅."""

from __future__ import annotations

import pytest

from paged_lib.course.demos import your_serving
from paged_lib.course.grading import ch14
from paged_lib.serve.detokenize import IncrementalDetokenizer


class Det:
    """An answer that decodes all its tokens every time (not the library's window); each
    flag plants one typical mistake."""

    SPLIT = NO_HOLD = KEEP_STOP = LIST_ORDER = NO_FLUSH = HOLD_ONE_MORE = False
    HOLD_WITHOUT_STOPS = START_ORDER = LAST_AT_TIE = RFIND = PER_ADD = NEW_ONLY = False
    HOLD_SHORTEST = HOLD_TOKENS = KEEP_EMPTY = FINISH_ALL = False

    def __init__(self, decode, stop=()):
        self.decode, self.stop = decode, [s for s in stop if s or self.KEEP_EMPTY]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        if self.HOLD_ONE_MORE and self.stop:
            self.hold += 1
        if self.HOLD_WITHOUT_STOPS and not self.stop:
            self.hold = 1
        if self.HOLD_SHORTEST and self.stop:
            self.hold = min(len(s) for s in self.stop) - 1
        self.ids, self.sent, self.text, self.stopped = [], 0, "", None

    def add(self, token_ids):
        if self.stopped is not None:
            return ""
        self.ids += list(token_ids)
        self.new = len(self.text)
        if self.PER_ADD:  # each add's tokens decoded alone, U+FFFD dropped
            self.text += self.decode(list(token_ids)).replace("\ufffd", "")
            return self._release(final=False)
        full = self.decode(self.ids)
        self.text = full if self.SPLIT else full.rstrip("\ufffd")
        return self._release(final=False)

    def finish(self):
        if self.stopped is not None:
            return ""
        self.new = len(self.text)
        self.text = self.text if self.PER_ADD else self.decode(self.ids)
        if self.FINISH_ALL:  # the whole text, what was sent included
            return self._release(final=True) and self.text
        return "" if self.NO_FLUSH else self._release(final=True)

    def _release(self, final):
        look = self.text.rfind if self.RFIND else self.text.find
        start = self.new if self.NEW_ONLY else 0  # (only what this add brought)
        found = [(i, s) for s in self.stop if (i := look(s, start)) >= 0]
        if found:  # right: the first to complete, ties the first listed (vLLM)
            if self.LIST_ORDER:  # (vLLM before its check_stop_strings took completion)
                i, s = found[0]
            elif self.START_ORDER:
                i, s = min(found, key=lambda f: f[0])
            else:
                i, s = min(found[::-1] if self.LAST_AT_TIE else found,
                           key=lambda f: f[0] + len(f[1]))
            end = i + len(s) if self.KEEP_STOP else i
            self.stopped, self.text = s, self.text[:end]
        elif self.HOLD_TOKENS and not final:  # the last hold tokens held, not characters
            kept = self.ids[:len(self.ids) - self.hold] if self.hold else self.ids
            end = max(self.sent, len(self.decode(kept).rstrip("\ufffd")))
        else:
            end = len(self.text) if final or self.NO_HOLD \
                else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out


def _bug(**flags):
    return type("Wrong", (Det,), flags)


class Twin(IncrementalDetokenizer):
    """Delegates to the library."""

    def add(self, token_ids):
        return IncrementalDetokenizer.add(self, token_ids)

    def finish(self):
        return IncrementalDetokenizer.finish(self)


class Inherits(IncrementalDetokenizer):
    pass


def verdict(capsys, answer) -> str:
    ch14.check_detokenizer(answer)
    out = capsys.readouterr().out
    assert out.count("\n") <= 2, out  # one verdict line, at most one hint line
    return out


def test_a_right_answer_written_differently_passes(capsys):
    assert verdict(capsys, Det).startswith("✅ [14.1]")
    assert verdict(capsys, _bug()).startswith("✅ [14.1]")


@pytest.mark.parametrize("wrong, hint", [
    (_bug(SPLIT=True), "went out as U+FFFD or was lost"),
    (_bug(NO_HOLD=True), "held back too little"),
    (_bug(KEEP_STOP=True), "the stop string itself was sent"),
    (_bug(LIST_ORDER=True), "*completes* first"),
    (_bug(START_ORDER=True), "nor the one that starts first"),
    (_bug(NO_FLUSH=True), "finish must return everything still held back"),
    (_bug(HOLD_ONE_MORE=True), "too much held back"),
    (_bug(HOLD_WITHOUT_STOPS=True), "text held back with no stop strings"),
    (_bug(HOLD_SHORTEST=True), "the longest stop, not the shortest"),
    (_bug(HOLD_TOKENS=True), "characters (characters, not tokens"),
    (_bug(RFIND=True), "cut at the stop's last occurrence (rfind)"),
    (_bug(KEEP_EMPTY=True), "an empty stop string is ignored"),
    (_bug(FINISH_ALL=True), "and nothing already sent"),
    (_bug(PER_ADD=True), "went out as U+FFFD or was lost: decode all the ids since"),
    (_bug(NEW_ONLY=True), "was sent: it was missed when it completed; search the held-back"),
    (Inherits, "inherits the library's IncrementalDetokenizer.add"),
    (Twin, "write it yourself from the spec"),
    (Det(lambda ids: "", ()), "expected a class"),
], ids=["split-character", "no-hold-back", "stop-kept", "first-stop-in-list",
     "first-to-start", "no-flush",
        "holds-len-stop", "holds-without-stops", "holds-for-the-shortest-stop", "holds-tokens",
        "rfind", "an-empty-stop", "finish-sends-all",
        "decodes-each-add-alone", "searches-only-the-new-text", "inherits", "delegates",
        "an-instance"])
def test_14_1_wrong_answers_get_a_named_hint(capsys, wrong, hint):
    out = verdict(capsys, wrong)
    assert out.startswith("❌ [14.1]") and hint in out, out


def test_the_stub_is_not_attempted(capsys):
    class Stub:
        def __init__(self, decode, stop=()):
            raise NotImplementedError()

    assert verdict(capsys, Stub).startswith("⏳ [14.1]")


def test_the_demo_streams_through_the_learners_class(capsys):
    your_serving.chapter_14(Det)
    out = capsys.readouterr().out
    assert "stopped at 'string'" in out and "[R][e][t][u][r][n]" in out
    assert "pieces from" in out


def test_14_1_two_stops_completing_together_the_first_listed_wins(capsys):
    out = verdict(capsys, _bug(LAST_AT_TIE=True))
    assert out.startswith("❌ [14.1]") and "complete at the same character" in out, out
    assert "the one listed first in stop wins" in out, out
