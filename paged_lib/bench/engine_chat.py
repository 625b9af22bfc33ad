"""The engine benchmark on a real chat model: SmolLM2-135M-Instruct, three ways to serve it.

    python -m paged_lib.bench engine --model SmolLM2-135M-Instruct [--requests 32]
        [--num-blocks 96] [--block-size 16] [--max-tokens 160] [--threads 1] [--repeats 1]
        [--watermark 0.01] [--preemption recompute|swap --cpu-blocks N] [--no-decode-steps]

One chat trace: ``--requests`` questions, each rendered with the model's chat template
(ChatML, its default system prompt), each with its own ``max_tokens`` (Alpaca-like
lengths, :func:`paged_lib.workloads.alpaca_like`, at most ``--max-tokens``), greedy,
stopping at ``<|im_end|>`` as a chat server does, so output lengths are mixed twice over.
Served by

(a) this course's paged engine (:class:`~paged_lib.engine.llm_engine.LLMEngine`, the
    model loaded by :mod:`paged_lib.models.smollm2`, as ``LLM("SmolLM2-135M-Instruct")``
    does), with ``--num-blocks`` blocks of ``--block-size`` tokens;
(b) transformers' ``generate`` on padded batches (left padding, an attention mask), in
    trace order, of as many requests as the same KV budget holds at the trace's longest
    possible sequence (longest prompt + ``--max-tokens``); a batch runs until its last
    request ends;
(c) transformers' own continuous batching (the manager behind ``generate_batch``: its
    scheduler and its paged KV cache, attention ``sdpa`` on a CPU), each request with its
    own ``max_new_tokens``, with pages of ``--block-size`` tokens and ``--num-blocks`` of
    them: the same KV bytes as (a), checked and printed. Block sharing (its prefix
    cache) is off, as the engine's is (``--prefix-caching`` turns both on).

transformers reads the same GGUF file (``from_pretrained(..., gguf_file=...)``: its own
dequantisation), so the three run the same weights, in fp32. The bench checks that every
request's greedy tokens are the same in all three (so they did the same work) and says
which differ if any do. Wall clock and CPU time of this process, each system run
``--repeats`` times (median), after one untimed warm-up of each; torch threads are set
explicitly (``--threads``, default 1: steadier than 2 on small CPUs, where other work
on the cores stalls every matmul's OpenMP threads). The engine's time part by part (linear
maps, LM head, attention, cache writes): ``python -m paged_lib.bench.engine_parts``.

The floor (:mod:`paged_lib.bench.floor`): the run first measures this machine's memory
bandwidth and fp32 matmul rate, then prints the engine's time over the trace beside the
least time its own steps could take (weights and K/V read, FLOPs done), and a decode
step at batch 1, 8 and 32 beside its floor, with how many tokens preemption made the
engine compute again (``--watermark``, ``--preemption swap --cpu-blocks N`` to compare).

The defaults are vLLM's (recompute, watermark 0.01), kept after measuring the others on
this trace (SmolLM2, two threads, 2 cores, 2026-12-05): recompute 11.4-11.6 s with 14
preemptions and 726 of 3,625 computed tokens recomputed; watermark 0.05: 10 preemptions,
510 recomputed, 11.2 s; swap with 96 CPU blocks: nothing recomputed, 102 blocks swapped,
10.7 s, but only by giving the engine twice the KV memory the other two systems get.
Every variant gave the same 32 greedy completions.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from paged_lib.bench.floor import StepRecorder, decode_step_lines, measure_machine
from paged_lib.engine.llm import load_model
from paged_lib.engine.llm_engine import LLMEngine
from paged_lib.engine.sequence import SamplingParams
from paged_lib.models import smollm2
from paged_lib.workloads import alpaca_like

TASKS = ("Explain {}.", "Write a short poem about {}.", "Give three facts about {}.",
         "Describe {} to a child.", "What are the pros and cons of {}?",
         "Write a tweet about {}.", "Summarise the history of {} in two sentences.",
         "List five words related to {}.")
SUBJECTS = ("the water cycle", "hash tables", "the moon", "photosynthesis", "bicycles",
            "the French revolution", "volcanoes", "coffee", "recursion", "the ocean",
            "honey bees", "electric cars", "the Roman empire", "prime numbers", "jazz",
            "rainbows")


def chat_trace(num_requests: int, max_tokens: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """``num_requests`` distinct questions (a task and a subject, drawn from ``seed``) and
    each one's ``max_tokens`` (Alpaca-like output lengths, clipped to ``max_tokens``)."""
    pairs = [(t, s) for t in TASKS for s in SUBJECTS]
    if num_requests > len(pairs):
        raise ValueError(f"at most {len(pairs)} distinct questions, asked for {num_requests}")
    order = np.random.default_rng(seed).permutation(len(pairs))[:num_requests]
    questions = [pairs[i][0].format(pairs[i][1]) for i in order]
    lens = [min(r.output_len, max_tokens) for r in alpaca_like(num_requests, seed=seed)]
    return questions, lens


