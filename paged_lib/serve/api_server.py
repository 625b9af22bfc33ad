"""The OpenAI-compatible HTTP server: routes, errors and server-sent events (FastAPI).

    /health                 200 while the engine loop runs
    /v1/models              the one model served
    /v1/completions         a prompt (text or token ids) continued
    /v1/chat/completions    messages answered: the model's chat template, or for a model
                            without one (the tiny byte model) :data:`FALLBACK_CHAT_FORMAT`
    /metrics                Prometheus text, vLLM's metric names (:mod:`.metrics`)

``"stream": true`` answers with server-sent events: one ``data: {chunk}`` per new text
piece, ``data: [DONE]`` at the end. vLLM's ``prompt_logprobs`` (not with a stream, as in
vLLM) come in the response (chat) or in each choice (completions); a completion's ``echo``
puts the prompt first in the text, and with ``logprobs`` its tokens' logprobs first.
Every error is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: a
4xx for a request the client must fix (malformed JSON, an unknown model, a value out of
range, a prompt longer than the model takes), 503 when the engine failed while running it
(in a stream: an error event, then ``[DONE]``). A field the server does not know is
ignored and named once in the log, as vLLM does. A client that disconnects has its request
aborted, its blocks freed. Where this server still differs from vLLM's: chapter 14, section
1 (one prompt per completions request; ``prompt_logprobs`` from a second prefill; tools,
``response_format`` and other unknown fields ignored, not honoured; a model without a chat
template gets ``role: content`` lines).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from paged_lib.engine.llm import LLM
from paged_lib.serve.async_engine import AsyncEngine, EngineError, RequestError
from paged_lib.serve.metrics import ServerMetrics
from paged_lib.serve.outputs import Choices, Echo, Piece, prompt_logprobs_json, text_pieces
from paged_lib.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    ServeError,
    log_ignored,
    validation_error,
)

#: how a conversation is written for a model without a chat template: one line per
#: message, ``"{role}: {content}\n"``, then ``"assistant:"`` for the answer
FALLBACK_CHAT_FORMAT = "{role}: {content}\n"
FALLBACK_GENERATION_PROMPT = "assistant:"
#: how often a non-streaming request checks that its client is still there
DISCONNECT_POLL_S = 0.5


class OpenAIServing:
    """The routes' work, over one :class:`~paged_lib.engine.llm.LLM` and its engine loop."""

    def __init__(self, llm: LLM, model_name: str):
        self.llm, self.model_name = llm, model_name
        self.tokenizer = llm.tokenizer
        self.metrics = ServerMetrics(model_name)
        self.engine = AsyncEngine(llm.engine, self.metrics)
        self.created = int(time.time())

    # ------------------------------------------------------------ routes

    async def health(self) -> Response:
        return Response(status_code=200 if self.engine.alive else 503)

    async def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "paged_lib", "root": self.model_name,
            "max_model_len": self.llm.engine.max_model_len}]}

    async def metrics_text(self) -> PlainTextResponse:
        return PlainTextResponse(self.metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, req: CompletionRequest, raw: Request):
        self._check_model(req.model)
        ids = self._prompt_ids(req.prompt)
        echo = None
        if req.echo:  # the prompt as sent when it is text, else its tokens decoded
            text = req.prompt if isinstance(req.prompt, str) else (
                req.prompt[0] if isinstance(req.prompt, list) and req.prompt
                and isinstance(req.prompt[0], str) else self.tokenizer.decode(ids))
            echo = Echo(text, ids)
        return await self._serve(req, raw, ids, "cmpl", "text_completion", echo)

    async def chat_completions(self, req: ChatCompletionRequest, raw: Request):
        self._check_model(req.model)
        if req.top_logprobs and not req.logprobs:  # vLLM's check (0 or null is fine)
            raise ServeError(400, "when using `top_logprobs`, `logprobs` must be set to true",
                             "top_logprobs")
        ids = self._chat_prompt_ids(req.messages)
        return await self._serve(req, raw, ids, "chatcmpl", "chat.completion")

    # ------------------------------------------------------------ the common path

    async def _serve(self, req: SamplingFields, raw: Request, ids: list[int], prefix: str,
                     kind: str, echo: Echo | None = None):
        log_ignored(req)
        try:
            params = req.to_sampling_params(self._room(ids))
        except ValueError as e:  # SamplingParams' own checks, in vLLM's words
            raise ServeError(400, str(e)) from None
        chat = kind == "chat.completion"
        choices = Choices(params.n, self.tokenizer.decode, self._token_bytes, chat=chat,
                          logprobs=params.logprobs is not None, top_k=params.logprobs or 0,
                          echo=echo)
        try:
            stream = await self.engine.add_request(ids, params, req.priority)
        except RequestError as e:
            raise ServeError(400, str(e)) from None
        except EngineError as e:
            raise ServeError(503, str(e)) from None
        if echo is not None:
            echo.top = stream.prompt_logprobs
        prompt_lps = prompt_logprobs_json(stream.prompt_logprobs, self.tokenizer.decode)
        pieces = text_pieces(self.engine, stream, self.tokenizer.decode, params.stop)
        head = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind,
                "created": int(time.time()), "model": self.model_name}
        if req.stream:
            return StreamingResponse(self._events(head, pieces, choices, len(ids),
                                                  req.include_usage),
                                     media_type="text/event-stream")
        drain = asyncio.ensure_future(_add_all(pieces, choices))
        try:
            while not drain.done():
                await asyncio.wait({drain}, timeout=DISCONNECT_POLL_S)
                if not drain.done() and await raw.is_disconnected():
                    return Response(status_code=499)  # nobody to answer (finally aborts)
            drain.result()
        except EngineError as e:
            raise ServeError(503, str(e)) from None
        finally:
            drain.cancel()  # (done already, or its client left: text_pieces aborts it)
        final = choices.final()
        if chat:  # vLLM's extra field: the response's in chat, each choice's in completions
            return {**head, "choices": final, "usage": choices.usage(len(ids)),
                    "prompt_logprobs": prompt_lps}
        final = [{**c, "prompt_logprobs": prompt_lps} for c in final]
        return {**head, "choices": final, "usage": choices.usage(len(ids))}

    async def _events(self, head: dict, pieces: AsyncIterator[Piece], choices: Choices,
                      prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        chunk = {**head, "object": head["object"].replace("chat.completion",
                                                          "chat.completion.chunk")}
        try:
            if choices.chat:  # vLLM's first chunk per choice: the role
                yield _sse({**chunk, "choices": [
                    {"index": i, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None} for i in range(choices.n)]})
            async for piece in pieces:
                yield _sse({**chunk, "choices": [choices.add(piece)]})
            if include_usage:
                yield _sse({**chunk, "choices": [], "usage": choices.usage(prompt_tokens)})
        except EngineError as e:
            yield _sse(ServeError(503, str(e)).body())
        finally:
            await pieces.aclose()  # a client gone mid-stream: its request is aborted
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------ requests to token ids

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ServeError(404, f"The model `{model}` does not exist.", "model")

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ServeError(400, f"one prompt per request, got {len(prompt)} (send them "
                                 "as separate requests: the engine batches them)", "prompt")
            prompt = prompt[0]
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _chat_prompt_ids(self, messages: list[ChatMessage]) -> list[int]:
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        if getattr(self.tokenizer, "chat_template", None):
            try:
                text = self.tokenizer.render_chat(conversation, add_generation_prompt=True)
            except ValueError as e:
                raise ServeError(400, str(e), "messages") from None
            return self.tokenizer.encode(text, add_bos=False)
        text = "".join(FALLBACK_CHAT_FORMAT.format(**m) for m in conversation)
        return self.tokenizer.encode(text + FALLBACK_GENERATION_PROMPT)

    def _room(self, ids: list[int]) -> int:
        """``max_tokens`` left out: what the context has left (at least 1, so that a prompt
        too long gets the engine's message about it)."""
        return max(1, self.llm.engine.max_model_len - len(ids))

    def _token_bytes(self, token: int) -> bytes:
        if hasattr(self.tokenizer, "decode_bytes"):
            return self.tokenizer.decode_bytes([token])
        return self.tokenizer.decode([token]).encode()


async def _add_all(pieces: AsyncIterator[Piece], choices: Choices) -> None:
    async for piece in pieces:
        choices.add(piece)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _error(e: ServeError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def build_app(llm: LLM, model_name: str) -> FastAPI:
    """The FastAPI app serving ``llm`` as ``model_name``; its engine loop runs while the
    app does (started and stopped by the app's lifespan)."""
    serving = OpenAIServing(llm, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        serving.engine.start()
        yield
        serving.engine.shutdown()

    app = FastAPI(title="paged_lib.serve", lifespan=lifespan)
    app.state.serving = serving
    app.add_exception_handler(ServeError, lambda _, e: _error(e))
    app.add_exception_handler(RequestValidationError,
                              lambda _, e: _error(validation_error(e.errors())))
    app.add_exception_handler(HTTPException,
                              lambda _, e: _error(ServeError(e.status_code, str(e.detail))))
    app.get("/health")(serving.health)
    app.get("/v1/models")(serving.models)
    app.get("/metrics")(serving.metrics_text)
    app.post("/v1/completions")(serving.completions)
    app.post("/v1/chat/completions")(serving.chat_completions)
    return app
