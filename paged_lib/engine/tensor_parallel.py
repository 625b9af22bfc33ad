"""Tensor-parallel execution: one worker process per rank, the scheduler once in the driver.

Laid out like vLLM's multiprocessing executor. :class:`~paged_lib.engine.LLMEngine` (the
driver) schedules every step once and sends its decision (each sequence's block table,
its new tokens, the block copies and swaps) to every rank; there is no page table to keep
in sync, since only the driver ever changes one. Rank ``r`` is a spawned process holding
rank ``r``'s shard of the model (:mod:`paged_lib.parallel`) and a
:class:`~paged_lib.engine.model_runner.ModelRunner` whose KV caches have only its KV
heads: the same physical block ids on every rank, each rank its heads' share of every
block. The ranks sum their partial outputs with ``torch.distributed`` (gloo on CPU, NCCL
on GPUs) and rank 0 sends the logits back; sampling stays in the driver.

Workers start once (with :class:`TensorParallelRunner`), agree on the number of blocks
(the smallest any rank can hold: an all-reduce ``MIN``) and stop on :meth:`close`, when the
runner is garbage collected, or when any rank fails: the driver then raises a
``RuntimeError`` with the rank's traceback instead of waiting forever.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
import weakref
from datetime import timedelta
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler

import torch

from paged_lib.engine.model_input import ModelInput
from paged_lib.model import TinyLlama
from paged_lib.parallel import AttentionWeights, check_tp_size, shard_config, shard_state_dict

#: seconds the driver waits for the ranks' answer to one step (or to start up)
DEFAULT_TIMEOUT = 120.0


def kv_cache_bytes(kv_caches) -> int:
    """Bytes held by a list of ``(k_cache, v_cache)`` pairs."""
    return sum(t.numel() * t.element_size() for pair in kv_caches for t in pair)


def _blocks_that_fit(device: torch.device, block_bytes: int) -> int:
    """Blocks this rank could hold: 90% of the GPU's free memory, or half the host's
    available memory on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9) // block_bytes
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return free // 2 // block_bytes


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    torch.distributed.all_reduce(x)
    return x


class _RankAttention(torch.nn.Module):
    """A layer's attention on one rank: ``fn`` (:func:`paged_lib.parallel.rank_attention`'s
    signature) over the layer's whole weights, its all-reduce included."""

    def __init__(self, fn, weights, rank: int, tp_size: int):
        super().__init__()
        self.fn, self.weights, self.rank, self.tp_size = fn, weights, rank, tp_size

    def forward(self, x, cos, sin, kv_cache, meta, backend, validate=True):
        return self.fn(x, self.weights, cos, sin, kv_cache, meta, self.rank, self.tp_size,
                       torch.distributed.all_reduce)


class _ReducedMLP(torch.nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x, fused: bool = False):
        return _all_reduce(self.mlp(x, fused))


def use_rank_attention(model: TinyLlama, fn, weights: list, rank: int, tp_size: int) -> None:
    """Make rank ``rank``'s shard ``model`` compute each layer's attention with ``fn``
    (chapter 12's exercise 12.3: ``fn(x, weights[layer], cos, sin, kv_cache, meta, rank,
    tp_size, all_reduce)``, the all-reduce inside it) instead of its shard's ``Attention``;
    the MLPs keep their shards and their all-reduce."""
    for layer, w in zip(model.layers, weights, strict=True):
        layer.self_attn = _RankAttention(fn, w, rank, tp_size)
        layer.mlp = _ReducedMLP(layer.mlp)
    model.all_reduce = None


