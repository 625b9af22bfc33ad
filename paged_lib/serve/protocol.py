"""The OpenAI API's requests, as the server accepts them, and its error shape.

As vLLM's request models: a field the server does not know is ignored, not refused, and
named once in the server's log ("ignored request fields"), so a client library or chat UI
that sends ``user``, ``metadata``, ``store`` or ``response_format`` by default gets its
answer. The sampling fields are OpenAI's (``temperature``, ``top_p``, ``n``, ``seed``,
``stop``, ``max_tokens``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``,
``logprobs``/``top_logprobs``) plus vLLM's extra ones that the engine has (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``,
``include_stop_str_in_output``, ``ignore_eos``, ``bad_words``, ``allowed_token_ids``,
``prompt_logprobs``; and ``priority``, for a server started with ``--scheduling-policy
priority``; completions also take ``echo``), and
:meth:`SamplingFields.to_sampling_params` is the one place that maps them to
:class:`~paged_lib.engine.sampling_params.SamplingParams`, whose own checks (vLLM's words)
make a bad value a 400. ``null`` means the default, as OpenAI's clients send it.
"""

from __future__ import annotations

import logging
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from paged_lib.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
NonEmptyStr = Annotated[str, Field(min_length=1)]
#: OpenAI clamps each logit bias to this range; vLLM does the same
LOGIT_BIAS_LIMIT = 100.0
_ignored_logged: set[str] = set()


class Lenient(BaseModel):
    """Unknown fields are kept aside (``model_extra``) and ignored, as vLLM's
    ``OpenAIBaseModel`` (``extra="allow"``)."""

    model_config = ConfigDict(extra="allow")


def log_ignored(req: BaseModel) -> list[str]:
    """The unknown fields of ``req`` (and of its messages); each name is logged once per
    server process, as vLLM warns about the fields it ignores."""
    names = sorted(req.model_extra or {})
    for m in getattr(req, "messages", None) or []:
        names += [f"messages[].{k}" for k in sorted(m.model_extra or {})]
    new = [n for n in dict.fromkeys(names) if n not in _ignored_logged]
    if new:
        _ignored_logged.update(new)
        log.warning("ignored request fields (this server does not use them): %s",
                    ", ".join(new))
    return names


class StreamOptions(Lenient):
    include_usage: bool | None = False


class SamplingFields(Lenient):
    """What completions and chat completions share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    min_tokens: int = 0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    priority: int = 0
    user: str | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def num_logprobs(self) -> int | None:
        """Top log-probabilities per token the request asks for (``None``: no logprobs)."""
        raise NotImplementedError

    def asked_max_tokens(self) -> int | None:
        """``max_tokens`` as the client sent it (``None``: what the context has left)."""
        raise NotImplementedError

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top log-probabilities per prompt token (``None``: none asked for)."""
        return self.prompt_logprobs

    def to_sampling_params(self, room: int) -> SamplingParams:
        """The request's :class:`SamplingParams` (the one place fields are mapped; a bad
        value raises ``ValueError`` in vLLM's words). ``room``: what the context has left
        after the prompt, the ``max_tokens`` of a request that gives none. Each
        ``logit_bias`` is clamped to [-100, 100] and its keys read as token ids, as vLLM
        does."""
        bias = None
        if self.logit_bias:
            try:
                bias = {int(t): min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(b)))
                        for t, b in self.logit_bias.items()}
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got "
                                 f"{list(self.logit_bias)}") from None
        asked = self.asked_max_tokens()
        prompt_k, sent = self.num_prompt_logprobs, self.prompt_logprobs
        if self.stream and sent is not None and (sent > 0 or sent == -1):  # vLLM's check
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "n": self.n, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty}
        return SamplingParams(
            **{k: v for k, v in given.items() if v is not None},
            seed=self.seed, stop=self.stop_strings(), stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            max_tokens=room if asked is None else asked, logprobs=self.num_logprobs,
            logit_bias=bias, bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids, prompt_logprobs=prompt_k)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt, as text or token ids (a list of one is fine).
    ``max_tokens`` defaults to 16 (OpenAI's default); ``null``: what the context has left.
    ``logprobs=k``: the chosen token's and the ``k`` most likely tokens' logprobs.
    ``echo``: the prompt comes first in each choice's text, and with ``logprobs`` its
    tokens' logprobs first (the first token's ``null``), as vLLM, which asks for
    ``prompt_logprobs=logprobs`` when none are given."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def asked_max_tokens(self) -> int | None:
        return self.max_tokens


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. ``max_tokens`` (or OpenAI's newer
    ``max_completion_tokens``) defaults to what the context has left, as in vLLM.
    ``logprobs=true`` with ``top_logprobs=k``: the ``k`` most likely tokens too."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def asked_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


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
    """FastAPI's ``RequestValidationError.errors()`` (malformed JSON, a value of the wrong
    type) as one 400, naming the first field at fault."""
    parts, param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({e.get('msg')})")
            continue
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return ServeError(400, "; ".join(parts) or "invalid request", param)
