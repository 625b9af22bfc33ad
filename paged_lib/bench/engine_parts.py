"""Where the paged engine's time goes on the chat benchmark's trace, part by part.

    python -m paged_lib.bench.engine_parts [--threads 1] [--requests 32] [--max-tokens 160]
        [--backend auto] [--layers-apart]

Serves :mod:`paged_lib.bench.engine_chat`'s trace with the engine only (after one untimed
warm-up) and times, around each call, the model forward and inside it the layers' linear
maps, the decode attention, the cache writes, the prefill attention, the RMSNorms and the
rotary embedding (with ``backend="cpu"``, whose C loops do the rotation with the cache
write, each residual add with the norm after it, and SwiGLU's activation, each as one
part: :mod:`paged_lib.kernels.cpu_layer`; what is left, the untimed rest: the
embedding, the rotation angles, and the timers' own cost), and after it the
LM head (on each sequence's last token): wall seconds and the CPU seconds of the calling
thread, each part indented under the part it ran inside. Run it at
``--threads 1`` and ``2`` to see which parts gain from a second thread; on shared cores
repeat it (wall clocks there are noisy, the calling thread's CPU seconds less so).
Each part is printed beside its floor (:mod:`paged_lib.bench.floor`, this machine's
bandwidth and matmul rate measured first): the least time its bytes or FLOPs allow.
With ``backend="cpu"`` a decode step's layers are one C call
(:func:`paged_lib.kernels.cpu_layer.decode_layers`), timed as one part ("decode layers");
``--layers-apart`` runs those layers step by step instead, so the parts above show inside
decode steps too (at the cost of the calls between them).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import nn

from paged_lib import model as model_module
from paged_lib.bench.engine_chat import chat_trace, run_engine
from paged_lib.bench.floor import measure_machine
from paged_lib.engine.llm import load_model
from paged_lib.kernels import cpu_layer
from paged_lib.models import smollm2

#: (owner, attribute, part) of each timed function. A part called while another runs is
#: that one's child: the layers' linear maps sit inside "model forward", the LM head's own
#: linear map inside "LM head" (which runs after the forward, on last tokens only).
#: Serving runs under no_grad, where the model's linear maps are ``model.linear`` on
#: stacked, prepacked weights (:mod:`paged_lib.kernels.cpu_linear`); with gradients on
#: they are the ``nn.Linear`` modules. Both count as "linear maps".
PARTS = ((model_module.TinyLlama, "forward", "model forward"),
         (model_module.TinyLlama, "compute_logits", "LM head"),
         (model_module, "linear", "linear maps"),
         (nn.Linear, "forward", "linear maps"),
         (model_module, "paged_attention", "decode attention"),
         (model_module, "write_kv", "cache writes"),
         (model_module, "paged_prefill", "prefill attention"),
         (model_module.RMSNorm, "forward", "RMSNorm"),
         (model_module, "apply_rope", "RoPE"),
         # backend="cpu": the same steps as one C pass each (paged_lib.kernels.cpu_layer)
         (cpu_layer, "rope_and_write", "RoPE and cache writes"),
         (cpu_layer, "rms_norm", "RMSNorm"),
         (cpu_layer, "add_rms_norm", "residual add and RMSNorm"),
         (cpu_layer, "silu_mul", "SwiGLU activation"),
         (cpu_layer, "decode_layers", "decode layers"))

#: The clocks read around each call: wall seconds and the calling thread's CPU seconds.
CLOCKS = (time.perf_counter, time.thread_time)


@contextlib.contextmanager
def timed_parts(acc: dict, clocks=CLOCKS):
    """Wrap each of :data:`PARTS` to add its ``[wall s, thread CPU s, calls]`` to ``acc``,
    keyed by its path: ``("model forward", "linear maps")`` for a linear map run inside the
    forward, ``("LM head", "linear maps")`` for the head's. A child's clocks are read inside
    its parent's, so no child is ever reported longer than its parent, and a time counted
    in a child is not counted again beside it (:func:`rows` gives each parent's rest).
    ``clocks`` (two callables) are there for tests that drive the accounting by hand."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in PARTS]
    stack: list[str] = []

    def wrap(fn, part):
        @functools.wraps(fn)  # the model sees through it (its __wrapped__) to the library's
        def timed(*args, **kwargs):
            stack.append(part)
            path = tuple(stack)
            start = [clock() for clock in clocks]
            try:
                return fn(*args, **kwargs)
            finally:
                row = acc[path]
                for i, clock in enumerate(clocks):
                    row[i] += clock() - start[i]
                row[2] += 1
                stack.pop()
        return timed

    try:
        for (owner, name, fn), (_, _, part) in zip(saved, PARTS, strict=True):
            setattr(owner, name, wrap(fn, part))
        yield acc
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def rows(parts: dict) -> list[tuple[tuple[str, ...], float, float, int]]:
    """``(path, wall, cpu, calls)`` in tree order (each parent before its children), and
    after the children of each part that has some, the part's own rest:
    ``path + ("rest",)`` with the parent's time less its timed children's (calls 0)."""
    out = []

    def visit(prefix: tuple[str, ...]):
        kids = sorted((p for p in parts if len(p) == len(prefix) + 1 and p[:-1] == prefix),
                      key=lambda p: -parts[p][0])
        for path in kids:
            wall, cpu, calls = parts[path]
            out.append((path, wall, cpu, calls))
            grandkids = [q for q in parts if len(q) == len(path) + 1 and q[:-1] == path]
            visit(path)
            if grandkids:
                out.append((path + ("rest",), wall - sum(parts[q][0] for q in grandkids),
                            cpu - sum(parts[q][1] for q in grandkids), 0))

    visit(())
    return out


def run(threads: int = 1, num_requests: int = 32, max_tokens: int = 160,
        num_blocks: int = 96, block_size: int = 16, backend: str = "auto",
        layers_apart: bool = False) -> dict:
    torch.set_num_threads(threads)
    machine = measure_machine()  # the floor: this machine's bandwidth and FLOP/s now
    model, tokenizer = load_model(smollm2.NAME)
    model.decode_layers_in_one_call = not layers_apart
    questions, lens = chat_trace(num_requests, max_tokens)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in questions]
    run_engine(model, [prompts[0][:8]], [2], num_blocks, block_size, backend, False, 2048)
    acc: dict = defaultdict(lambda: [0.0, 0.0, 0])
    recorders: list = []
    with timed_parts(acc):
        wall, cpu = time.perf_counter(), time.process_time()
        tokens, engine = run_engine(model, prompts, lens, num_blocks, block_size, backend,
                                    False, 2048, recorders)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"threads": threads, "backend": engine.attention_backend, "wall": wall,
            "cpu": cpu, "tokens": sum(map(len, tokens)), "steps": engine.stats.steps,
            "parts": {path: tuple(row) for path, row in acc.items()}, "machine": machine,
            "floor": recorders[-1].floor(model.config, machine).seconds,
            "part_floors": recorders[-1].part_floors(  # decode steps' layers fused or not
                model.config, machine, any(p[-1] == "decode layers" for p in acc))}


