"""From a request's token stream to OpenAI's choices: text pieces, logprobs, usage.

:func:`text_pieces` runs each choice's tokens through an
:class:`~paged_lib.serve.detokenize.IncrementalDetokenizer` (characters whole, stop strings
held back and cut; the engine's own, so a stream joins to the text the engine stops on)
and ends the request in the engine once stop strings have ended every choice, or when its
reader goes away (a closed connection): blocks are freed at once.
:class:`Choices` gathers the pieces into a whole answer, or shapes each as a stream chunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from paged_lib.engine.detokenize import IncrementalDetokenizer
from paged_lib.serve.async_engine import AsyncEngine, RequestStream


@dataclass
class Piece:
    """New text of choice ``index``, the tokens behind it and their logprobs; the last
    piece of a choice has ``finish_reason`` ("stop": EOS or a stop string, named in
    ``stop_reason``; "length": ``max_tokens``)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    stop_reason: str | None = None


async def text_pieces(engine: AsyncEngine, stream: RequestStream,
                      decode: Callable[[list[int]], str], stop: list[str]
                      ) -> AsyncIterator[Piece]:
    """The request's choices as text pieces, each yielded as soon as it is decided (text
    made within the request's ``min_tokens`` is not searched for stops, as the engine
    does)."""
    n = stream.params.n
    detoks = [IncrementalDetokenizer(decode, stop, stream.params.min_tokens)
              for _ in range(n)]
    held = [Piece(i, "", [], []) for i in range(n)]  # tokens whose text is not out yet
    ended = [False] * n
    reason = "abort"  # why the request ends, if this generator is left before its end
    try:
        async for deltas in stream:
            for d in deltas:
                if ended[d.index]:
                    continue  # cut by a stop string: the engine's further tokens are dropped
                det, piece = detoks[d.index], held[d.index]
                piece.token_ids += d.token_ids
                piece.logprobs += d.logprobs
                piece.text = det.add(d.token_ids)
                if det.stopped is not None:
                    piece.finish_reason, piece.stop_reason = "stop", det.stopped
                elif d.finish_reason is not None:
                    piece.text += det.finish()
                    piece.finish_reason = d.finish_reason
                if piece.text or piece.finish_reason:
                    ended[d.index] = piece.finish_reason is not None
                    held[d.index] = Piece(d.index, "", [], [])
                    yield piece
            if all(ended):
                reason = "stop"
                return
        reason = None  # the engine finished it
    finally:
        if reason is not None:  # stop strings ended it, or nobody reads it any more
            engine.abort(stream.request_id, reason)


@dataclass
class Choices:
    """The choices of one request, as OpenAI's completions (``chat=False``) or chat
    completions shape them."""

    n: int
    decode: Callable[[list[int]], str]
    token_bytes: Callable[[int], bytes]
    chat: bool
    logprobs: bool
    text: list[str] = field(init=False)
    pieces: list[list[Piece]] = field(init=False)

    def __post_init__(self):
        self.text = [""] * self.n
        self.pieces = [[] for _ in range(self.n)]

    def add(self, piece: Piece) -> dict:
        """Record ``piece``; returns its choice as a stream chunk shapes it."""
        offset = len(self.text[piece.index])
        self.text[piece.index] += piece.text
        self.pieces[piece.index].append(piece)
        lp = self._logprobs([piece], offset) if self.logprobs else None
        if self.chat:
            return {"index": piece.index, "delta": {"content": piece.text} if piece.text else {},
                    "logprobs": lp, "finish_reason": piece.finish_reason,
                    "stop_reason": piece.stop_reason}
        return {"index": piece.index, "text": piece.text, "logprobs": lp,
                "finish_reason": piece.finish_reason, "stop_reason": piece.stop_reason}

    def final(self) -> list[dict]:
        """Every choice, whole (a non-streaming answer)."""
        out = []
        for i, pieces in enumerate(self.pieces):
            last = pieces[-1] if pieces else Piece(i, "", [], [], "abort")
            lp = self._logprobs(pieces, 0) if self.logprobs else None
            body = ({"message": {"role": "assistant", "content": self.text[i]}} if self.chat
                    else {"text": self.text[i]})
            out.append({"index": i, **body, "logprobs": lp,
                        "finish_reason": last.finish_reason, "stop_reason": last.stop_reason})
        return out

    def usage(self, prompt_tokens: int) -> dict:
        done = sum(len(p.token_ids) for pieces in self.pieces for p in pieces)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                "total_tokens": prompt_tokens + done}

    def _logprobs(self, pieces: list[Piece], offset: int) -> dict:
        """The chosen tokens' logprobs: ``{"content": [...]}`` (chat) or ``{"tokens",
        "token_logprobs", "top_logprobs", "text_offset"}`` (completions)."""
        pairs = [(t, lp) for p in pieces for t, lp in zip(p.token_ids, p.logprobs, strict=True)]
        if self.chat:
            def entry(t, lp):
                return {"token": self.decode([t]), "logprob": lp,
                        "bytes": list(self.token_bytes(t))}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(t, lp)]}
                                for t, lp in pairs]}
        tokens = [self.decode([t]) for t, _ in pairs]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp in pairs],
                "top_logprobs": [{tok: lp} for tok, (_, lp) in zip(tokens, pairs, strict=True)],
                "text_offset": offsets}