def load_hf(weights: str | Path = "gguf", attn_implementation: str = "sdpa"):
    """transformers' Llama with SmolLM2's weights, fp32: from the packaged GGUF file
    (``"gguf"``: transformers' own reading of it), or from a Hugging Face-format folder
    (the converted cache, ``smollm2.cache_folder()``: the same numbers, read in a second)."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.disable_progress_bar()
    try:
        if str(weights) == "gguf":
            path = smollm2.gguf_path()
            with contextlib.redirect_stderr(io.StringIO()):  # its dequantising progress bar
                return AutoModelForCausalLM.from_pretrained(
                    path.parent, gguf_file=path.name, dtype=torch.float32,
                    attn_implementation=attn_implementation).eval()
        return AutoModelForCausalLM.from_pretrained(
            weights, dtype=torch.float32, attn_implementation=attn_implementation).eval()
    finally:
        transformers.logging.enable_progress_bar()


def until_stop(ids: list[int], max_tokens: int, eos: int) -> list[int]:
    """A completion as a request sees it: at most ``max_tokens``, ending at its EOS."""
    ids = list(ids[:max_tokens])
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def run_engine(model, prompts, lens, num_blocks, block_size, backend, prefix_caching,
               max_batched, recorders: list | None = None, **engine_options):
    """Serve the trace with the paged engine; ``recorders`` (a list) gets a
    :class:`~paged_lib.bench.floor.StepRecorder` of the run's steps appended."""
    engine = LLMEngine(model, num_blocks, block_size, attention_backend=backend,
                       max_model_len=max_batched, max_num_batched_tokens=max_batched,
                       enable_prefix_caching=prefix_caching, **engine_options)
    if recorders is not None:
        recorders.append(StepRecorder(engine))
    outs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0)
                                     for n in lens])
    return [o.outputs[0].token_ids for o in outs], engine


