"""The engine loop: one thread steps the engine while HTTP handlers wait (vLLM's async engine).

Handlers live on the asyncio event loop; :class:`~paged_lib.engine.llm_engine.LLMEngine`
is plain, blocking Python that only one thread may touch. So one background thread owns
it and loops::

    take the requests that arrived and the aborts, under a lock   (never during a step)
    add them to the engine / abort them (blocks freed)
    engine.step() if anything is unfinished, else sleep until something arrives
    hand every request its new tokens (its asyncio queue, via call_soon_threadsafe)

A request that can never run (too long for the model, ``n`` above ``max_num_seqs``, ...)
is refused when it is added, before its HTTP answer has started: :class:`RequestError`.
One that asks for ``prompt_logprobs`` has them computed as it is added, on this thread
(the prompt run once more in a scratch pool: :mod:`paged_lib.engine.prompt_logprobs`), in
:attr:`RequestStream.prompt_logprobs`.
A step that raises fails every request in flight with :class:`EngineError` (their blocks
freed, the prefix cache reset, since that step may have cached blocks it never wrote) and
the loop goes on serving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

from paged_lib.engine.llm_engine import LLMEngine
from paged_lib.engine.prompt_logprobs import prompt_logprobs
from paged_lib.engine.sequence import EngineStats, SamplingParams, SequenceGroup
from paged_lib.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)

#: the engine's per-step stats lists are started afresh past this many steps
STATS_STEPS_KEPT = 10_000


class RequestError(ValueError):
    """The engine refused the request (its message says why): the client's to fix."""


class EngineError(RuntimeError):
    """An engine step failed while the request was in flight."""


