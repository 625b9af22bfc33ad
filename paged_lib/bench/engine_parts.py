"""Where the paged engine's time goes on the chat benchmark's trace, part by part.

    python -m paged_lib.bench.engine_parts [--threads 1] [--requests 32] [--max-tokens 160]
        [--backend auto]

Serves :mod:`paged_lib.bench.engine_chat`'s trace with the engine only (after one untimed
warm-up) and times, around each call, the model forward and inside it the layers' linear
maps, the LM head, the decode attention, the cache writes and the prefill attention: wall
seconds and the CPU seconds of the calling thread. The LM head runs after the forward
(on each sequence's last token) and is one of the linear maps too. Run it at
``--threads 1`` and ``2`` to see which parts gain from a second thread; on shared cores
repeat it (wall clocks there are noisy, the calling thread's CPU seconds less so).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import nn

from paged_lib import model as model_module
from paged_lib.bench.engine_chat import chat_trace, run_engine
from paged_lib.engine.llm import load_model
from paged_lib.models import smollm2

#: (owner, attribute, part) of each timed function.
PARTS = ((model_module.TinyLlama, "forward", "model forward"),
         (nn.Linear, "forward", "linear maps (LM head too)"),
         (model_module.TinyLlama, "compute_logits", "LM head"),
         (model_module, "paged_attention", "decode attention"),
         (model_module, "reshape_and_cache", "cache writes"),
         (model_module, "paged_prefill", "prefill attention"))


@contextlib.contextmanager
def timed_parts(acc: dict):
    """Wrap each of :data:`PARTS` to add its ``[wall s, thread CPU s, calls]`` to ``acc``."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in PARTS]

    def wrap(fn, part):
        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                row = acc[part]
                row[0] += time.perf_counter() - wall
                row[1] += time.thread_time() - cpu
                row[2] += 1
        return timed

    try:
        for (owner, name, fn), (_, _, part) in zip(saved, PARTS, strict=True):
            setattr(owner, name, wrap(fn, part))
        yield acc
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def run(threads: int = 1, num_requests: int = 32, max_tokens: int = 160,
        num_blocks: int = 96, block_size: int = 16, backend: str = "auto") -> dict:
    torch.set_num_threads(threads)
    model, tokenizer = load_model(smollm2.NAME)
    questions, lens = chat_trace(num_requests, max_tokens)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in questions]
    run_engine(model, [prompts[0][:8]], [2], num_blocks, block_size, backend, False, 2048)
    acc: dict = defaultdict(lambda: [0.0, 0.0, 0])
    with timed_parts(acc):
        wall, cpu = time.perf_counter(), time.process_time()
        tokens, engine = run_engine(model, prompts, lens, num_blocks, block_size, backend,
                                    False, 2048)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"threads": threads, "backend": engine.attention_backend, "wall": wall,
            "cpu": cpu, "tokens": sum(map(len, tokens)), "steps": engine.stats.steps,
            "parts": {part: tuple(acc[part]) for _, _, part in PARTS}}


def format_parts(res: dict) -> str:
    lines = [f"paged engine, {res['tokens']} tokens in {res['steps']} steps, torch threads "
             f"{res['threads']}, attention backend '{res['backend']}': wall {res['wall']:.2f}"
             f" s, process CPU {res['cpu']:.2f} s"]
    for part, (wall, cpu, calls) in res["parts"].items():
        lines.append(f"  {part:<27} wall {wall:6.2f} s ({100 * wall / res['wall']:4.1f}%), "
                     f"calling thread's CPU {cpu:6.2f} s, {calls} calls")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paged_lib.bench.engine_parts",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--backend", choices=["auto", "cpu", "torch"], default="auto")
    args = p.parse_args(argv)
    print(format_parts(run(args.threads, args.requests, args.max_tokens,
                           backend=args.backend)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
