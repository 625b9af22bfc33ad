"""Serving under load, shaped like ``vllm bench serve`` (chapter 14; the paper's §6.2).

    python -m paged_lib.bench serve [--request-rate 4] [--num-prompts 40] [--seed 0]
                                    [--reservation paged|orca-max|orca-pow2|orca-oracle]
                                    [--num-blocks 64] [--block-size 16] [--threads 1]
    python -m paged_lib.bench serve --sweep --rates 1 2 4 8 --output fig12.json
    python -m paged_lib.bench serve --base-url http://127.0.0.1:8000 [--request-rate 4 ...]

Requests arrive as a Poisson process at ``--request-rate`` per second (seeded), with
ShareGPT-like lengths (:func:`paged_lib.workloads.sharegpt_like`, synthetic) divided by
4 (the tiny model's 512 positions hold the paper's 2048; :func:`make_load`) and exactly that
many output tokens each (``ignore_eos``, greedy). They are served in real time by the
engine in this process: one loop adds each request when the wall clock passes its
arrival, steps the engine while anything is unfinished, and stamps every token when the
step that made it returns (the server's engine loop, :mod:`paged_lib.serve.async_engine`,
without HTTP in the way). Latencies count from the scheduled arrival, as a client would.
With ``--base-url`` the same load goes over HTTP to a running server instead
(:mod:`paged_lib.bench.serve_http`; a streamed chunk is stamped in place of a token).

With ``--clock cpu`` the loop keeps its own clock instead: each step advances it by the CPU
time the step took (this thread's), and an idle loop jumps to the next arrival. On a
machine shared with others, whose load stretches the wall clock but not this thread's CPU
time, that gives the times the engine would show on a machine of its own, and a sweep
does not wait for arrivals. The stored sweep (:data:`FIG12_JSON`) uses it.

Reported as vLLM does: request throughput, output token throughput, TTFT (to the first
token), TPOT (the rest of the tokens, per token, per request), ITL (every gap between two
tokens), each mean / median / p99 in ms; and the paper's **normalised latency**: a
request's end-to-end latency divided by its output length, averaged over requests (s/token,
the y axis of the paper's Fig. 12).

``--sweep`` serves the same trace at several rates under each of the four reservation
policies (:mod:`paged_lib.engine.reservation`) and writes the results as JSON; chapter 14
reads a stored one (:data:`FIG12_JSON`) and finds the highest rate each sustains.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from paged_lib.bench.load import LoadRequest, Served
from paged_lib.engine.llm_engine import LLMEngine
from paged_lib.engine.reservation import RESERVATIONS
from paged_lib.engine.sequence import SamplingParams
from paged_lib.model import load_tiny_code_llama
from paged_lib.workloads import sharegpt_like, shrink

#: The sweep chapter 14 draws (tiny-code-llama on 2 CPU cores); regenerate with
#: :data:`FIG12_COMMAND`.
FIG12_JSON = Path(__file__).resolve().parent.parent / "data" / "fig12_tiny.json"
FIG12_COMMAND = ("python -m paged_lib.bench serve --sweep --clock cpu --num-prompts 100 "
                 "--num-blocks 64 --rates 2 4 6 8 12 16 24 "
                 "--output paged_lib/data/fig12_tiny.json")


def make_load(num_prompts: int, request_rate: float, seed: int = 0, scale: int = 4,
              max_len: int = 512, vocab: int = 256) -> list[LoadRequest]:
    """ShareGPT-like lengths divided by ``scale`` (so a request fits ``max_len``), random
    byte prompts and Poisson arrivals at ``request_rate`` per second, all from ``seed``."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 requests/s, got {request_rate}")
    trace = shrink(sharegpt_like(num_prompts, seed=seed, max_len=max_len * scale), scale)
    rng = np.random.default_rng(seed + 1)
    arrivals = np.cumsum(rng.exponential(1.0 / request_rate, size=num_prompts))
    out = []
    for r, t in zip(trace, arrivals, strict=True):
        p = min(r.prompt_len, max_len - 1)
        o = max(1, min(r.output_len, max_len - p))
        out.append(LoadRequest(rng.integers(0, vocab, size=p).tolist(), o, float(t)))
    return out