def run_generate(hf, prompts, lens, batch_size, eos):
    """transformers ``generate``, padded batches of ``batch_size`` in trace order."""
    tokens = []
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            batch, want = prompts[i:i + batch_size], lens[i:i + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([[eos] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(want),
                              do_sample=False, eos_token_id=eos, pad_token_id=eos)
            tokens += [until_stop(row[width:].tolist(), n, eos)
                       for row, n in zip(out, want, strict=True)]
    return tokens, None


def cb_config(num_blocks: int, block_size: int, prefix_caching: bool, max_batched: int,
              max_seqs: int):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks,
                                    max_batch_tokens=max_batched, max_requests_per_batch=max_seqs,
                                    allow_block_sharing=prefix_caching, max_memory_percent=0.9)


def run_continuous(hf, prompts, lens, eos, config):
    """transformers' continuous batching: ``generate_batch``'s manager, each request with
    its own ``max_new_tokens`` (``generate_batch`` takes one for all)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=eos,
                           max_new_tokens=max(lens))
    results = {}
    manager = hf.init_continuous_batching(generation_config=gen,
                                          continuous_batching_config=config)
    loop, threads = manager._run_generation_loop, torch.get_num_threads()

    def loop_with_our_threads(**kwargs):
        # The manager runs the model in a thread of its own, whose OpenMP team is the
        # default size (every core), not torch.set_num_threads' of the main thread: on
        # shared cores that thread ran 3-5x slower. Same threads as the engine's.
        torch.set_num_threads(threads)
        return loop(**kwargs)

    manager._run_generation_loop = loop_with_our_threads
    manager.start()  # what generate_batch's context manager does, without the warm-up
    try:
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=eos)
               for p, n in zip(prompts, lens, strict=True)]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped early")
        cache = manager.batch_processor.cache
    finally:
        manager.stop(block=True)
        manager.destroy()
    failed = [r for r in results.values() if r.error is not None]
    if failed:
        raise RuntimeError(f"transformers' continuous batching failed {failed[0].request_id}: "
                           f"{failed[0].error}")
    kv_bytes = cache.num_sectors * cache.bytes_per_sector
    return [until_stop(results[i].generated_tokens, n, eos)
            for i, n in zip(ids, lens, strict=True)], {"kv_bytes": kv_bytes,
                                                      "pages": cache.num_blocks}


def timed(fn, repeats: int):
    """Median (wall, CPU) seconds of ``repeats`` runs of ``fn`` and its last result."""
    runs = []
    for _ in range(max(1, repeats)):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        runs.append((time.perf_counter() - wall, time.process_time() - cpu, result))
    return (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
            runs[-1][2])


def first_difference(a: list[list[int]], b: list[list[int]]) -> str | None:
    """Where two systems' tokens first differ (request and position), or ``None``."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            at = next((k for k, (s, t) in enumerate(zip(x, y, strict=False)) if s != t),
                      min(len(x), len(y)))
            return (f"request {i} differs at token {at} ({len(x)} vs {len(y)} tokens: "
                    f"{x[at:at + 3]} vs {y[at:at + 3]})")
    return None


