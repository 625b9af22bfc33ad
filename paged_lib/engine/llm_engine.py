"""LLMEngine: prompts in, completions out, one :meth:`~LLMEngine.step` at a time.

Each step: :meth:`Scheduler.schedule` (who runs, which blocks) -> ``ModelRunner.execute``
(tensors, model) -> :func:`~paged_lib.engine.sampler.sample` -> :meth:`Scheduler.update`
(append, finish, free). :attr:`LLMEngine.stats` records every step for the plots.

The chapters' exercises re-implement pieces of it and plug them back in, each under its
library name (:class:`~paged_lib.engine.hooks.EngineHooks`)::

    LLMEngine(model, num_blocks, hooks=EngineHooks(can_admit=my_can_admit,
                                                   choose_victim=my_victim))

``on_step(out, stats)`` watches every step (its :class:`SchedulerOutput` and the stats).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from paged_lib.engine.block_manager import BlockManager
from paged_lib.engine.config import ENGINE_FIELDS, EngineConfig
from paged_lib.engine.hooks import EngineHooks
from paged_lib.engine.model_input import model_input
from paged_lib.engine.model_runner import ModelRunner
from paged_lib.engine.outputs import request_output
from paged_lib.engine.prefix_cache import PrefixCachingAllocator
from paged_lib.engine.prompt_logprobs import prompt_logprobs
from paged_lib.engine.requests import (
    check_max_model_len,
    check_request,
    never_fits,
    token_id,
)
from paged_lib.engine.reservation import make_reservation
from paged_lib.engine.sampler import sample
from paged_lib.engine.sampling_params import MAX_LOGPROBS
from paged_lib.engine.scheduler import Scheduler
from paged_lib.engine.sequence import (
    EngineStats,
    RequestOutput,
    SamplingParams,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from paged_lib.engine.stop import StopStrings
from paged_lib.engine.tensor_parallel import kv_cache_bytes_per_rank, start_tensor_parallel
from paged_lib.engine.window import make_window
from paged_lib.kernels.backends import resolve_backend
from paged_lib.kernels.kv_quant import use_int8_write
from paged_lib.model import TinyLlama


class LLMEngine:
    """A paged serving engine over a :class:`~paged_lib.model.TinyLlama`.

    ``num_blocks`` GPU blocks of ``block_size`` tokens hold every request's K/V;
    ``num_cpu_blocks`` more wait on the CPU for ``preemption="swap"``. A step runs at most
    ``max_num_seqs`` sequences and computes at most ``max_num_batched_tokens`` tokens,
    decodes included (so the budget must be at least ``max_num_seqs``; without chunked
    prefill, at least ``max_model_len``, as vLLM asks), and admission keeps ``watermark``
    (a fraction of the pool, rounded down) free so running sequences have room to grow.
    A request whose prompt plus ``max_tokens`` exceeds ``max_model_len`` (default: the
    model's ``max_position``) fails alone, with vLLM's message. ``scheduling="mixed"``
    batches prefills with the running decodes (Orca); ``"prefill_first"`` runs a step of
    prefills or a step of decodes (vLLM v0's default). ``attention_backend`` is
    ``"auto"`` (the default: the fastest that works here, as vLLM picks its own;
    :attr:`attention_backend` then names the one that runs), ``"torch"`` (PyTorch ops,
    chapter 04), ``"triton"`` (chapter 05's kernels) or ``"cpu"`` (decode by a C kernel
    compiled at first use, the fastest on a CPU: :mod:`paged_lib.kernels.cpu_decode`).

    Chapter 10: ``enable_prefix_caching=True`` keeps freed full blocks, hashed, until they
    are reused, and a request whose text starts with cached blocks reads them instead of
    computing them (``stats.prefix_cache_hit_tokens`` counts those tokens);
    ``enable_chunked_prefill=True`` computes a text longer than the step's token budget
    left in chunks over several steps, alongside the decodes (``scheduling="mixed"``).
    Both leave the generated tokens unchanged.

    Chapter 11: ``kv_cache_dtype="int8"`` or ``"fp8_e4m3"`` stores K and V in 8 bits
    (:mod:`paged_lib.kv_quant`: int8 with a scale per block and KV head, fp8 E4M3 with
    one scale per tensor); ``"auto"`` (the default) keeps the model's dtype.

    Chapter 12: ``tensor_parallel_size=T`` runs the model on ``T`` worker processes, its
    heads and KV cache split between them (:mod:`paged_lib.engine.tensor_parallel`); the
    scheduler stays here. ``close()`` (or ``with LLMEngine(...) as engine:``) stops them.

    Chapter 13: with a ``tokenizer`` (``LLM`` passes its own), completions carry their
    ``text`` and requests may stop at ``stop`` strings (:mod:`paged_lib.engine.stop`).

    Chapter 14: ``reservation="orca-max" | "orca-pow2" | "orca-oracle"`` makes each request
    reserve at admission the blocks chapter 02's Orca policies give it, held until it
    finishes (:mod:`paged_lib.engine.reservation`); ``"paged"`` (the default) reserves none.
    """

    def __init__(self, model: TinyLlama, num_blocks: int | None = None, block_size: int = 16,
                 num_cpu_blocks: int = 0, preemption: str = "recompute",
                 attention_backend: str = "auto", *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 4096, watermark: float = 0.01,
                 scheduling: str = "mixed", enable_prefix_caching: bool = False,
                 kv_cache_dtype: str = "auto", enable_chunked_prefill: bool = False,
                 tensor_parallel_size: int = 1, sliding_window: int | None = None,
                 num_sink_tokens: int = 0, max_model_len: int | None = None,
                 reservation: str = "paged", max_logprobs: int = MAX_LOGPROBS,
                 threads: int | None = None, scheduling_policy: str = "fcfs",
                 config: EngineConfig | None = None,
                 hooks: EngineHooks | None = None, on_step: Callable | None = None,
                 tokenizer=None):
        options = {k: v for k, v in locals().items() if k in ENGINE_FIELDS}
        config = EngineConfig.of(config, options)  # every option checked, once
        if config.num_blocks is None:
            raise ValueError("LLMEngine needs num_blocks: the GPU blocks of its KV pool")
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        #: the engine's options (:class:`EngineConfig`), ``max_model_len`` resolved
        self.config = c = config.replace(max_model_len=check_max_model_len(
            config.max_model_len, model.config.max_position))
        num_blocks, block_size, num_cpu_blocks = c.num_blocks, c.block_size, c.num_cpu_blocks
        preemption, enable_prefix_caching = c.preemption, c.enable_prefix_caching
        kv_cache_dtype, enable_chunked_prefill = c.kv_cache_dtype, c.enable_chunked_prefill
        sliding_window, tensor_parallel_size = c.sliding_window, c.tensor_parallel_size
        #: the backend that runs (``"auto"`` resolved: the C kernel on a CPU where it builds)
        self.attention_backend = attention_backend = resolve_backend(c.attention_backend,
                                                                     model.device)
        self.max_model_len = c.max_model_len
        if hooks is not None and not isinstance(hooks, EngineHooks):
            raise ValueError(f"hooks must be an EngineHooks, got {type(hooks).__name__}")
        self.hooks = hooks = hooks if hooks is not None else EngineHooks()
        self.model = model.eval()
        self.block_size = block_size
        self.window = make_window(sliding_window, c.num_sink_tokens, block_size, model.config,
                                  enable_prefix_caching=enable_prefix_caching,
                                  preemption=preemption, kv_cache_dtype=kv_cache_dtype,
                                  tensor_parallel_size=tensor_parallel_size,
                                  drop_oldest=hooks.drop_oldest)
        scheduler_hooks = hooks
        if self.window is not None:  # chapter 11: admission reserves each stream's blocks
            scheduler_hooks = dataclasses.replace(hooks, num_required_blocks=self.window.reserving(
                hooks.num_required_blocks, lambda: self.scheduler.running))
        self.reservation = make_reservation(
            c.reservation, block_size, self.max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill, sliding_window=sliding_window)
        if self.reservation is not None:  # chapter 14: admission reserves Orca's blocks
            scheduler_hooks = dataclasses.replace(
                hooks, num_required_blocks=self.reservation.reserving(
                    hooks.num_required_blocks, lambda: self.scheduler.running))
        self.runner = None
        tp = tensor_parallel_size
        if isinstance(tp, bool) or tp != 1:  # chapter 12: the ranks start, agree on the pool
            self.runner = start_tensor_parallel(model, num_blocks, block_size, num_cpu_blocks,
                                                attention_backend, tp,
                                                build_metadata=hooks.build_metadata,
                                                kv_cache_dtype=kv_cache_dtype)
            num_blocks = self.runner.num_blocks
        self.num_blocks = num_blocks
        self.watermark_blocks = int(c.watermark * num_blocks)
        self.block_manager = BlockManager(num_blocks, block_size, num_cpu_blocks,
                                          enable_prefix_caching=enable_prefix_caching,
                                          hooks=hooks)
        self.scheduler = Scheduler.from_config(self.block_manager, c, self.watermark_blocks,
                                               scheduler_hooks)
        if self.runner is None:
            self.runner = ModelRunner(model, num_blocks, block_size, num_cpu_blocks,
                                      attention_backend, build_metadata=hooks.build_metadata,
                                      kv_cache_dtype=kv_cache_dtype)
            use_int8_write(self.runner.kv_caches, hooks.write_int8_blocks)  # chapter 11
        self.stats = EngineStats(num_blocks=num_blocks, block_size=block_size)
        #: ``on_step(out, stats)`` after every step: the step's SchedulerOutput (who ran,
        #: their slots, copies, swaps, preemptions) and the stats with the step recorded
        self.on_step = on_step
        #: decodes completions and finds stop strings (``None``: the token-id API only)
        self.tokenizer = tokenizer
        self.stop_strings = StopStrings(tokenizer.decode) if tokenizer is not None else None
        self._next_seq_id = 0

    @property
    def kv_cache_bytes_per_rank(self) -> list[int]:
        """Bytes of KV cache each tensor-parallel rank holds (one entry without TP)."""
        return kv_cache_bytes_per_rank(self.runner)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done on garbage collection)."""
        if hasattr(self.runner, "close"):
            self.runner.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ requests

    def _check_request(self, i: int, prompt, params: SamplingParams
                       ) -> tuple[list[int], SamplingParams]:
        """The prompt as a list of ints and the params the engine runs (``max_tokens=None``
        resolved to what the context has left); what depends on the model is checked
        here, as vLLM's processor does, in its words."""
        if isinstance(params, SamplingParams) and params.max_tokens is None:
            room = self.max_model_len - len(prompt) if hasattr(prompt, "__len__") else 1
            params = dataclasses.replace(params, max_tokens=max(1, room))
        prompt = check_request(i, prompt, params, self.model.config.vocab_size, self.window,
                               has_tokenizer=self.tokenizer is not None)
        try:  # vLLM's SamplingParams.verify: what depends on the model
            params.verify(self.model.config.vocab_size, self.config.max_logprobs,
                          self.tokenizer)
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None
        if self.reservation is not None:
            self.reservation.check_request(i, params)
        return prompt, params

    def _never_fits(self, prompt: list[int], params: SamplingParams) -> str | None:
        why = never_fits(prompt, params, max_model_len=self.max_model_len,
                         max_num_seqs=self.scheduler.max_num_seqs, num_blocks=self.num_blocks,
                         watermark_blocks=self.watermark_blocks, block_size=self.block_size,
                         window=self.window)
        r = self.reservation
        if why is None and r is not None and r.blocks(len(prompt), params.max_tokens) > \
                self.num_blocks:
            why = (f"reservation={r.policy!r} reserves {r.blocks(len(prompt), params.max_tokens)}"
                   f" blocks for it but the whole pool has {self.num_blocks}: it can never run")
        return why

    def add_request(self, request_id: int, prompt: list[int], params: SamplingParams,
                    priority: int = 0) -> SequenceGroup:
        """Queue a request (checked: malformed input raises ``ValueError``); one that can
        never fit in the pool is returned already failed (``error`` set), and not queued.
        ``priority`` (lower first) needs ``scheduling_policy="priority"``, as in vLLM."""
        prompt, params = self._check_request(request_id, prompt, params)
        self.config.check_priority(request_id, priority)
        seq = Sequence(self._next_seq_id, prompt)
        self._next_seq_id += 1
        gen = torch.Generator()
        gen.manual_seed(params.seed if params.seed is not None
                        else int(torch.randint(0, 2**62, (1,))))
        group = SequenceGroup(request_id, [seq], params, generator=gen, priority=priority)
        group.error = self._never_fits(prompt, params)
        if group.error is None:
            self.scheduler.add(group)
        else:
            group.timeline.arrival_step = self.scheduler.step
        return group

    def abort_request(self, request_id: int) -> SequenceGroup | None:
        """Drop a request wherever it is (waiting, running, swapped out): every block its
        sequences hold, GPU or CPU, goes back, and it is never scheduled again (a server
        does this when a client disconnects). Call it between steps. Returns the group,
        or ``None`` when no unfinished request has that id."""
        s = self.scheduler
        for queue in (s.waiting, s.running, s.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.live_seqs():
                        self.block_manager.free(seq)
                        seq.status = SequenceStatus.FINISHED
                    group.timeline.finished_step = s.step
                    return group
        return None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``): only when no block is
        in use, else ``False`` and nothing changes. A step that failed may have cached
        blocks whose K/V was never written; the server resets after failing it."""
        gpu = self.block_manager.gpu
        if self.block_manager.num_used_blocks:
            return False
        if isinstance(gpu, PrefixCachingAllocator):
            gpu.block_hash.clear()
            gpu.cached_blocks.clear()
        return True

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[SequenceGroup]:
        """One engine step; returns the groups that finished in it. ``on_step`` (if set)
        then gets the step's :class:`SchedulerOutput` and :attr:`stats`."""
        start = time.perf_counter()
        if self.window is not None:  # blocks out of the window go back before scheduling
            self.window.slide_all(self.scheduler.running)
        out = self.scheduler.schedule()
        if self.window is not None:
            self.window.check_no_preemption(out)
        if out.is_empty() and not out.preempted:  # (a step may only preempt: next one runs)
            raise RuntimeError(
                f"step {self.scheduler.step}: nothing could be scheduled although "
                f"{len(self.scheduler.waiting)} groups wait and "
                f"{len(self.scheduler.swapped)} are swapped out "
                f"({self.block_manager.num_free_blocks} blocks free)")
        scheduled = time.perf_counter()
        inp = model_input(out, self.window)
        built = time.perf_counter()
        logits = self.runner.execute(inp)
        ran = time.perf_counter()
        samples = sample(logits, out, self.model.config.eos_token_id)
        sampled = time.perf_counter()
        s = self.stats
        s.preemptions += len(out.preempted)
        s.swapped_blocks += len(out.swap_out) + len(out.swap_in)
        s.recomputed_tokens += out.recomputed_tokens
        s.prefix_cache_hit_tokens += out.prefix_cache_hit_tokens
        used = self.block_manager.num_used_blocks
        finished = self.scheduler.update(out, samples, self.model.config.eos_token_id,
                                         self.stop_strings)
        # tokens made: one per sample drawn; a beam group makes one per surviving beam
        made = sum(len(x) for x, sc in zip(samples, out.scheduled, strict=True)
                   if sc.group.params.beam_width is None)
        made += sum(len(g.seqs) for g in {sc.group for sc in out.scheduled
                                          if sc.group.params.beam_width is not None
                                          and sc.sample})
        end = time.perf_counter()
        s.record_step(out.kind, len(out.scheduled), used, made, out.num_batched_tokens,
                      prefills=sum(sc.is_prefill for sc in out.scheduled), seconds=end - start,
                      phases={"scheduling": scheduled - start + end - sampled,
                              "model input": built - scheduled, "model": ran - built,
                              "sampling": sampled - ran})
        if self.on_step is not None:
            self.on_step(out, s)
        return finished

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams],
                 arrival_steps: list[int] | None = None, *,
                 on_finish: Callable[[SequenceGroup], None] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """Serve every prompt to the end; one :class:`RequestOutput` per prompt, in order.

        Request ``i`` joins the waiting queue at step ``arrival_steps[i]`` (default: all at
        step 0); a step with nothing to run is recorded as ``"idle"``. ``on_finish(group)``
        (if given) hears of each request as it ends (``LLM``'s progress bar); ``priority``
        gives each request's (with ``scheduling_policy="priority"``).

        Two kinds of bad request, two answers. *Malformed* input (wrong types or values:
        an empty prompt, a token outside the vocabulary, ``max_tokens < 1``, ...) raises
        ``ValueError`` naming the request before anything runs, so nothing is lost: fix
        it and call again. A *well-formed* request that can never fit in the pool fails
        alone: its output has ``error`` set and no completions, while the others run.
        """
        prompts = list(prompts)
        if prompts and token_id(prompts[0]) is not None:
            raise ValueError("prompts is a list of prompts, each a list of token ids; got a "
                             "list of ints (for one prompt, pass [prompt])")
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
        arrivals = [0] * len(prompts) if arrival_steps is None else list(arrival_steps)
        if len(arrivals) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(arrivals)} arrival steps")
        for i, (prompt, p, t) in enumerate(zip(prompts, params, arrivals, strict=True)):
            prompts[i], params[i] = self._check_request(i, prompt, p)
            self.config.check_priority(i, priority[i])
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"request {i}: arrival step must be an int >= 0, got {t!r}")
        self.stats = EngineStats(num_blocks=self.num_blocks, block_size=self.block_size)
        self.scheduler.restart_clock()
        groups: list[SequenceGroup | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: arrivals[i])  # stable: FCFS
        # bounded: every step produces a token, except steps redone after a preemption
        limit = max(arrivals, default=0) + 4 * sum(
            len(p) + sp.max_tokens * sp.num_seqs for p, sp in zip(prompts, params, strict=True))
        nxt = 0
        while nxt < len(order) or self.scheduler.has_unfinished():
            while nxt < len(order) and arrivals[order[nxt]] <= self.scheduler.step:
                i = order[nxt]
                groups[i] = self.add_request(i, prompts[i], params[i], priority[i])
                groups[i].timeline.arrival_step = arrivals[i]
                nxt += 1
                if groups[i].error is not None and on_finish is not None:
                    on_finish(groups[i])
            if self.stats.steps > limit:
                raise RuntimeError(f"no progress after {limit} steps (a scheduling bug?)")
            if self.scheduler.has_unfinished():
                for group in self.step():
                    if on_finish is not None:
                        on_finish(group)
            else:  # nobody to run until the next arrival
                self.stats.record_step("idle", 0, self.block_manager.num_used_blocks, 0, 0)
                self.scheduler.idle_step()
        self.stats.requests = [g.timeline for g in groups]
        outputs = [self._output(g) for g in groups]
        for g, o in zip(groups, outputs, strict=True):
            g.timeline.num_output_tokens = max((len(c.token_ids) for c in o.outputs), default=0)
        return outputs

    def _output(self, group: SequenceGroup) -> RequestOutput:
        """vLLM's :class:`RequestOutput` for a finished ``group`` (texts with a tokenizer)."""
        out = request_output(group, self.tokenizer.decode if self.tokenizer else None)
        if (k := group.params.prompt_logprobs) is not None and group.error is None:
            out = dataclasses.replace(out, prompt_logprobs=prompt_logprobs(
                self.model, out.prompt_token_ids, k, self.block_size, self.attention_backend))
        return out

