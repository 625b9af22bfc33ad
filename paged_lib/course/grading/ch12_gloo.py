"""Chapter 12's exercise 12.3 on two real ranks (re-exported by
:mod:`paged_lib.course.grading.ch12`).

After the generated steps pass with the all-reduce replayed in this process
(:mod:`paged_lib.course.grading.ch12_rank`), the learner's ``rank_attention`` is sent to two
spawned processes that join a ``gloo`` process group (``torch.distributed`` on CPU, as the
tensor-parallel engine's ranks do). Each runs the 2-rank steps with the real all-reduce, then
serves as the attention of every layer of the shipped model's rank shard
(:func:`paged_lib.engine.tensor_parallel.use_rank_attention`) while the ranks replay every
model call a single-device engine made on a workload with prefix caching, chunked prefill,
samples and swaps; rank 0's logits must be the single-device engine's at every step.
"""

from __future__ import annotations

import copy
import functools
import importlib.machinery
import multiprocessing as mp
import pickle
import socket
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from paged_lib.course import grading
from paged_lib.course.grading.ch12_rank import (
    Step,
    _copies,
    check_generated,
    compare,
    replayed,
    share,
    steps,
)
from paged_lib.parallel import AttentionWeights

__all__ = ["ENGINE", "check_rank_attention", "engine_calls", "on_gloo_ranks", "shipped"]

#: seconds the grader waits for the two gloo ranks
GLOO_TIMEOUT = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shipped(fn: Callable) -> tuple[str, Any]:
    """``fn`` in a form a spawned process can rebuild: by reference when its module can be
    imported there, else its source with the imports and helpers it uses
    (:func:`paged_lib.course.mine.section_text`: a notebook's ``__main__`` is not)."""
    module = getattr(fn, "__module__", "__main__")
    if module != "__main__" and "<locals>" not in getattr(fn, "__qualname__", "<locals>"):
        if _importable(module):
            try:
                return "pickle", pickle.dumps(fn)
            except Exception:  # noqa: BLE001 - not picklable: try the source
                pass
        path = getattr(sys.modules.get(module), "__file__", None)
        if path:  # a module loaded from its file (mine/ch12.py): the file travels
            text = Path(path).read_text()
            if fn.__name__ != "rank_attention":
                text += f"\nrank_attention = {fn.__name__}\n"
            return "source", text
    from paged_lib.course import mine

    return "source", mine.section_text(fn, "rank_attention")


def _importable(module: str) -> bool:
    """Can a spawned process import ``module`` by name (pickle's way of sending a function)?"""
    try:  # looked up on sys.path, not in sys.modules (mine/ch12.py is loaded by file)
        return importlib.machinery.PathFinder.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _rebuilt(kind: str, body: Any) -> Callable:
    if kind == "pickle":
        return pickle.loads(body)
    space: dict[str, Any] = {"__name__": "your_rank_attention"}
    exec(compile(body, "<your rank_attention>", "exec"), space)  # noqa: S102
    return space["rank_attention"]


#: the engine whose model calls are replayed on the ranks: the shipped model, prefix
#: caching, chunks of 12 tokens, samples, swaps on a pool of 14 blocks of 4
ENGINE = dict(num_blocks=14, block_size=4, num_cpu_blocks=32, preemption="swap",
              enable_prefix_caching=True, enable_chunked_prefill=True,
              max_num_batched_tokens=12, max_num_seqs=4, watermark=0)


@functools.cache
def engine_calls() -> list[tuple[Any, torch.Tensor]]:
    """(ModelInput, logits) of every step a single-device engine ran on a small workload."""
    from paged_lib.engine import LLMEngine, SamplingParams
    from paged_lib.model import load_tiny_code_llama
    from paged_lib.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    head = "def area(w, h):\n    "
    prompts = [tok.encode(head + t) for t in ("return w * h", "# the area", "pass")]
    params = [SamplingParams(max_tokens=6, temperature=0.0),
              SamplingParams(max_tokens=5, temperature=0.8, n=2, seed=3),
              SamplingParams(max_tokens=7, temperature=0.0)]
    engine = LLMEngine(load_tiny_code_llama(), **ENGINE)
    calls, execute = [], engine.runner.execute

    def record(inp):
        logits = execute(inp)
        calls.append((pickle.loads(pickle.dumps(inp)), logits.clone()))
        return logits

    engine.runner.execute = record
    engine.generate(prompts, params)
    return calls