def serve_load(engine: LLMEngine, load: list[LoadRequest], *, clock: str = "wall",
               timeout: float = 600.0) -> tuple[list[Served], float]:
    """Serve ``load`` on ``engine``; returns what each request saw and the duration (first
    arrival to last token, s).

    ``clock="wall"``: in real time (the loop sleeps until the next arrival). ``"cpu"``: on
    a clock that advances by the CPU time this thread spends in each step and jumps over
    idle gaps: the times a machine of its own would show, for a machine shared with others
    (their load slows the wall clock, not this thread's CPU time), and no waiting."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    served = [Served(r.arrival, r.output_len) for r in load]
    live: dict[int, object] = {}
    seen: dict[int, int] = {}
    order = sorted(range(len(load)), key=lambda i: load[i].arrival)
    nxt, start, virtual = 0, time.perf_counter(), 0.0
    while nxt < len(order) or live:
        if time.perf_counter() - start > timeout:
            raise RuntimeError(f"the load did not finish in {timeout} s")
        now = virtual if clock == "cpu" else time.perf_counter() - start
        while nxt < len(order) and served[order[nxt]].arrival <= now:
            i = order[nxt]
            params = SamplingParams(max_tokens=load[i].output_len, temperature=0.0,
                                    ignore_eos=True)
            group = engine.add_request(i, load[i].prompt, params)
            if group.error is not None:
                served[i].error = group.error
            else:
                live[i], seen[i] = group, 0
            nxt += 1
        if not live:
            if clock == "cpu":
                virtual = max(virtual, served[order[nxt]].arrival)
            else:
                time.sleep(max(0.0, served[order[nxt]].arrival - now))
            continue
        cpu = time.thread_time()
        engine.step()
        virtual += time.thread_time() - cpu
        stamp = virtual if clock == "cpu" else time.perf_counter() - start
        for i in list(live):
            group = live[i]
            made = len(group.seqs[0].output_token_ids)
            served[i].token_times += [stamp] * (made - seen[i])
            seen[i] = made
            if group.is_finished():
                del live[i]
    ends = [s.token_times[-1] for s in served if s.token_times]
    first = min((s.arrival for s in served), default=0.0)
    return served, (max(ends, default=first) - first)


def _summary(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    return {"mean": float(np.mean(xs)), "median": float(statistics.median(xs)),
            "p99": float(np.percentile(xs, 99))}


def metrics(served: list[Served], duration: float) -> dict:
    """vLLM's serving metrics (ms) and the paper's normalised latency (s/token)."""
    done = [s for s in served if s.error is None and s.token_times]
    ttft = [1e3 * (s.token_times[0] - s.arrival) for s in done]
    tpot = [1e3 * (s.token_times[-1] - s.token_times[0]) / (s.output_len - 1)
            for s in done if s.output_len > 1]
    itl = [1e3 * (b - a) for s in done for a, b in itertools.pairwise(s.token_times)]
    norm = [(s.token_times[-1] - s.arrival) / s.output_len for s in done]
    tokens = sum(s.output_len for s in done)
    return {"completed": len(done), "failed": sum(s.error is not None for s in served),
            "duration_s": duration, "request_throughput": len(done) / duration if duration else 0,
            "output_token_throughput": tokens / duration if duration else 0.0,
            "ttft_ms": _summary(ttft), "tpot_ms": _summary(tpot), "itl_ms": _summary(itl),
            "normalized_latency_s": float(np.mean(norm)) if norm else float("nan")}


def make_engine(reservation: str = "paged", num_blocks: int = 64, block_size: int = 16,
                model=None) -> LLMEngine:
    """The tiny model's engine on a pool of ``num_blocks`` (64 x 16 = 1024 token slots:
    small enough that memory, not compute, limits the batch under the Orca policies)."""
    model = model if model is not None else load_tiny_code_llama()
    return LLMEngine(model, num_blocks, block_size, watermark=0.0, reservation=reservation,
                     max_num_batched_tokens=2048, max_model_len=512)


def bench(request_rate: float, num_prompts: int, reservation: str = "paged", seed: int = 0,
          num_blocks: int = 64, block_size: int = 16, model=None, clock: str = "wall") -> dict:
    """One run: the load at ``request_rate`` served under ``reservation``; its metrics."""
    engine = make_engine(reservation, num_blocks, block_size, model)
    served, duration = serve_load(engine, make_load(num_prompts, request_rate, seed),
                                  clock=clock)
    out = metrics(served, duration)
    out.update(request_rate=request_rate, reservation=reservation, num_prompts=num_prompts,
               clock=clock,
               seed=seed, num_blocks=num_blocks, block_size=block_size,
               peak_batch=max(engine.stats.batch_sizes, default=0),
               preemptions=engine.stats.preemptions,
               blocks_in_use_at_end=engine.block_manager.num_used_blocks)
    return out


def report(m: dict) -> str:
    """``vllm bench serve``'s result table, in its words."""
    lines = ["============ Serving Benchmark Result ============",
             f"{'Reservation:':<40}{m['reservation']:>10}",
             f"{'Request rate (req/s):':<40}{m['request_rate']:>10.2f}",
             f"{'Clock:':<40}{m.get('clock', 'wall'):>10}",
             f"{'Successful requests:':<40}{m['completed']:>10}",
             f"{'Failed requests:':<40}{m['failed']:>10}",
             f"{'Benchmark duration (s):':<40}{m['duration_s']:>10.2f}",
             f"{'Request throughput (req/s):':<40}{m['request_throughput']:>10.2f}",
             f"{'Output token throughput (tok/s):':<40}{m['output_token_throughput']:>10.2f}",
             f"{'Peak running requests:':<40}{m['peak_batch']:>10}"]
    for key, title in (("ttft_ms", "Time to First Token"),
                       ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency")):
        short = key.split("_")[0].upper()
        lines.append(f"{title:-^50}")
        for stat in ("mean", "median", "p99"):
            name = f"{stat.capitalize() if stat != 'p99' else 'P99'} {short} (ms):"
            lines.append(f"{name:<40}{m[key][stat]:>10.2f}")
    lines.append(f"{'Normalized latency':-^50}")
    lines.append(f"{'Mean latency / output length (s/tok):':<40}"
                 f"{m['normalized_latency_s']:>10.4f}")
    lines.append("=" * 50)
    return "\n".join(lines)


def sweep(rates: list[float], num_prompts: int, policies=RESERVATIONS, seed: int = 0,
          num_blocks: int = 64, block_size: int = 16, clock: str = "wall", log=print) -> dict:
    """Every policy at every rate (the same trace shape, new arrivals per rate); the
    policies take turns at each rate, so a machine's load that changes over the sweep
    falls on all of them alike."""
    model = load_tiny_code_llama()
    runs = []
    for rate in rates:
        for policy in policies:
            m = bench(rate, num_prompts, policy, seed, num_blocks, block_size, model, clock)
            log(f"{policy:>12} {rate:6.2f} req/s: normalised latency "
                f"{m['normalized_latency_s']:.4f} s/tok, {m['request_throughput']:.2f} req/s, "
                f"peak batch {m['peak_batch']}")
            runs.append(m)
    return {"model": "tiny-code-llama", "num_prompts": num_prompts, "seed": seed,
            "num_blocks": num_blocks, "block_size": block_size, "rates": list(rates),
            "policies": list(policies), "torch_threads": torch.get_num_threads(),
            "clock": clock,
            "command": sweep_command(rates, num_prompts, seed, num_blocks, block_size, clock),
            "runs": runs}


def sweep_command(rates, num_prompts, seed=0, num_blocks=64, block_size=16, clock="wall",
                  output="paged_lib/data/fig12_tiny.json") -> str:
    """The command line that runs this sweep."""
    return (f"python -m paged_lib.bench serve --sweep --clock {clock} --num-prompts "
            f"{num_prompts} --num-blocks {num_blocks} --rates "
            f"{' '.join(f'{r:g}' for r in rates)} "
            + (f"--seed {seed} " if seed else "")
            + (f"--block-size {block_size} " if block_size != 16 else "")
            + f"--output {output}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paged_lib.bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--request-rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reservation", choices=RESERVATIONS, default="paged")
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: real time; cpu: the step's CPU time, idle gaps skipped (for a "
                   "shared machine)")
    p.add_argument("--sweep", action="store_true", help="every policy at every --rates")
    p.add_argument("--rates", type=float, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--output", type=Path, help="write the result(s) as JSON here")
    p.add_argument("--base-url", help="send the load over HTTP to this running server (e.g. "
                   "http://127.0.0.1:8000; its own engine options apply) instead of "
                   "serving it in-process")
    p.add_argument("--model", help="with --base-url: the model name to ask for (default: "
                   "the first the server lists)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.base_url:
        if args.sweep:
            p.error("--sweep runs the engine in-process: leave out --base-url")
        from paged_lib.bench.serve_http import serve_load_http

        served, duration = serve_load_http(
            args.base_url, make_load(args.num_prompts, args.request_rate, args.seed),
            args.model)
        result = metrics(served, duration)
        result.update(request_rate=args.request_rate, reservation="(the server's)",
                      num_prompts=args.num_prompts, seed=args.seed, clock="wall",
                      peak_batch="n/a", base_url=args.base_url)
        print(report(result))
    elif args.sweep:
        result = sweep(args.rates, args.num_prompts, seed=args.seed,
                       num_blocks=args.num_blocks, block_size=args.block_size,
                       clock=args.clock)
    else:
        result = bench(args.request_rate, args.num_prompts, args.reservation, args.seed,
                       args.num_blocks, args.block_size, clock=args.clock)
        print(report(result))
    if args.output:
        args.output.write_text(json.dumps(result, indent=1, default=asdict) + "\n")
        print(f"wrote {args.output}")
    return 0
