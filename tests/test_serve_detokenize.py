"""Streaming text: whole characters only, stop strings held back until decided, cut out.

The tokens are bytes (the tiny model's ByteTokenizer), so é is two tokens, 日 three and 🎉
four. Every check also runs on two planted bugs (no hold-back; a character split by
sending what decodes so far) to show that the checks catch them.
"""

import inspect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_lib.engine import detokenize  # (the server's is the engine's: planted bugs go there)
from paged_lib.serve.detokenize import IncrementalDetokenizer
from paged_lib.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
TEXTS = ["café au lait", "naïve 日本語 text", "emoji 🎉 ok", "ÀÉÎÕÜ", "a😀b𝄞c"]


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_bos=False)


def run(cls, tokens: list[int], stop=(), per_add: int = 1) -> tuple[list[str], object]:
    """Feed ``tokens`` ``per_add`` at a time, then finish; the pieces (finish's last)."""
    det = cls(TOK.decode, stop)
    pieces = [det.add(tokens[i:i + per_add]) for i in range(0, len(tokens), per_add)]
    return pieces + [det.finish()], det


def cut(text: str, stops) -> str:
    """The text a stream must give: up to the stop string that completes first (ties: the
    first listed, vLLM's rule)."""
    at = [(i + len(s), k, i) for k, s in enumerate(stops) if s and (i := text.find(s)) >= 0]
    return text[:min(at)[2]] if at else text


# ---------------------------------------------------------------- the checks (also on mutants)

def check_characters_whole_and_prompt(cls):
    """No piece holds half a character, and each character is out as soon as it is whole."""
    for text in TEXTS:
        data = text.encode()
        det, out = cls(TOK.decode), ""
        for k, t in enumerate(data, start=1):
            piece = det.add([t])
            assert "\ufffd" not in piece, (text, k, piece)
            out += piece
            assert out == data[:k].decode("utf-8", "ignore"), (text, k, out)
        assert out + det.finish() == text


def check_stop_straddling_tokens(cls):
    """A stop whose first character arrives a token before its last is never sent."""
    for text, stop, want in [("abc\n\ndef", "\n\n", "abc"), ("x = 1\nreturn x", "\nret", "x = 1"),
                             ("go 日本 now", "本 n", "go 日"), ("wait 🎉🎉 now", "🎉🎉", "wait ")]:
        pieces, det = run(cls, ids(text), [stop])
        assert "".join(pieces) == want, (text, stop, pieces)
        assert det.stopped == stop


def check_stops_random(cls):
    """Random texts, stops and token chunks: the pieces join to the text cut at the stop."""
    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(st.text(alphabet="ab é日🎉\n", max_size=14),
           st.lists(st.text(alphabet="ab é日🎉\n", min_size=1, max_size=3), max_size=2),
           st.integers(1, 3))
    def prop(text, stops, per_add):
        pieces, det = run(cls, ids(text), stops, per_add)
        assert "".join(pieces) == cut(text, stops)
        assert all("\ufffd" not in p for p in pieces)
    prop()


CHECKS = [check_characters_whole_and_prompt, check_stop_straddling_tokens, check_stops_random]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_detokenizer_passes(check):
    check(IncrementalDetokenizer)


# ---------------------------------------------------------------- planted bugs

MUTANTS = {
    "no hold-back": ("self.hold = max((len(s) for s in self.stop), default=1) - 1",
                     "self.hold = 0"),
    "splits a character": ("complete = piece.rstrip(REPLACEMENT)", "complete = piece"),
}


def mutant(name: str) -> type:
    old, new = MUTANTS[name]
    source = inspect.getsource(detokenize)
    assert source.count(old) == 1, f"the line the mutant {name!r} changes is gone"
    namespace: dict = {}
    exec(compile(source.replace(old, new), "<mutant>", "exec"), namespace)  # noqa: S102
    return namespace["IncrementalDetokenizer"]


@pytest.mark.parametrize("name", MUTANTS)
def test_the_checks_catch_a_planted_bug(name):
    caught = []
    for check in CHECKS:
        try:
            check(mutant(name))
        except AssertionError:
            caught.append(check.__name__)
    assert caught, f"no check caught the mutant {name!r}"


# ---------------------------------------------------------------- the rest of the spec

def test_the_stop_that_completes_first_wins_and_the_rest_is_ignored():
    det = IncrementalDetokenizer(TOK.decode, ["world", "o w"])
    out = det.add(ids("hello world, more"))
    assert out == "hell" and det.stopped == "o w"
    assert det.add(ids("anything")) == "" and det.finish() == ""
    det = IncrementalDetokenizer(TOK.decode, ["lo wo", "o w"])  # both start at "o"...
    assert det.add(ids("hello world")) == "hell" and det.stopped == "o w"  # ...this ends first
    det = IncrementalDetokenizer(TOK.decode, ["hello w", "o w"])  # starts later, ends together
    assert det.add(ids("hello world")) == "" and det.stopped == "hello w"  # the first listed


def test_held_back_text_comes_out_at_finish():
    pieces, det = run(IncrementalDetokenizer, ids("abc"), ["zz"])
    assert pieces == ["", "a", "b", "c"] and det.stopped is None


def test_an_unfinished_character_ends_as_a_replacement():
    det = IncrementalDetokenizer(TOK.decode)
    assert det.add(ids("é")[:1]) == ""
    assert det.finish() == "\ufffd"


def test_invalid_bytes_are_sent_once_text_follows():
    det = IncrementalDetokenizer(TOK.decode)
    assert det.add([0xFF]) == ""  # might still be the start of something
    assert det.add([ord("a")]) == "\ufffda"


def test_special_tokens_add_nothing():
    det = IncrementalDetokenizer(TOK.decode, ["x"])
    assert det.add([TOK.eos_id]) == "" and det.finish() == ""


def test_tokens_of_several_bytes_split_mid_character():
    """A byte-level BPE token may end half way through a character."""
    vocab = {0: b"caf", 1: b"\xc3", 2: b"\xa9 \xe6", 3: b"\x97\xa5", 4: b"!"}

    def decode(tokens):
        return b"".join(vocab[t] for t in tokens).decode("utf-8", errors="replace")

    det = IncrementalDetokenizer(decode)
    assert [det.add([t]) for t in range(5)] == ["caf", "", "é ", "日", "!"]
