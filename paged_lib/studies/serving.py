"""The paper's Fig. 12 (request rate at a latency bound), measured and modelled (chapter 14).

Two halves.

**Measured on this engine**: :func:`load_sweep` reads the JSON that
``python -m paged_lib.bench serve --sweep`` wrote (stored:
:data:`paged_lib.bench.serve.FIG12_JSON`); :func:`sustained_rates` finds, for each policy,
the highest request rate whose normalised latency stays under a bound, and
:func:`rate_ratios` sets paged's against each Orca's.

**Modelled for the paper's setting** (OPT-13B on one A100-40GB, ShareGPT lengths): a
*model*, not a measurement. :func:`step_seconds` prices one engine step from the bytes it
moves and the FLOPs it does (chapter 01's accounting; the A100's 1.555 TB/s and 312
TFLOP/s fp16, a roofline: the larger of the two times), and :func:`simulate_serving` runs
a discrete-event simulation of the engine's loop (Poisson arrivals in seconds, FCFS
admission, one token per running request per step, prompts prefilled in the step that
admits them) under the same four policies: ``paged`` takes blocks on demand and preempts
the newest request by recompute when the pool runs out; the Orcas reserve chapter 02's
length at admission, in blocks, and never preempt.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paged_lib.accounting import SPECS, ModelSpec, kv_bytes_per_token
from paged_lib.engine.reservation import RESERVATIONS, reserved_tokens
from paged_lib.util import cdiv
from paged_lib.workloads import sharegpt_like

# ------------------------------------------------------------------ measured (the JSON)


def load_sweep(path: str | Path) -> dict:
    """The sweep's JSON: ``{"runs": [...], ...}`` as written by ``bench serve --sweep``."""
    return json.loads(Path(path).read_text())


def curves(sweep: dict, key: str = "normalized_latency_s") -> dict[str, tuple[list, list]]:
    """policy -> (rates, ``key`` at each rate), rates ascending."""
    out: dict[str, tuple[list, list]] = {}
    for policy in sweep["policies"]:
        runs = sorted((r for r in sweep["runs"] if r["reservation"] == policy),
                      key=lambda r: r["request_rate"])
        out[policy] = ([r["request_rate"] for r in runs], [r[key] for r in runs])
    return out


def sustained_rate(rates: list[float], latencies: list[float], bound: float) -> float:
    """The highest rate at which the normalised latency stays at or under ``bound``, and
    at every lower rate too (0.0 if even the lowest is over)."""
    best = 0.0
    for rate, lat in sorted(zip(rates, latencies, strict=True)):
        if not lat <= bound:
            break
        best = rate
    return best


def sustained_rates(curve: dict[str, tuple[list, list]], bound: float) -> dict[str, float]:
    """policy -> :func:`sustained_rate` under ``bound``."""
    return {p: sustained_rate(r, lat, bound) for p, (r, lat) in curve.items()}


def rate_ratios(sustained: dict[str, float]) -> dict[str, float]:
    """Paged's sustained rate over each Orca policy's (``inf`` when that one sustains none
    of the rates tried)."""
    return {p: (sustained["paged"] / s if s else math.inf)
            for p, s in sustained.items() if p != "paged"}


# ------------------------------------------------------------------ modelled (OPT-13B)


@dataclass(frozen=True)
class Gpu:
    """What the step-time model needs of a GPU (spec sheet numbers)."""

    name: str
    bandwidth: float      # bytes/s of HBM
    flops: float          # dense fp16 FLOP/s
    memory: float         # bytes


A100_40GB = Gpu("A100-40GB", 1.555e12, 312e12, 40e9)

#: KV space for OPT-13B on the A100-40GB: the paper's Fig. 1 gives the parameters 26 GB
#: (65%) and the KV cache about 30% of 40 GB; the rest is activations.
OPT13B_KV_BYTES = 12e9