def format_parts(res: dict) -> str:
    """The run's line, then every part indented under the part it ran inside, each
    parent's untimed ``rest`` after its children."""
    floors = floor_lines(res)
    lines = [f"paged engine, {res['tokens']} tokens in {res['steps']} steps, torch threads "
             f"{res['threads']}, attention backend '{res['backend']}': wall {res['wall']:.2f}"
             f" s, process CPU {res['cpu']:.2f} s" + floors.get((), "")]
    for path, wall, cpu, calls in rows(res["parts"]):
        name = "  " * len(path) + (path[-1] if path[-1] != "rest" else "rest (untimed)")
        count = f", {calls} calls" if calls else ""
        lines.append(f"{name:<29} wall {wall:6.2f} s ({100 * wall / res['wall']:4.1f}%), "
                     f"calling thread's CPU {cpu:6.2f} s{floors.get(path, '')}{count}")
    return "\n".join(lines)


def floor_lines(res: dict) -> dict:
    """Each part's floor (:mod:`paged_lib.bench.floor`) beside its calling thread's CPU
    time (a wall clock on shared cores counts other processes' turns), by path; and the
    whole run's under ``()``."""
    floors = res.get("part_floors", {})
    out = {(): f"; floor: {res['machine'].describe()}, the run's steps at best "
               f"{res['floor']:.2f} s: wall {res['wall'] / res['floor']:.2f}x, process CPU "
               f"per thread {res['cpu'] / res['threads'] / res['floor']:.2f}x"} \
        if "floor" in res else {}
    for path, (_, cpu, _) in res["parts"].items():
        part = "LM head" if path == ("LM head",) else path[-1]
        if part in floors and (part != "linear maps" or path[0] == "model forward"):
            out[path] = f" ({cpu / floors[part]:.2f}x its floor {floors[part]:.2f} s)"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paged_lib.bench.engine_parts",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--backend", choices=["auto", "cpu", "torch"], default="auto")
    p.add_argument("--layers-apart", action="store_true",
                   help="backend='cpu': run a decode step's layers step by step, not as one "
                        "C call each, to time their parts")
    args = p.parse_args(argv)
    print(format_parts(run(args.threads, args.requests, args.max_tokens,
                           backend=args.backend, layers_apart=args.layers_apart)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