def _gloo_rank(rank: int, port: int, fn: tuple[str, Any], todo: bytes, conn) -> None:
    """One rank: ``fn`` on every generated step, then in the shipped model's every layer for
    every recorded engine step; answers as plain pickled bytes (tensors by value, not
    through shared memory that vanishes with the process)."""
    from paged_lib.engine.model_runner import ModelRunner
    from paged_lib.engine.tensor_parallel import use_rank_attention
    from paged_lib.model import TinyLlama, load_tiny_code_llama
    from paged_lib.parallel import shard_config, shard_state_dict

    dist = torch.distributed
    try:
        torch.set_num_threads(1)
        generated, inputs = pickle.loads(todo)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=timedelta(seconds=GLOO_TIMEOUT // 3))
        theirs = _rebuilt(*fn)

        def learner(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce):  # on copies
            return theirs(x.clone(), copy.deepcopy(w), cos.clone(), sin.clone(), kv_cache,
                          copy.deepcopy(meta), rank, tp, all_reduce)
        out = []
        for step in generated:
            cache = share(step, rank)
            y = learner(*_copies(step), cache, copy.deepcopy(step.meta), rank, 2,
                        lambda t: dist.all_reduce(t))
            out.append((y, cache))
        full = load_tiny_code_llama()
        model = TinyLlama(shard_config(full.config, 2))
        model.load_state_dict(shard_state_dict(full.state_dict(), full.config, 2, rank))
        use_rank_attention(model.eval(), learner,
                           [AttentionWeights.of(layer.self_attn) for layer in full.layers],
                           rank, 2)
        runner = ModelRunner(model, ENGINE["num_blocks"], ENGINE["block_size"],
                             ENGINE["num_cpu_blocks"], "torch")
        with torch.no_grad():
            logits = [runner.execute(inp) for inp in inputs]
        conn.send_bytes(pickle.dumps(("ok", (out, logits))))
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - told to the driver, then the rank ends
        tb = traceback.extract_tb(err.__traceback__)
        line = next((f" (in your code: `{f.line}`)" for f in reversed(tb)
                     if f.filename == "<your rank_attention>" or "ipykernel" in f.filename), "")
        conn.send_bytes(pickle.dumps(("error", f"{type(err).__name__}: {err}{line}")))


def on_gloo_ranks(fn: Callable, todo: list[Step], inputs: list) -> list[tuple]:
    """``fn`` on two spawned gloo ranks: each rank's (results per generated step, logits
    per engine step)."""
    try:
        body = shipped(fn)
    except Exception as err:  # noqa: BLE001 - mine.CannotSave and the like
        grading.fail(f"your function cannot be sent to the rank processes: {err}",
                     "define rank_attention with def at the top of its cell; it may use "
                     "imports, constants and functions of the notebook")
    ctx, port = mp.get_context("spawn"), _free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_gloo_rank, daemon=True, args=(
        r, port, body, pickle.dumps((todo, inputs)), pipes[r][1])) for r in range(2)]
    try:
        for p in procs:
            p.start()
    except Exception as err:  # noqa: BLE001 - the check's machinery, not the learner's code
        for p in procs:
            if p.is_alive():
                p.kill()
        grading.fail(f"the check could not start its two rank processes ({type(err).__name__}"
                     f": {err}); this is not your function", "run the check from a notebook, "
                     "or from a script whose checks sit under `if __name__ == \"__main__\":` "
                     "(each rank process is started with multiprocessing's spawn)")
    replies = []
    try:
        for rank, (recv, _) in enumerate(pipes):
            if not recv.poll(GLOO_TIMEOUT):
                grading.fail(f"on two gloo ranks: rank {rank} did not answer within "
                             f"{GLOO_TIMEOUT} s", "each rank calls all_reduce once per layer; "
                             "a rank that waits for a sum the other never sends hangs")
            kind, body = pickle.loads(recv.recv_bytes())
            if kind == "error":
                grading.fail(f"on two gloo ranks: rank {rank} raised {body}",
                             "the function runs in a fresh process on each rank: it may use "
                             "only its arguments (the all_reduce it is given), imports and "
                             "the notebook's functions and constants")
            replies.append(body)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return replies


def _compare_engine(calls: list, logits: list[torch.Tensor]) -> None:
    for k, ((inp, want), got) in enumerate(zip(calls, logits, strict=True)):
        if got.shape == want.shape and torch.allclose(got, want, 1e-3, 1e-3):
            continue
        s = int((got - want).abs().amax(1).argmax()) if got.shape == want.shape else 0
        new = inp.query_lens[s]
        grading.fail(
            f"serving a workload on two gloo ranks with your attention in every layer of the "
            f"shipped model (prefix caching, chunked prefill, samples, swaps): at engine step "
            f"{k + 1}, sequence {s} ({new} new token{'s' if new > 1 else ''} at positions "
            f"{inp.seq_lens[s] - new} to {inp.seq_lens[s] - 1}): the single-device engine's "
            f"next token is {int(want[s].argmax())}, yours {int(got[s].argmax())} (largest "
            f"logit difference {float((got[s] - want[s]).abs().max()):.3g})",
            "the generated steps pass, the engine's do not: compare this step's state (its "
            "block table, a prefill that starts mid-sequence) with the steps above")


def _in_a_rank_bootstrapping() -> bool:
    """True in a process that spawn started and that is still importing the parent's
    main module (a learner's script with no ``__main__`` guard runs its checks again
    there; starting ranks from it is what multiprocessing calls "before the current
    process has finished its bootstrapping phase")."""
    return mp.parent_process() is not None and bool(
        getattr(mp.current_process(), "_inheriting", False))


def check_rank_attention(fn: Callable[..., torch.Tensor]) -> None:
    """12.3: one rank's attention layer, its all-reduce included."""
    if _in_a_rank_bootstrapping():
        return  # a script re-imported by a spawned rank: the parent prints the verdict
    with grading.exercise("12.3"):
        all_steps = steps()
        for step in all_steps:
            try:
                results = replayed(fn, step)
            except (grading.CheckFailed, NotImplementedError):
                raise
            except Exception as err:  # noqa: BLE001 - told with the step that raised it
                grading.fail(f"step '{step.name}': your function raised "
                             f"{type(err).__name__}: {err}", step.hint)
            compare(step, results, "")
        check_generated(fn)
        two = [s for s in all_steps if s.tp == 2]
        calls = engine_calls()
        replies = on_gloo_ranks(fn, two, [inp for inp, _ in calls])
        for i, step in enumerate(two):
            compare(step, [replies[r][0][i] for r in range(2)], "on two gloo ranks, ")
        _compare_engine(calls, replies[0][1])


