"""Streaming text out of tokens: incremental detokenisation with stop strings.

A server streams text while tokens still arrive, and two things make "decode each new
token" wrong. A token is not a character: the tiny model's tokens are UTF-8 *bytes* (and
a byte-level BPE token may end half way through one), so ``é`` is two tokens and an emoji
four; sent one by one, the client would see U+FFFD garbage. And a ``stop`` string may
straddle tokens: by the time ``"\\n\\n"`` is complete, its first ``"\\n"`` must not have
been sent already. vLLM's answer, kept here: decode a window of tokens, hold back an
incomplete character, and hold back ``len(longest stop) - 1`` characters until they are
decided (its output text buffer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

#: what a decoder shows for an incomplete (or invalid) UTF-8 sequence
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """One sequence's tokens in, text pieces safe to stream out.

    ``decode(ids) -> str`` is the tokenizer's (special tokens skipped, an incomplete UTF-8
    sequence shown as U+FFFD, as :meth:`ByteTokenizer.decode` does). Behaviour:

    * :meth:`add` takes the next tokens and returns the text they decide (often ``""``).
      Joined, the pieces are the decoded text, cut before the first stop string.
    * Never half a character: decoded text that ends in U+FFFD may be a character still
      arriving, so that tail waits for the next tokens (or :meth:`finish`).
    * Stops: once the text contains a string of ``stop``, it ends just before the earliest
      occurrence (the stop itself is left out), :attr:`stopped` names it, and later tokens
      are ignored. Until then the last ``len(longest stop) - 1`` characters are held back:
      a stop may be starting there.
    * :meth:`finish` (the sequence ended) returns everything still held.

    :attr:`text` is all the text decided so far, sent or held.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Iterable[str] = ()):
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0                # characters of text already returned
        self.stopped: str | None = None
        self._ids: list[int] = []    # tokens since the last complete character
        self._done = 0               # characters of decode(self._ids) already in text

    def add(self, token_ids: Iterable[int]) -> str:
        """The text these tokens decide ("" while it is held back)."""
        if self.stopped is not None:
            return ""
        self._ids += token_ids
        piece = self.decode(self._ids)
        complete = piece.rstrip(REPLACEMENT)  # a character may still be arriving
        self.text += complete[self._done:]
        self._done = len(complete)
        if complete == piece:  # at a character boundary: start a new window
            self._ids, self._done = [], 0
        return self._release(final=False)

    def finish(self) -> str:
        """Everything still held (an incomplete character stays U+FFFD)."""
        if self.stopped is not None:
            return ""
        self.text += self.decode(self._ids)[self._done:]
        self._ids, self._done = [], 0
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        # a stop not found before starts at or after `sent`: held-back text covers it
        found = [(i, s) for s in self.stop if (i := self.text.find(s, self.sent)) >= 0]
        if found:
            end, self.stopped = min(found, key=lambda f: f[0])
            self.text = self.text[:end]
        else:
            end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out