def step_seconds(spec: ModelSpec, gpu: Gpu, prefill_lens: list[int], decode_contexts: list[int]
                 ) -> float:
    """Modelled time of one step: prompts of ``prefill_lens`` tokens computed whole, and
    one decode token for each context length in ``decode_contexts``.

    Bytes: the weights once (2 bytes each), every decode's cached K/V read, every new
    token's K/V written. FLOPs: 2 per parameter per token, plus attention (QK^T and PV:
    4 x layers x hidden per (query, key) pair; a prompt attends causally). The step takes
    the larger of bytes / bandwidth and FLOPs / peak (a roofline; real kernels reach
    less of either, and launch overheads are left out).
    """
    kv = kv_bytes_per_token(spec)
    new_tokens = sum(prefill_lens) + len(decode_contexts)
    pairs = sum(decode_contexts) + sum(p * (p + 1) // 2 for p in prefill_lens)
    nbytes = 2 * spec.num_params + kv * (sum(decode_contexts) + new_tokens)
    flops = 2 * spec.num_params * new_tokens + 4 * spec.num_layers * spec.hidden_size * pairs
    return max(nbytes / gpu.bandwidth, flops / gpu.flops)


def poisson_trace(num_requests: int, rate: float, seed: int = 0, max_len: int = 2048
                  ) -> list[tuple[int, int, float]]:
    """(prompt_len, output_len, arrival in s): ShareGPT-like lengths (synthetic), Poisson
    arrivals at ``rate`` per second; the same lengths at every rate for one seed."""
    reqs = sharegpt_like(num_requests, seed=seed, max_len=max_len)
    gaps = np.random.default_rng(seed + 1).exponential(1.0, size=num_requests) / rate
    return [(r.prompt_len, r.output_len, float(t))
            for r, t in zip(reqs, np.cumsum(gaps), strict=True)]


def simulate_serving(trace: list[tuple[int, int, float]], policy: str, *,
                     spec: ModelSpec = SPECS["opt-13b"], gpu: Gpu = A100_40GB,
                     kv_bytes: float = OPT13B_KV_BYTES, block_size: int = 16,
                     max_len: int = 2048, max_num_batched_tokens: int = 2048,
                     max_num_seqs: int = 256) -> dict:
    """Serve ``trace`` under ``policy`` in modelled time; returns the normalised latency
    (mean of (finish - arrival) / output_len, s/token), the peak batch and preemptions."""
    if policy not in RESERVATIONS:
        raise ValueError(f"policy must be one of {RESERVATIONS}, got {policy!r}")
    num_blocks = int(kv_bytes // (kv_bytes_per_token(spec) * block_size))
    n = len(trace)
    prompt = [p for p, _, _ in trace]
    out_len = [o for _, o, _ in trace]
    made = [0] * n                       # tokens generated so far
    held = [0] * n                       # blocks held (paged) or reserved (Orca)
    finish = [0.0] * n
    waiting: deque[int] = deque()
    running: list[int] = []
    nxt, t, used, peak, preemptions = 0, 0.0, 0, 0, 0
    order = sorted(range(n), key=lambda i: trace[i][2])
    while nxt < n or waiting or running:
        while nxt < n and trace[order[nxt]][2] <= t:
            waiting.append(order[nxt])
            nxt += 1
        if not waiting and not running:
            t = trace[order[nxt]][2]
            continue
        if policy == "paged":  # a decode writes its last token's K/V: maybe a new block
            i = 0
            while i < len(running):
                r = running[i]
                need = cdiv(prompt[r] + made[r], block_size) - held[r]
                while need > num_blocks - used:  # recompute the newest (maybe r itself)
                    victim = running.pop()
                    used -= held[victim]
                    held[victim] = 0
                    waiting.appendleft(victim)
                    preemptions += 1
                    if victim == r:
                        break
                if i >= len(running):  # r was preempted
                    break
                held[r] += need
                used += need
                i += 1
        admitted, budget = [], max_num_batched_tokens - len(running)
        while waiting and len(running) + len(admitted) < max_num_seqs:
            r = waiting[0]
            text = prompt[r] + made[r]
            if policy == "paged":
                need = cdiv(text, block_size)
            else:
                need = cdiv(reserved_tokens(policy, prompt[r], out_len[r], max_len), block_size)
            if need > num_blocks - used or text > budget:
                break
            waiting.popleft()
            held[r] = need
            used += need
            budget -= text
            admitted.append(r)
        if not running and not admitted:
            raise RuntimeError(f"request {waiting[0]} can never run on {num_blocks} blocks")
        dt = step_seconds(spec, gpu, [prompt[r] + made[r] for r in admitted],
                          [prompt[r] + made[r] for r in running])
        t += dt
        running += admitted
        peak = max(peak, len(running))
        still = []
        for r in running:
            made[r] += 1
            if made[r] == out_len[r]:
                finish[r] = t
                used -= held[r]
                held[r] = 0
            else:
                still.append(r)
        running = still
    norm = [(finish[i] - trace[i][2]) / out_len[i] for i in range(n)]
    return {"policy": policy, "normalized_latency_s": float(np.mean(norm)),
            "peak_batch": peak, "preemptions": preemptions, "num_blocks": num_blocks}


def modelled_sweep(rates: list[float], num_requests: int = 300, seed: int = 0,
                   policies=RESERVATIONS, **options) -> dict:
    """:func:`simulate_serving` for every policy at every rate, shaped like the measured
    sweep's JSON (``{"policies", "runs": [{"reservation", "request_rate", ...}]}``)."""
    runs = []
    for rate in rates:
        trace = poisson_trace(num_requests, rate, seed)
        for policy in policies:
            r = simulate_serving(trace, policy, **options)
            runs.append({"reservation": policy, "request_rate": rate, **r})
    return {"policies": list(policies), "rates": list(rates), "runs": runs}
