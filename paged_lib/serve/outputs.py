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
    """New text of choice ``index``, the tokens behind it, their logprobs and (when asked
    for) each token's most likely alternatives (``top``: ``{token id: Logprob}`` per
    token); the last piece of a choice has ``finish_reason`` ("stop": EOS, a stop token id
    or a stop string, the last two named in ``stop_reason``; "length": ``max_tokens``)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    top: list[dict] = field(default_factory=list)


async def text_pieces(engine: AsyncEngine, stream: RequestStream,
                      decode: Callable[[list[int]], str], stop: list[str]
                      ) -> AsyncIterator[Piece]:
    """The request's choices as text pieces, each yielded as soon as it is decided (text
    made within the request's ``min_tokens`` is not searched for stops, as the engine
    does). As vLLM's detokenizer, a choice ended by EOS or a stop token id keeps the token
    in ``token_ids`` but not its text, and a stop string is left out of the text, unless
    the request's ``include_stop_str_in_output``."""
    n = stream.params.n
    keep_stop = getattr(stream.params, "include_stop_str_in_output", False)
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
                piece.top += d.top
                stop_token = (d.finish_reason == "stop" and not keep_stop
                              and not isinstance(d.stop_reason, str))
                piece.text = det.add(d.token_ids[:-1] if stop_token else d.token_ids)
                if det.stopped is not None:
                    piece.finish_reason, piece.stop_reason = "stop", det.stopped
                    if keep_stop:
                        piece.text += det.stopped
                elif d.finish_reason is not None:
                    piece.text += det.finish()
                    piece.finish_reason, piece.stop_reason = d.finish_reason, d.stop_reason
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
class Echo:
    """A completion's prompt, written before each choice's text (``echo``): its text, its
    tokens and (with ``logprobs``) each token's ``{id: Logprob}`` (the first ``None``)."""

    text: str
    token_ids: list[int]
    top: list | None = None


@dataclass
class Choices:
    """The choices of one request, as OpenAI's completions (``chat=False``) or chat
    completions shape them."""

    n: int
    decode: Callable[[list[int]], str]
    token_bytes: Callable[[int], bytes]
    chat: bool
    logprobs: bool
    top_k: int = 0  # the most likely tokens listed per position (top_logprobs, logprobs=k)
    echo: Echo | None = None
    text: list[str] = field(init=False)
    pieces: list[list[Piece]] = field(init=False)

    def __post_init__(self):
        self.text = [self.echo.text if self.echo else ""] * self.n
        self.pieces = [[] for _ in range(self.n)]

    def add(self, piece: Piece) -> dict:
        """Record ``piece``; returns its choice as a stream chunk shapes it (a choice's
        first chunk carries the echoed prompt)."""
        first = not self.pieces[piece.index]
        offset = len(self.text[piece.index])  # (the echoed prompt's text included)
        self.text[piece.index] += piece.text
        self.pieces[piece.index].append(piece)
        rows = self._rows([piece])
        if first and self.echo is not None:
            piece = Piece(piece.index, self.echo.text + piece.text, piece.token_ids,
                          piece.logprobs, piece.finish_reason, piece.stop_reason, piece.top)
            rows, offset = self._echo_rows() + rows, 0
        lp = self._logprobs(rows, offset) if self.logprobs else None
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
            rows = (self._echo_rows() if self.echo else []) + self._rows(pieces)
            lp = self._logprobs(rows, 0) if self.logprobs else None
            body = ({"message": {"role": "assistant", "content": self.text[i]}} if self.chat
                    else {"text": self.text[i]})
            out.append({"index": i, **body, "logprobs": lp,
                        "finish_reason": last.finish_reason, "stop_reason": last.stop_reason})
        return out

    def usage(self, prompt_tokens: int) -> dict:
        done = sum(len(p.token_ids) for pieces in self.pieces for p in pieces)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                "total_tokens": prompt_tokens + done}

    def _rows(self, pieces: list[Piece]) -> list[tuple]:
        return [(t, lp, top) for p in pieces for t, lp, top in zip(
            p.token_ids, p.logprobs, p.top or [None] * len(p.token_ids), strict=True)]

    def _echo_rows(self) -> list[tuple]:
        """The prompt's tokens as rows (token, its logprob or None, its top or None)."""
        tops = self.echo.top or [None] * len(self.echo.token_ids)
        return [(t, top[t].logprob if top else None, top)
                for t, top in zip(self.echo.token_ids, tops, strict=True)]

    def _logprobs(self, rows: list[tuple], offset: int) -> dict:
        """OpenAI's logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}]}``
        (chat: ``top_logprobs`` the ``k`` most likely tokens, most likely first) or
        ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (completions: each
        position's ``{token: logprob}`` for the ``k`` most likely and the chosen one, as
        vLLM). A log-probability of ``-inf`` is sent as -9999.0 (JSON has no infinity),
        as vLLM does. An echoed prompt's first token has ``null`` for both."""
        if self.chat:
            def entry(t, lp):
                return {"token": self.decode([t]), "logprob": _finite(lp),
                        "bytes": list(self.token_bytes(t))}
            return {"content": [{**entry(t, lp), "top_logprobs": [
                entry(u, x.logprob) for u, x in _ranked(top, self.top_k)]} for t, lp, top in rows]}
        tokens = [self.decode([t]) for t, _, _ in rows]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        tops = []
        for tok, (_, lp, top) in zip(tokens, rows, strict=True):
            best = {self.decode([u]): _finite(x.logprob) for u, x in _ranked(top, self.top_k)}
            tops.append(None if lp is None else {**best, tok: _finite(lp)})
        return {"tokens": tokens, "token_logprobs": [None if lp is None else _finite(lp)
                                                     for _, lp, _ in rows],
                "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(top: list | None, decode: Callable[[list[int]], str]) -> list | None:
    """vLLM's ``prompt_logprobs`` field: ``null`` for the first prompt token, then each
    token's ``{"id": {"logprob", "rank", "decoded_token"}}`` (itself and the most likely)."""
    if top is None:
        return None
    return [None if t is None else {str(u): {"logprob": _finite(x.logprob), "rank": x.rank,
                                             "decoded_token": decode([u])}
                                    for u, x in t.items()} for t in top]


def _ranked(top: dict | None, k: int) -> list:
    """The ``k`` most likely of a ``{token id: Logprob}`` (``k=-1``: all), most likely
    first; the chosen token is among them only if its rank says so."""
    if not top:
        return []
    ranked = sorted(top.items(), key=lambda ux: ux[1].rank)
    return ranked if k < 0 else ranked[:k]


def _finite(lp: float) -> float:
    return max(lp, -9999.0)
