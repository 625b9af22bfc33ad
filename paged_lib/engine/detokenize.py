"""Text out of tokens, a token at a time: incremental detokenisation with stop strings.

One sequence's text is made here, for both of its readers: the engine, which ends the
sequence when a ``stop`` string appears (:class:`~paged_lib.engine.stop.StopStrings`, one
detokenizer kept beside each sequence), and the server, which streams the text while
tokens still arrive (:func:`paged_lib.serve.outputs.text_pieces`). vLLM v1 likewise keeps
one incremental detokenizer per request that both decodes and checks the stop strings
(``vllm/v1/engine/detokenizer.py``); its output processor finishes the request on a hit.

Two things make "decode each new token" wrong. A token is not a character: the tiny
model's tokens are UTF-8 *bytes* (and a byte-level BPE token may end half way through
one), so ``é`` is two tokens and an emoji four; sent one by one, the client would see
U+FFFD garbage. And a ``stop`` string may straddle tokens: by the time ``"\\n\\n"`` is
complete, its first ``"\\n"`` must not have been sent already. vLLM's answer, kept here:
decode a window of tokens, hold back an incomplete character, and hold back
``len(longest stop) - 1`` characters until they are decided (its output text buffer).
Each token's text is decoded once (the window restarts at every whole character), so a
generation of ``n`` tokens costs ``O(n)`` decoding, not ``O(n^2)``. When one ``add``
completes two stop strings, the one that *completes* first (ends earliest in the text) wins,
ties going to the first of the ``stop`` list: vLLM's ``check_stop_strings`` rule, so the
result is what adding one token at a time would give (``"abc"`` with stops ``["abc", "b"]``
stops at ``"b"``, the text ``"a"``).
"""

from __future__ import annotations

import copy
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
    * Stops: once the text contains a string of ``stop``, it ends just before the stop that
      completed first (ties: the first listed; the stop itself is left out), :attr:`stopped`
      names it, and later tokens are ignored. Until then the last ``len(longest stop) - 1``
      characters are held back: a stop may be starting there.
    * ``min_tokens`` (vLLM's rule): text made by the first ``min_tokens`` tokens is not
      searched; a stop must end in text of a later token (it may begin earlier).
    * :meth:`finish` (the sequence ended) returns everything still held.
    * :meth:`fork`: an independent copy, for a sequence that forks (the same tokens so
      far, different ones from now on).

    :attr:`text` is all the text decided so far, sent or held; :attr:`num_tokens` the
    tokens added.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Iterable[str] = (),
                 min_tokens: int = 0):
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.min_tokens = min_tokens
        self.text = ""
        self.sent = 0                # characters of text already returned
        self.stopped: str | None = None
        self.num_tokens = 0          # tokens added so far
        self._ids: list[int] = []    # tokens since the last complete character
        self._done = 0               # characters of decode(self._ids) already in text
        self._searched = 0           # characters of text already searched for stops

    def add(self, token_ids: Iterable[int]) -> str:
        """The text these tokens decide ("" while it is held back)."""
        if self.stopped is not None:
            return ""
        before = len(self._ids)
        self._ids += token_ids
        self.num_tokens += len(self._ids) - before
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

    def fork(self) -> IncrementalDetokenizer:
        """A copy that goes on alone: the text so far (sent and held) and the character
        still arriving are the same, and nothing one copy is given reaches the other."""
        twin = copy.copy(self)
        twin._ids = list(self._ids)
        return twin

    def _release(self, final: bool) -> str:
        # only a stop that ends in text not searched before: one that ended earlier was
        # found then (or lay in the min_tokens text, which vLLM never searches)
        found = []
        if self.num_tokens > self.min_tokens:  # (where it ends, its place in the list, ...)
            found = [(i + len(s), k, i, s) for k, s in enumerate(self.stop)
                     if (i := self.text.find(s, max(self.sent, self._searched - len(s) + 1))) >= 0]
        self._searched = len(self.text)
        if found:  # the first to complete; ties: the first listed (vLLM)
            _, _, end, self.stopped = min(found)
            self.text = self.text[:end]
        else:
            end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out
