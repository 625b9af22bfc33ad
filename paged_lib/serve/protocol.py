"""The OpenAI API's requests, as the server accepts them, and its error shape.

Strict, as vLLM's validation is: a field the server does not know is a 400 (not silently
ignored), and so is a value out of range. The fields are OpenAI's, plus vLLM's extra
sampling fields that the engine has (``top_k``, ``ignore_eos``). ``logprobs`` reports the
chosen token's log-probability; ``top_logprobs`` lists the chosen token alone (the sampler
keeps no alternatives).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

NonEmptyStr = Annotated[str, Field(min_length=1)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """What completions and chat completions share."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt, as text or token ids (a list of one is fine).
    ``max_tokens`` defaults to 16 (OpenAI's default); ``null``: what the context has left."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. ``max_tokens`` (or OpenAI's newer
    ``max_completion_tokens``) defaults to what the context has left, as in vLLM."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class ServeError(Exception):
    """An answer in OpenAI's error shape: ``{"error": {message, type, param, code}}``."""

    TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
             503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "BadRequestError" if self.status < 500
                              else "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.status}}


def validation_error(errors: list[dict]) -> ServeError:
    """FastAPI's ``RequestValidationError.errors()`` (malformed JSON, an unknown field, a
    value out of range) as one 400, naming the first field at fault."""
    parts, param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({e.get('msg')})")
            continue
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        if e.get("type") == "extra_forbidden":
            parts.append(f"{where}: unknown field (this server does not support it)")
        else:
            parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return ServeError(400, "; ".join(parts) or "invalid request", param)