def run(model_name: str = smollm2.NAME, num_requests: int = 32, num_blocks: int = 96,
        block_size: int = 16, max_tokens: int = 160, repeats: int = 1,
        backend: str = "auto", prefix_caching: bool = False, hf_weights: str | Path = "gguf",
        max_batched: int = 2048, max_seqs: int = 256, decode_steps: bool = True,
        **engine_options) -> dict:
    """Serve one chat trace three ways; rows of (system, tokens, wall s, CPU s), the
    token checks, the KV budgets, the engine's time per phase, and the floor
    (:mod:`paged_lib.bench.floor`): of the engine's own steps over the trace (the machine
    measured first), and of a decode step at batch 1, 8 and 32 (``decode_steps``; the
    machine measured again right before each of three timings), each beside the time.
    ``engine_options`` go to the engine (``watermark``, ``preemption``, ``num_cpu_blocks``:
    how the trace's preemptions are served)."""
    machine = measure_machine()  # this run's floor: bandwidth and matmul rate now
    model, tokenizer = load_model(model_name)
    model = model.to("cpu")
    eos = model.config.eos_token_id
    questions, lens = chat_trace(num_requests, max_tokens)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in questions]
    hf = load_hf(hf_weights)
    longest = max(map(len, prompts)) + max_tokens
    batch_size = max(1, num_blocks * block_size // longest)
    config = cb_config(num_blocks, block_size, prefix_caching, max_batched, max_seqs)
    recorders: list = []
    systems = {
        "paged engine": lambda p, n: run_engine(model, p, n, num_blocks, block_size, backend,
                                                prefix_caching, max_batched, recorders,
                                                **engine_options),
        "transformers generate": lambda p, n: run_generate(hf, p, n, batch_size, eos),
        "transformers generate_batch": lambda p, n: run_continuous(hf, p, n, eos, config)}
    rows, tokens, extra = [], {}, {}
    for name, serve in systems.items():
        serve([prompts[0][:8]], [2])  # warm-up: first-call costs are not serving
        wall, cpu, (toks, info) = timed(lambda s=serve: s(prompts, lens), repeats)
        tokens[name], extra[name] = toks, info
        rows.append({"system": name, "tokens": sum(map(len, toks)), "seconds": wall,
                     "cpu_seconds": cpu})
    engine = extra["paged engine"]
    steps = engine.stats.steps
    phases = {part: 1e3 * s / steps for part, s in engine.stats.phase_seconds.items()}
    base = tokens["paged engine"]
    trace_floor = recorders[-1].floor(model.config, machine)
    return {"machine": machine, "trace_floor": trace_floor,
            "recomputed": engine.stats.recomputed_tokens,
            "computed": sum(engine.stats.computed_tokens),
            "swapped_blocks": engine.stats.swapped_blocks,
            "engine_options": engine_options,
            "decode_steps": decode_step_lines(model, machine, backend=backend,
                                              measure=measure_machine) if decode_steps else [],
            "model": model_name, "requests": num_requests, "rows": rows,
            "prompt_tokens": sum(map(len, prompts)), "max_tokens": max_tokens,
            "lens": lens, "batch_size": batch_size, "longest": longest,
            "threads": torch.get_num_threads(), "backend": engine.attention_backend,
            "kv_engine": engine.kv_cache_bytes_per_rank[0], "num_blocks": num_blocks,
            "block_size": block_size, "kv_cb": extra["transformers generate_batch"],
            "engine_steps": steps, "peak_batch": engine.stats.peak_batch_size,
            "preemptions": engine.stats.preemptions, "phases_ms": phases,
            "ended_at_eos": sum(t[-1:] == [eos] for t in base),
            "same": {name: sum(a == b for a, b in zip(base, toks, strict=True))
                     for name, toks in tokens.items() if name != "paged engine"},
            "differences": {name: first_difference(base, toks)
                            for name, toks in tokens.items() if name != "paged engine"},
            "prefix_caching": prefix_caching, "repeats": repeats}


def format_report(res: dict) -> str:
    mib = 2**20
    rows, base = res["rows"], res["rows"][0]
    lines = [
        f"engine benchmark: {res['model']} (fp32), {res['requests']} chat requests "
        f"({res['prompt_tokens']} prompt tokens through the chat template; max_tokens "
        f"{min(res['lens'])}-{max(res['lens'])}, greedy, stopping at EOS: "
        f"{res['ended_at_eos']} did), torch threads {res['threads']}, engine attention "
        f"backend '{res['backend']}', prefix caching {'on' if res['prefix_caching'] else 'off'}"
        f", median of {res['repeats']} run(s) each, wall clock",
        f"KV memory: engine {res['num_blocks']} blocks x {res['block_size']} tokens = "
        f"{res['kv_engine'] / mib:.1f} MiB; transformers generate_batch "
        f"{res['kv_cb']['pages']} pages x {res['block_size']} tokens = "
        f"{res['kv_cb']['kv_bytes'] / mib:.1f} MiB; transformers generate: padded batches "
        f"of {res['batch_size']} (the same budget at {res['longest']} tokens each)",
        f"{'system':<30}{'tokens':>7}{'wall s':>8}{'cpu s':>8}{'tok/s':>8}{'tok/cpu-s':>10}"
        f"{'engine speed-up':>17}{'(cpu)':>7}"]

    def lead(r: dict, time: str = "seconds") -> float:  # engine tok/s over r's
        return base["tokens"] / base[time] / (r["tokens"] / r[time])

    for r in rows:
        lines.append(f"{r['system']:<30}{r['tokens']:>7}{r['seconds']:>8.1f}"
                     f"{r['cpu_seconds']:>8.1f}{r['tokens'] / r['seconds']:>8.1f}"
                     f"{r['tokens'] / r['cpu_seconds']:>10.1f}{lead(r):>16.2f}x"
                     f"{lead(r, 'cpu_seconds'):>6.2f}x")
    for r in rows[1:]:
        lines.append(f"ratio engine / {r['system'].removeprefix('transformers ')}: "
                     f"{lead(r):.2f}x tok/s wall clock ({lead(r, 'cpu_seconds'):.2f}x per "
                     "CPU second)")
    goal = lead(rows[1])
    lines.append(f"goal: engine >= 2x transformers generate, wall clock: {goal:.2f}x "
                 f"{'met' if goal >= 2 else 'NOT met'}")
    for name, same in res["same"].items():
        diff = res["differences"][name]
        lines.append(f"greedy tokens, engine = {name}: {same}/{res['requests']} requests"
                     + ("" if diff is None else f"; first difference: {diff}"))
    parts = res["phases_ms"]
    lines.append(f"paged engine: {res['engine_steps']} steps, peak batch {res['peak_batch']}, "
                 f"{res['preemptions']} preemptions ({res['recomputed']} of "
                 f"{res['computed']} computed tokens recomputed, {res['swapped_blocks']} "
                 "blocks swapped" + "".join(f", {k}={v}" for k, v in
                                             res["engine_options"].items())
                 + "); ms per step: " + ", ".join(
                     f"{part} {ms:.1f}" for part, ms in parts.items())
                 + f" (total {sum(parts.values()):.1f})")
    lines += floor_lines(res, base)
    return "\n".join(lines)


def floor_lines(res: dict, base: dict) -> list[str]:
    """The machine's measured rates, the floor of the engine's own steps over the trace
    beside its time, and each decode step's line."""
    f = res["trace_floor"]
    return [f"floor: {res['machine'].describe()}",
            f"paged engine over the trace: {base['seconds']:.2f} s wall, {base['cpu_seconds']:.2f}"
            f" s CPU; the floor of its {res['engine_steps']} steps {f.seconds:.2f} s "
            f"({f.bytes / 1e9:.1f} GB read, {f.flops / 1e9:.0f} GFLOP): "
            f"{f.ratio(base['seconds']):.2f}x the floor "
            f"({f.ratio(base['cpu_seconds'] / res['threads']):.2f}x by CPU time per thread)",
            *res["decode_steps"]]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paged_lib.bench engine --model NAME",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=smollm2.NAME, choices=smollm2.NAMES)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=96)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=160, help="the longest max_tokens")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--backend", choices=["auto", "cpu", "torch"], default="auto",
                   help="the engine's attention backend")
    p.add_argument("--prefix-caching", action="store_true",
                   help="the engine's prefix cache and transformers' block sharing on")
    p.add_argument("--hf-weights", default="gguf",
                   help="'gguf' (transformers reads the packaged file) or a model folder")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per system (median)")
    p.add_argument("--watermark", type=float, default=None,
                   help="the engine's admission watermark (fraction of the pool; default: "
                        "the engine's)")
    p.add_argument("--preemption", choices=["recompute", "swap"], default=None,
                   help="how the engine preempts (default: the engine's)")
    p.add_argument("--cpu-blocks", type=int, default=0,
                   help="CPU blocks for --preemption swap")
    p.add_argument("--no-decode-steps", action="store_true",
                   help="skip timing decode steps at batch 1, 8 and 32")
    args = p.parse_args(argv)
    if args.preemption == "swap" and args.cpu_blocks < 1:
        p.error("--preemption swap needs --cpu-blocks N (N > 0) to swap into")
    torch.set_num_threads(args.threads)
    options = {k: v for k, v in (("watermark", args.watermark),
                                 ("preemption", args.preemption),
                                 ("num_cpu_blocks", args.cpu_blocks or None)) if v is not None}
    res = run(args.model, args.requests, args.num_blocks, args.block_size, args.max_tokens,
              args.repeats, args.backend, args.prefix_caching, args.hf_weights,
              decode_steps=not args.no_decode_steps, **options)
    print(format_report(res))
    return 0 if all(n == res["requests"] for n in res["same"].values()) else 1