@dataclass
class Delta:
    """What one step gave one sequence of a request: ``index`` (0..n-1), its new tokens,
    their log-probabilities, and ``finish_reason`` ("stop": EOS, a stop token id or string,
    named in ``stop_reason``; "length": max_tokens) once it has ended. ``top``: each new
    token's ``{token id: Logprob}`` (the most likely ones) when the request asks for
    ``logprobs``, else empty."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    top: list[dict] = field(default_factory=list)


@dataclass(eq=False)
class RequestStream:
    """One request as its handler sees it: ``async for deltas in stream`` gives a list of
    :class:`Delta` per step that made tokens, and ends when the request has finished."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    priority: int = 0
    #: with ``params.prompt_logprobs``: ``None``, then each prompt token's ``{id: Logprob}``
    prompt_logprobs: list | None = None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    # the engine thread's bookkeeping
    group: SequenceGroup | None = None
    sent: list[int] = field(default_factory=list)          # tokens handed out, per sequence
    cumulative: list[float] = field(default_factory=list)  # their logprob sum, per sequence
    ended: list[str | None] = field(default_factory=list)  # finish reason, per sequence
    first_token: bool = False
    first_token_time: float = 0.0
    last_token_time: float = 0.0

    def put(self, item) -> None:
        """From the engine thread: hand ``item`` to the handler's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[Delta]:
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item


class AsyncEngine:
    """Serve an :class:`LLMEngine` to many asyncio handlers from one thread (module doc)."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        engine.on_step = self._on_step
        self._cond = threading.Condition()
        self._new: list[RequestStream] = []
        self._aborts: list[tuple[int, str]] = []
        self._stopping = False
        self._streams: dict[int, RequestStream] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)

    # ------------------------------------------------------------ the handlers' side

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                          priority: int = 0) -> RequestStream:
        """Queue a request for the next turn of the loop; returns once the engine took it
        (raises :class:`RequestError` if it refused it)."""
        stream = RequestStream(next(self._ids), prompt_token_ids, params,
                               asyncio.get_running_loop(), priority)
        with self._cond:
            self._new.append(stream)
            self._cond.notify()
        try:
            accepted = await stream.queue.get()
        except asyncio.CancelledError:
            self.abort(stream.request_id)
            raise
        if isinstance(accepted, Exception):
            raise accepted
        return stream

    def abort(self, request_id: int, reason: str = "abort") -> None:
        """Drop a request between steps: its client left (``"abort"``), or stop strings
        ended every sequence (``"stop"``). A request already finished is left alone."""
        with self._cond:
            self._aborts.append((request_id, reason))
            self._cond.notify()

    # ------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._new or self._aborts or self._stopping
                           or self.engine.scheduler.has_unfinished()):
                    self._cond.wait()
                if self._stopping:
                    break
                new, self._new = self._new, []
                aborts, self._aborts = self._aborts, []
            try:
                for stream in new:  # before the aborts: a client may leave before its turn
                    self._admit(stream)
                for request_id, reason in aborts:
                    self._abort(request_id, reason)
                if self.engine.scheduler.has_unfinished():
                    self._step()
            except Exception as e:  # noqa: BLE001 - the loop must outlive any failure
                self._fail_all(e)
            self._set_gauges()
        with self._cond:
            left, self._new = [*self._streams.values(), *self._new], []
        for stream in left:
            stream.put(EngineError("the server is shutting down"))

    def _admit(self, stream: RequestStream) -> None:
        try:
            group = self.engine.add_request(stream.request_id, stream.prompt_token_ids,
                                            stream.params, stream.priority)
        except ValueError as e:
            stream.put(RequestError(str(e)))
            return
        except Exception as e:  # noqa: BLE001
            stream.put(EngineError(f"the engine could not take this request "
                                   f"({type(e).__name__}: {e})"))
            return
        if group.error is not None:
            stream.put(RequestError(group.error))
            return
        if (k := stream.params.prompt_logprobs) is not None:
            e = self.engine
            try:
                stream.prompt_logprobs = prompt_logprobs(
                    e.model, stream.prompt_token_ids, k, e.block_size, e.attention_backend)
            except Exception as err:  # noqa: BLE001
                e.abort_request(stream.request_id)
                stream.put(EngineError(f"the prompt's logprobs could not be computed "
                                       f"({type(err).__name__}: {err})"))
                return
        n = stream.params.n
        stream.group, stream.sent = group, [0] * n
        stream.cumulative, stream.ended = [0.0] * n, [None] * n
        self._streams[stream.request_id] = stream
        stream.put(True)

    def _abort(self, request_id: int, reason: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished already (or never admitted)
        self.engine.abort_request(request_id)
        self.metrics.request_finished(reason)
        stream.put(None)

    def _step(self) -> None:
        self.engine.step()  # (a failure: _loop fails the requests in flight)
        for stream in list(self._streams.values()):
            self._publish(stream)
        if self.engine.stats.steps > STATS_STEPS_KEPT:  # a server runs for ever
            self.engine.stats = EngineStats(num_blocks=self.engine.num_blocks,
                                            block_size=self.engine.block_size)

    def _publish(self, stream: RequestStream) -> None:
        """Hand ``stream`` the tokens its sequences made since the last step."""
        group, deltas = stream.group, []
        for i, seq in enumerate(group.seqs[:stream.params.n]):
            new = seq.output_token_ids[stream.sent[i]:]
            if stream.ended[i] is not None or not new:
                continue
            # a step makes one token per sequence: its logprob is what the sum gained
            logprobs = [seq.cumulative_logprob - stream.cumulative[i]]
            top = (seq.output_logprobs[stream.sent[i]:stream.sent[i] + len(new)]
                   if stream.params.logprobs is not None else [])
            stream.sent[i] += len(new)
            stream.cumulative[i] = seq.cumulative_logprob
            stop_reason = None
            if seq.is_finished():
                stream.ended[i] = seq.finish_reason  # the engine's check_stop says why
                stop_reason = seq.stop_reason
            deltas.append(Delta(i, new, logprobs, stream.ended[i], stop_reason, top))
        if not deltas:
            return
        self.metrics.add("vllm:generation_tokens", sum(len(d.token_ids) for d in deltas))
        now = time.monotonic()
        if not stream.first_token:
            stream.first_token, stream.first_token_time = True, now
            self.metrics.observe_ttft(now - stream.arrival)
            self.metrics.add("vllm:prompt_tokens", len(stream.prompt_token_ids))
        else:
            self.metrics.observe("vllm:inter_token_latency_seconds", now - stream.last_token_time)
        stream.last_token_time = now
        finished = group.is_finished()
        if finished:  # (counted before the handler hears of it: a scrape after sees it)
            del self._streams[stream.request_id]
            self.metrics.request_finished(
                "length" if set(stream.ended) == {"length"} else "stop")
            self.metrics.observe("vllm:e2e_request_latency_seconds", now - stream.arrival)
            if (made := max(stream.sent)) > 1:
                self.metrics.observe("vllm:request_time_per_output_token_seconds",
                                     (now - stream.first_token_time) / (made - 1))
        stream.put(deltas)
        if finished:
            stream.put(None)

    def _fail_all(self, error: Exception) -> None:
        """A step (or the loop) failed: every request in the engine is dropped, its blocks
        freed, its client told why; the prefix cache starts empty."""
        log.error("engine step failed", exc_info=error)
        message = (f"the engine failed while running this request and dropped it "
                   f"({type(error).__name__}: {error}); the server goes on serving")
        s = self.engine.scheduler
        for group in [*s.waiting, *s.running, *s.swapped]:
            try:
                self.engine.abort_request(group.request_id)
            except Exception:  # noqa: BLE001 - half-updated state: dropped anyway
                log.exception("could not free request %s", group.request_id)
        if not self.engine.reset_prefix_cache():
            log.error("blocks still in use after dropping every request")
        for stream in self._streams.values():
            self.metrics.request_finished("error")
            stream.put(EngineError(message))
        self._streams.clear()

    def _on_step(self, out, stats) -> None:
        """The engine's ``on_step``: preemptions and prefix-cache lookups (in tokens)."""
        self.metrics.add("vllm:num_preemptions", len(out.preempted))
        if self.engine.block_manager.enable_prefix_caching:
            # what the scheduler looked up: one sequence's text, or a shared prompt
            queried = sum(len(g.live_seqs()[0].token_ids if len(g.live_seqs()) == 1
                              else g.prompt_token_ids) for g in out.admitted)
            self.metrics.add("vllm:prefix_cache_queries", queried)
            self.metrics.add("vllm:prefix_cache_hits", out.prefix_cache_hit_tokens)

    def _set_gauges(self) -> None:
        s, bm = self.engine.scheduler, self.engine.block_manager
        self.metrics.set(num_requests_running=len(s.running),
                         num_requests_waiting=len(s.waiting),
                         num_requests_swapped=len(s.swapped),
                         kv_cache_usage_perc=bm.num_used_blocks / self.engine.num_blocks)