def _worker_main(rank: int, world_size: int, init_method: str, dist_backend: str,
                 device: str, cfg, state: dict, num_blocks: int, max_blocks: int | None,
                 block_size: int, num_cpu_blocks: int, attention_backend: str,
                 timeout: float, conn, attention=None) -> None:
    """One rank: load its shard, agree on the pool, then run steps until told to stop."""
    from paged_lib.engine.model_runner import ModelRunner, allocate_kv_caches

    dist = torch.distributed
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group(dist_backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        model = TinyLlama(cfg)
        model.load_state_dict(state)
        model = model.to(device).eval()
        model.all_reduce = _all_reduce
        if attention is not None:  # (fn, whole weights per layer): chapter 12's 12.3
            use_rank_attention(model, attention[0], attention[1], rank, world_size)
        block_bytes = kv_cache_bytes(allocate_kv_caches(model, 1, block_size, "meta"))
        can_hold = min(num_blocks, _blocks_that_fit(model.device, block_bytes))
        if max_blocks is not None:
            can_hold = min(can_hold, max_blocks)
        agreed = torch.tensor([can_hold], dtype=torch.int64,
                              device=device if dist_backend == "nccl" else "cpu")
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        runner = ModelRunner(model, int(agreed), block_size, num_cpu_blocks,
                             attention_backend)
        conn.send(("ready", int(agreed), kv_cache_bytes(runner.kv_caches)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            step = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            break
        if step is None:
            break
        try:
            if isinstance(step, tuple):  # ("kv_block", layer, block): this rank's share
                _, layer, block = step
                k, v = runner.kv_caches[layer]
                conn.send(("ok", k[block].cpu().numpy(), v[block].cpu().numpy()))
                continue
            logits = runner.execute(step)
            conn.send(("ok", logits.cpu().numpy() if rank == 0 else None))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            break
    dist.destroy_process_group()
    conn.close()
    # leave now: tearing torch down at interpreter exit can take seconds on a busy CPU,
    # and the driver waits for the exit code (0: this rank stopped cleanly)
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shutdown(processes: list, conns: list) -> None:
    """Ask every worker to stop, then make sure it has (terminate, then kill)."""
    for c in conns:
        try:
            c.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 15.0  # a clean exit takes well under a second
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()
    for c in conns:
        c.close()


class TensorParallelRunner:
    """The driver's side of ``tensor_parallel_size`` workers; same ``execute`` as
    :class:`~paged_lib.engine.model_runner.ModelRunner`.

    ``num_blocks`` is what the engine asks for; :attr:`num_blocks` is what the ranks
    agreed to (at most that: the smallest number any rank can hold).
    ``max_blocks_per_rank`` caps what each rank says it can hold (``None``: no cap), e.g.
    to watch the agreement. ``rank_attention`` (a picklable function with
    :func:`paged_lib.parallel.rank_attention`'s signature) replaces each rank's attention,
    over the layers' whole weights (:func:`use_rank_attention`).
    :attr:`kv_cache_bytes_per_rank` is measured by each rank on its own caches.
    """

    def __init__(self, model: TinyLlama, num_blocks: int, block_size: int,
                 num_cpu_blocks: int = 0, backend: str = "torch",
                 tensor_parallel_size: int = 2, *,
                 max_blocks_per_rank: list[int | None] | None = None,
                 timeout: float = DEFAULT_TIMEOUT, rank_attention=None):
        cfg = model.config
        check_tp_size(cfg, tensor_parallel_size)
        tp = tensor_parallel_size
        limits = [None] * tp if max_blocks_per_rank is None else list(max_blocks_per_rank)
        if len(limits) != tp:
            raise ValueError(f"max_blocks_per_rank needs one entry per rank ({tp}), "
                             f"got {len(limits)}")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        local_cfg = shard_config(cfg, tp)
        state = model.state_dict()
        if model.device.type == "cuda":
            count = torch.cuda.device_count()
            devices = [f"cuda:{r % count}" for r in range(tp)]
            dist_backend = "nccl" if count >= tp else "gloo"
        else:
            devices, dist_backend = ["cpu"] * tp, "gloo"
        self.tensor_parallel_size = tp
        self.block_size = block_size
        self.timeout = float(timeout)
        self.dist_backend = dist_backend
        self.processes: list = []
        self.conns: list = []
        self._finalizer = weakref.finalize(self, _shutdown, self.processes, self.conns)
        attention = None if rank_attention is None else (
            rank_attention, [AttentionWeights.of(layer.self_attn) for layer in model.layers])
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        start = time.perf_counter()
        for rank in range(tp):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, name=f"paged-lib-tp-rank-{rank}", daemon=True,
                            args=(rank, tp, init_method, dist_backend, devices[rank],
                                  local_cfg, shard_state_dict(state, cfg, tp, rank),
                                  num_blocks, limits[rank], block_size, num_cpu_blocks,
                                  backend, self.timeout, child, attention))
            p.start()
            child.close()
            self.processes.append(p)
            self.conns.append(parent)
        replies = self._gather("start")
        #: seconds from the first spawn until every rank had its caches
        self.startup_seconds = time.perf_counter() - start
        self.num_blocks: int = replies[0][0]
        if self.num_blocks < 1:
            self.close()
            raise RuntimeError(f"the ranks agreed on {self.num_blocks} blocks: one of them "
                               "cannot hold a single block of KV cache")
        self.kv_cache_bytes_per_rank: list[int] = [r[1] for r in replies]
        self.vocab_size = cfg.vocab_size
        #: bytes of each step's message to each rank (block tables, tokens, copies)
        self.sent_bytes: list[int] = []

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._finalizer()

    def execute(self, step: ModelInput) -> torch.Tensor:
        """Logits ``[num_scheduled_seqs, vocab_size]`` (fp32) from rank 0, after every rank
        ran the step on its shard (the step's :class:`ModelInput` is what is broadcast)."""
        if self.closed:
            raise RuntimeError("the tensor-parallel workers are closed")
        message = bytes(ForkingPickler.dumps(step))
        self.sent_bytes.append(len(message))
        for rank, c in enumerate(self.conns):
            try:
                c.send_bytes(message)
            except OSError as e:
                self.close()
                raise RuntimeError(f"tensor-parallel rank {rank} is gone ({e}); the "
                                   "workers were stopped") from None
        logits = self._gather("step")[0][0]
        if step.is_empty():
            return torch.empty(0, self.vocab_size)
        return torch.from_numpy(logits)

    def kv_block(self, layer: int, block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each rank's K and V of physical block ``block`` in ``layer``, ``[block_size,
        its KV heads, head_dim]`` (rank order): the same block id on every rank."""
        if self.closed:
            raise RuntimeError("the tensor-parallel workers are closed")
        for c in self.conns:
            c.send(("kv_block", int(layer), int(block)))
        return [(torch.from_numpy(k), torch.from_numpy(v))
                for k, v in self._gather(f"kv_block({layer}, {block})")]

    def _gather(self, what: str) -> list[tuple]:
        """Every rank's reply, in rank order; a failed, dead or silent rank stops all, and
        so does an interrupt (a late reply must never be read as the next step's)."""
        try:
            return self._wait_replies(what)
        except BaseException:
            self.close()
            raise

    def _dead_ranks(self, besides: int, grace: float = 1.0) -> list[tuple[int, int | None]]:
        """``(rank, exit code)`` of the ranks other than ``besides`` that died (exited
        with a non-zero code: killed, or crashed without a word; a rank that reported
        its own error exits with 0), waiting up to ``grace`` seconds for one to be reaped
        (a killed rank's sockets close, and its peers notice, a moment before its exit
        is seen)."""
        deadline = time.monotonic() + grace
        while True:
            dead = [(r, p.exitcode) for r, p in enumerate(self.processes)
                    if r != besides and not p.is_alive() and p.exitcode not in (0, None)]
            if dead or time.monotonic() > deadline:
                return dead
            for r, p in enumerate(self.processes):
                if r != besides:
                    p.join(0.05)

    def _wait_replies(self, what: str) -> list[tuple]:
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + self.timeout
        while len(replies) < len(self.conns):
            pending = [c for r, c in enumerate(self.conns) if r not in replies]
            for c in wait(pending, timeout=0.2):
                rank = self.conns.index(c)
                try:
                    kind, *body = c.recv()
                except (EOFError, OSError):  # it died without a word
                    self.processes[rank].join(1.0)
                    code = self.processes[rank].exitcode
                    self.close()
                    raise RuntimeError(f"tensor-parallel rank {rank} exited (code {code}) "
                                       f"during {what}; the workers were stopped") from None
                if kind == "error":
                    # a rank that died makes the others' all-reduce fail: name the dead
                    # one, whichever the driver hears from first
                    dead = self._dead_ranks(besides=rank)
                    self.close()
                    if dead:
                        raise RuntimeError(
                            f"tensor-parallel rank {dead[0][0]} exited (code {dead[0][1]}) "
                            f"during {what}, so rank {rank}'s collective failed; the workers "
                            "were stopped")
                    raise RuntimeError(f"tensor-parallel rank {rank} failed during {what}; "
                                       f"the workers were stopped. Its traceback:\n{body[0]}")
                replies[rank] = tuple(body)
            for rank, p in enumerate(self.processes):
                if rank not in replies and not p.is_alive() and not self.conns[rank].poll():
                    self.close()
                    raise RuntimeError(f"tensor-parallel rank {rank} exited (code "
                                       f"{p.exitcode}) during {what}; the workers were "
                                       "stopped")
            if time.monotonic() > deadline:
                silent = [r for r in range(len(self.conns)) if r not in replies]
                self.close()
                raise RuntimeError(f"no answer from tensor-parallel rank(s) {silent} within "
                                   f"{self.timeout:.0f} s during {what}; the workers were "
                                   "stopped")
        return [replies[r] for r in range(len(self.conns))]


def kv_cache_bytes_per_rank(runner) -> list[int]:
    """Bytes of (GPU) KV cache per rank of a ``ModelRunner`` (one rank) or a
    :class:`TensorParallelRunner`."""
    if isinstance(runner, TensorParallelRunner):
        return list(runner.kv_cache_bytes_per_rank)
    return [kv_cache_bytes(runner.kv_caches)]


__all__ = ["DEFAULT_TIMEOUT", "TensorParallelRunner", "kv_cache_bytes",
           "kv_cache_bytes_per_rank", "start_tensor_parallel", "use_rank_attention"]


def start_tensor_parallel(model: TinyLlama, num_blocks: int, block_size: int,
                          num_cpu_blocks: int, backend: str, tensor_parallel_size: int, *,
                          build_metadata=None, kv_cache_dtype: str = "auto"
                          ) -> TensorParallelRunner:
    """The engine's runner for ``tensor_parallel_size`` ranks; options that cannot run on
    the workers raise ``ValueError`` naming them before any process starts."""
    from paged_lib.engine import model_runner

    if build_metadata is not None and build_metadata is not model_runner.build_metadata:
        raise ValueError("build_metadata: a replacement cannot run with "
                         "tensor_parallel_size > 1 (the workers are separate processes and "
                         "use the library's)")
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported with "
                         "tensor_parallel_size > 1 (each rank would quantise its own heads "
                         "with its own scales)")
    if not isinstance(model, TinyLlama):
        raise ValueError(f"tensor_parallel_size > 1 shards a TinyLlama, got "
                         f"{type(model).__name__}")
    check_tp_size(model.config, tensor_parallel_size)
    return TensorParallelRunner(model, num_blocks, block_size, num_cpu_blocks, backend,
                                tensor_parallel_size)
