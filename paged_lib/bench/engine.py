"""The engine benchmark: one model, one trace, one KV budget, three ways to serve it.

    python -m paged_lib.bench engine [--requests 48] [--num-blocks 120] [--block-size 8]
                                     [--max-len 160] [--threads 1] [--backend cpu]
                                     [--repeats 3]

(a) our paged engine (continuous batching, blocks on demand), (b) our static batching
(contiguous ``max_len`` slots, a batch runs until its longest request ends), (c)
transformers' ``generate`` in batches of as many requests as fit in the budget at
``max_len`` each (the same batches as (b)). Every system produces exactly the trace's
output lengths (``ignore_eos``). Reported: steps, generated tokens per second (medians of
``--repeats`` runs in one process), and both as ratios to the engine; where the engine's
time per step goes (:func:`step_breakdown`); and the engine's own overhead per step
without the model (scheduling, block bookkeeping, building the metadata tensors) for 64
running sequences.

The model is the course's shipped ``tiny-code-llama`` when present, else a random tiny
Llama. Wall-clock numbers depend on the machine; steps do not. ``--model
SmolLM2-135M-Instruct`` serves a real chat model against transformers instead, with its
own options (:mod:`paged_lib.bench.engine_chat`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from paged_lib.bench.floor import (
    StepRecorder,
    decode_step_lines,
    measure_machine,
    weight_bytes,
)
from paged_lib.engine.block_manager import BlockManager
from paged_lib.engine.llm_engine import LLMEngine
from paged_lib.engine.model_runner import build_metadata
from paged_lib.engine.scheduler import Scheduler
from paged_lib.engine.sequence import SamplingParams, SequenceGroup
from paged_lib.engine.sequence import Sequence as Seq
from paged_lib.engine.static_batching import StaticBatchingEngine
from paged_lib.engine.trace import trace_requests
from paged_lib.kernels.backends import resolve_backend
from paged_lib.model import TINY_CODE_LLAMA_DIR, TinyLlama
from paged_lib.workloads import alpaca_like


def load_models(random_model: bool = False):
    """(TinyLlama, the same weights as a transformers model or None, a name)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:  # pragma: no cover - transformers is a test dependency
        LlamaForCausalLM = None
    if not random_model and (TINY_CODE_LLAMA_DIR / "config.json").is_file():
        model = TinyLlama.from_pretrained(TINY_CODE_LLAMA_DIR)
        hf = LlamaForCausalLM.from_pretrained(TINY_CODE_LLAMA_DIR).float().eval() \
            if LlamaForCausalLM else None
        return model, hf, "tiny-code-llama"
    if LlamaForCausalLM is None:  # pragma: no cover
        raise RuntimeError("no shipped model and no transformers to build a random one")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=264, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)).eval()
    return TinyLlama.from_hf(hf), hf, "random tiny Llama"


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``fn()``. On a shared machine the
    CPU time is the steadier number; on a quiet one they agree (1 thread)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def run_hf(hf, prompts: list[list[int]], out_lens: list[int], batch_size: int) -> None:
    """transformers serves the trace in static batches of ``batch_size``."""
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            batch, lens = prompts[i:i + batch_size], out_lens[i:i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            hf.generate(ids, attention_mask=mask, max_new_tokens=max(lens),
                        min_new_tokens=max(lens), do_sample=False, eos_token_id=None,
                        pad_token_id=0)


def scheduling_overhead_ms(num_seqs: int = 64, prompt_len: int = 100, steps: int = 50,
                           block_size: int = 16) -> float:
    """Median milliseconds per decode step of schedule + metadata + update, no model.

    The median of ``steps`` timed steps, so a busy machine's worst moments do not count.
    """
    bm = BlockManager(num_seqs * (prompt_len + steps + block_size) // block_size + 1,
                      block_size)
    sched = Scheduler(bm, max_num_seqs=num_seqs, max_num_batched_tokens=10**9)
    for i in range(num_seqs):
        sched.add(SequenceGroup(i, [Seq(i, [1] * prompt_len)],
                                SamplingParams(max_tokens=steps + 2, ignore_eos=True,
                                               temperature=0.0)))
    out = sched.schedule()  # the prefill step is not what we time
    sched.update(out, [[(1, 0.0)]] * len(out.scheduled), None)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = sched.schedule()
        seqs = [s.seq for s in out.scheduled]
        build_metadata([s.block_table.blocks for s in seqs], [s.num_tokens for s in seqs],
                       [s.num_new_tokens for s in out.scheduled], block_size)
        sched.update(out, [[(1, 0.0)]] * len(out.scheduled), None)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run(num_requests: int = 48, num_blocks: int = 120, block_size: int = 8,
        max_len: int = 160, random_model: bool = False, with_hf: bool = True,
        backend: str | None = None, repeats: int = 3) -> dict:
    """Serve one trace three ways, each ``repeats`` times in this process; rows of
    (system, steps, median wall seconds, median CPU seconds, tokens/s).

    ``backend``: the engine's attention backend; ``None`` is the engine's default,
    ``"auto"`` (the compiled decode kernel where it builds, else ``"torch"``; Triton on a
    GPU), and the report names the one that ran. Static batching keeps ``"torch"``.
    """
    machine = measure_machine()  # this run's floor: bandwidth and matmul rate now
    model, hf, name = load_models(random_model)
    backend = resolve_backend(backend or "auto", model.device)
    trace = alpaca_like(num_requests, seed=0, max_len=max_len)
    prompts, params = trace_requests(trace, model.config.vocab_size)
    out_lens = [r.output_len for r in trace]
    tokens = sum(out_lens)
    static = StaticBatchingEngine(model, num_blocks, block_size, max_len)
    engines, recorders = [], []

    def serve() -> None:
        engine = LLMEngine(model, num_blocks, block_size, attention_backend=backend)
        recorders.append(StepRecorder(engine))
        engine.generate(prompts, params)
        engines.append(engine)

    times = _median_timed(serve, repeats)
    rows = [("paged engine", engines[-1].stats.steps, *times)]
    times = _median_timed(lambda: static.generate(prompts, params), repeats)
    rows.append(("static batching", static.stats.steps, *times))
    if with_hf and hf is not None:
        hf_steps = sum(max(out_lens[i:i + static.num_slots])
                       for i in range(0, len(out_lens), static.num_slots))
        rows.append(("transformers generate", hf_steps, *_median_timed(
            lambda: run_hf(hf, prompts, out_lens, static.num_slots), repeats)))
    engine = engines[-1]
    return {"model": name, "tokens": tokens, "num_slots": static.num_slots,
            "backend": backend, "repeats": repeats,
            "peak_batch": engine.stats.peak_batch_size, "preemptions": engine.stats.preemptions,
            "rows": [{"system": s, "steps": st, "seconds": sec, "cpu_seconds": cpu,
                      "tokens_per_s": tokens / sec, "tokens_per_cpu_s": tokens / cpu}
                     for s, st, sec, cpu in rows],
            "breakdown": step_breakdown(model, prompts, params, num_blocks, block_size, backend),
            "overhead_ms": scheduling_overhead_ms(), "machine": machine,
            "trace_floor": recorders[-1].floor(model.config, machine),
            "weight_bytes": weight_bytes(model.config),
            "decode_steps": decode_step_lines(model, machine, context=64, backend=backend,
                                              measure=measure_machine)}


def _median_timed(fn, repeats: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds of ``repeats`` runs of ``fn``."""
    runs = [_timed(fn) for _ in range(max(1, repeats))]
    return statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)


def step_breakdown(model, prompts, params, num_blocks: int, block_size: int,
                   backend: str) -> dict[str, float]:
    """Where one engine run's wall time goes, in milliseconds per step: scheduling
    (``schedule`` + ``update``), the model input, the model (block moves, metadata,
    forward and logits), sampling, and the rest (stats, the loop), as the engine's own
    :attr:`EngineStats.phase_seconds` measure them."""
    engine = LLMEngine(model, num_blocks, block_size, attention_backend=backend)
    total = _timed(lambda: engine.generate(prompts, params))[0]
    steps = engine.stats.steps
    out = {part: 1e3 * sec / steps for part, sec in engine.stats.phase_seconds.items()}
    out["other"] = 1e3 * total / steps - sum(out.values())
    return out


def format_report(res: dict, args) -> str:
    base = res["rows"][0]
    lines = [f"engine benchmark: {res['model']}, {args.requests} Alpaca-like requests "
             f"({res['tokens']} generated tokens), KV budget {args.num_blocks} blocks x "
             f"{args.block_size} tokens, max_len {args.max_len} "
             f"({res['num_slots']} static slots), torch threads {torch.get_num_threads()}, "
             f"engine attention backend '{res['backend']}', median of {res['repeats']} "
             "run(s) each",
             f"{'system':<24}{'steps':>7}{'wall s':>8}{'cpu s':>8}{'tok/s':>7}"
             f"{'tok/cpu-s':>10}{'x/engine steps':>16}{'engine speed-up':>17}"
             f"{'(cpu)':>7}"]
    for r in res["rows"]:
        lines.append(f"{r['system']:<24}{r['steps']:>7}{r['seconds']:>8.1f}"
                     f"{r['cpu_seconds']:>8.1f}{r['tokens_per_s']:>7.0f}"
                     f"{r['tokens_per_cpu_s']:>10.0f}{r['steps'] / base['steps']:>15.2f}x"
                     f"{base['tokens_per_s'] / r['tokens_per_s']:>16.2f}x"
                     f"{base['tokens_per_cpu_s'] / r['tokens_per_cpu_s']:>6.2f}x")
    lines.append(f"paged engine: peak batch {res['peak_batch']} sequences, "
                 f"{res['preemptions']} preemptions")
    parts = res["breakdown"]
    lines.append("paged engine, ms per step: " + ", ".join(
        f"{part} {ms:.2f}" for part, ms in parts.items())
        + f" (total {sum(parts.values()):.2f})")
    hf = next((r for r in res["rows"] if r["system"] == "transformers generate"), None)
    if hf is not None:
        lead = base["tokens_per_s"] / hf["tokens_per_s"]
        lines.append(f"goal: engine >= 2x transformers, wall clock: {lead:.2f}x "
                     f"{'met' if lead >= 2 else 'NOT met'}")
    lines.append(f"engine overhead per decode step, 64 running sequences, no model: "
                 f"{res['overhead_ms']:.2f} ms (goal < 1 ms)")
    f = res["trace_floor"]
    lines += [f"floor: {res['machine'].describe()}",
              f"paged engine over the trace: {base['seconds']:.2f} s wall; the floor of its "
              f"{base['steps']} steps {1e3 * f.seconds:.1f} ms ({f.bytes / 1e6:.0f} MB read, "
              f"{f.flops / 1e6:.0f} MFLOP): {f.ratio(base['seconds']):.1f}x the floor (its "
              f"{res['weight_bytes'] / 1e6:.0f} MB of weights fit in the CPU's caches, "
              "which read faster than memory: for so small a model the floor is a yardstick, "
              "not a bound)",
              *res["decode_steps"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    if any(a == "--model" or a.startswith("--model=") for a in argv):
        from paged_lib.bench import engine_chat  # a real chat model: its own trace and systems

        return engine_chat.main(argv)
    p = argparse.ArgumentParser(prog="python -m paged_lib.bench engine",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a real chat model instead (SmolLM2-135M-Instruct): "
                   "python -m paged_lib.bench engine --model SmolLM2-135M-Instruct --help")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--num-blocks", type=int, default=120)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=160)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--random-model", action="store_true", help="ignore the shipped model")
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    p.add_argument("--backend", choices=["auto", "cpu", "torch", "triton"], default=None,
                   help="the engine's attention backend (default: the engine's 'auto', the C "
                        "kernel where it builds)")
    p.add_argument("--repeats", type=int, default=3, help="runs per system (median)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run(args.requests, args.num_blocks, args.block_size, args.max_len,
              args.random_model, not args.no_hf, args.backend, args.repeats)
    print(format_report(res, args))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
