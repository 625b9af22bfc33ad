"""The workloads of :mod:`paged_lib.course.grading.generated`: what one is, how one is
drawn for a piece (seeded), and the candidates one step simpler that shrinking tries."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

#: What shrinking switches an option back to: the engine's defaults, but at most 16
#: sequences a step (a step's token budget must hold them).
DEFAULTS: dict[str, Any] = dict(
    preemption="recompute", num_cpu_blocks=0, watermark=0.01, scheduling="mixed",
    max_num_seqs=16, enable_chunked_prefill=False, enable_prefix_caching=False,
    kv_cache_dtype="auto", sliding_window=None, num_sink_tokens=0, dtype="fp32")

#: hook name -> what its workloads always turn on (the rest is drawn)
FOCUS: dict[str, dict[str, Any]] = {"swap_mapping": dict(preemption="swap"),
                                    "write_int8_blocks": dict(kv_cache_dtype="int8"), **{
    h: dict(enable_prefix_caching=True) for h in ("block_hashes", "longest_cache_hit",
                                                  "allocate_slots", "FreeBlockQueue")}}

#: Pieces whose calls depend on pool pressure: their workloads use the smallest pools (the
#: free queue's too: evictions and reuse put any block anywhere in it, block 0 included).
_PRESSURE = ("choose_victim", "preempt_until_fits", "swap_mapping", "num_required_blocks",
             "beam_step", "FreeBlockQueue")
#: Pieces that see blocks shared across requests: prefix caching and a shared prefix are
#: drawn more often, so a victim or a beam holds blocks another request holds too.
_SHARING = ("preempt_until_fits", "beam_step")
#: Pieces that decide admission: half their workloads bring waves of long prompts.
_TIGHT = ("can_admit", "schedule_waiting")


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    params: tuple[tuple[str, Any], ...]  # SamplingParams keywords, sorted
    arrival: int

    def describe(self, tokens: bool = True) -> str:
        """In words; ``tokens=False`` leaves out the prompt's first tokens."""
        p = dict(self.params)
        kind = (f"{p['beam_width']} beams" if p.get("beam_width") else
                f"{p['n']} samples" if p.get("n", 1) > 1 else
                "greedy" if p.get("temperature") == 0.0 else "1 sample")
        stop = f", stops at token {p['stop_token_ids'][0]}" if p.get("stop_token_ids") else ""
        shown = list(self.prompt[:8]) + (["..."] if len(self.prompt) > 8 else [])
        return (f"a prompt of {len(self.prompt)} tokens{f' {shown}' if tokens else ''}, "
                f"{kind}, max_tokens "
                f"{p['max_tokens']}{stop}, arriving at step {self.arrival}")


@dataclass(frozen=True)
class Workload:
    seed: int
    num_blocks: int
    block_size: int
    options: tuple[tuple[str, Any], ...]  # LLMEngine keywords (and dtype), sorted
    requests: tuple[Request, ...]

    def option(self, name: str) -> Any:
        return dict(self.options).get(name, DEFAULTS.get(name))

    def describe(self, tokens: bool = True) -> str:
        changed = [f"{k}={v!r}" for k, v in self.options if DEFAULTS.get(k, object()) != v]
        return (f"{self.num_blocks} blocks of {self.block_size}"
                + (", " + ", ".join(changed) if changed else "") + "; requests: "
                + "; ".join(f"#{i} {r.describe(tokens)}" for i, r in enumerate(self.requests)))


# ------------------------------------------------------------------ drawing


def _prompt(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randint(32, 126) for _ in range(n))


def _params(rng: random.Random, hook: str = "") -> dict[str, Any]:
    kind = rng.choice(["greedy", "beams", "samples", "beams", "beams"] if hook == "beam_step"
                      else ["greedy", "greedy", "stop", "greedy", "stop"]
                      if hook == "drop_oldest"  # a window serves one sequence a request
                      else ["greedy", "greedy", "samples", "beams", "stop"])
    p: dict[str, Any] = dict(max_tokens=rng.randint(1, 20), ignore_eos=True)
    if kind == "greedy":
        p["temperature"] = 0.0
    elif kind == "samples":
        p.update(n=rng.randint(2, 4), temperature=1.0, seed=rng.randint(0, 99))
    elif kind == "beams":
        p["beam_width"] = rng.randint(2, 4)
    else:  # a sampled request that stops at a likely byte (space or newline)
        p.update(temperature=1.0, seed=rng.randint(0, 99), stop_token_ids=(rng.choice([32, 10]),),
                 n=rng.choice([1, 2]))
        if hook == "drop_oldest":
            p["n"] = 1
    if hook == "drop_oldest":  # long enough outputs to slide many times
        p["max_tokens"] += rng.randint(0, 40)
    return p


def draw(seed: int, hook: str) -> Workload:
    """One seeded workload for the piece filling ``hook`` (its FOCUS options on). Half
    the pools (all, for the pieces that act under pressure) hold a tenth to two fifths
    of what the requests would hold together, so they preempt."""
    rng = random.Random(f"{hook}:{seed}")
    o: dict[str, Any] = {}
    window = hook == "drop_oldest"
    sizes = [2, 4, 4, 8] + [3, 6] * (hook == "allocate_slots")  # not powers of two too,
    block_size = rng.choice([2, 3, 4, 5, 6, 8] if window else sizes)  # as windows (any size)
    pressure = hook in _PRESSURE or rng.random() < 0.5
    tight = hook in _TIGHT and rng.random() < 0.5  # long prompts against the token budget
    if rng.random() < 0.4:
        o["preemption"] = "swap"
        o["num_cpu_blocks"] = rng.choice([2, 3, 5, 8, 64])
    o["watermark"] = rng.choice([0.0, 0.01, 0.1, 0.2])
    if rng.random() < 0.25:
        o["scheduling"] = "prefill_first"
    o["max_num_seqs"] = rng.randint(4, 8) if rng.random() < (0.2 if pressure else 0.5) else 16
    o["max_model_len"] = rng.choice([48, 64, 64])
    if rng.random() < 0.4 and o.get("scheduling") != "prefill_first":
        o["enable_chunked_prefill"] = True
        o["max_num_batched_tokens"] = rng.randint(4, 16)
        o["max_num_seqs"] = min(o["max_num_seqs"], o["max_num_batched_tokens"])
    else:  # at least max_model_len (vLLM's rule), a few tokens more at most
        o["max_num_batched_tokens"] = o["max_model_len"] + (
            0 if tight else rng.choice([0, 0, 4, 16]))
    if rng.random() < (0.6 if hook in _SHARING else 0.4):
        o["enable_prefix_caching"] = True
    if rng.random() < 0.2:
        o["kv_cache_dtype"] = "int8"
    if rng.random() < 0.2:
        o["dtype"] = "fp16"
    o.update(FOCUS.get(hook, {}))
    if o.get("preemption") == "swap" and "num_cpu_blocks" not in o:
        o["num_cpu_blocks"] = rng.choice([2, 3, 5, 8, 64])
    if not any(o.get(k, DEFAULTS[k]) != DEFAULTS[k] for k in ("enable_prefix_caching",
                                                              "preemption", "kv_cache_dtype")) \
            and rng.random() < 0.3:
        o["sliding_window"] = rng.choice([6, 8, 12])
        o["num_sink_tokens"] = rng.choice([0, 1, 2, 4])
    if window:  # what a window does not combine with off, sinks of every size against B
        for k in ("enable_prefix_caching", "preemption", "num_cpu_blocks", "kv_cache_dtype"):
            o.pop(k, None)
        o["sliding_window"] = rng.randint(3, 14)
        o["num_sink_tokens"] = rng.choice([0, 1, 2, 3, 4, 5, 7, 9, 11])
    shared = _prompt(rng, rng.randint(block_size, 3 * block_size))
    longest = 40 if tight else rng.choice([14, 30, 40])
    if window:  # prompts the window takes (at most sinks + window), a few it refuses
        longest = o["num_sink_tokens"] + o["sliding_window"] + rng.choice([0, 0, 0, 2])
        shared = shared[:longest]
    sharing = 0.5 if hook in _SHARING and o.get("enable_prefix_caching") else 0.0
    if sharing:  # a prefix of two to four blocks that most requests start with
        shared = _prompt(rng, rng.randint(2 * block_size, 4 * block_size))
    burst = rng.choice([2, 4, 6] if tight else [0, 2, 4, 6])  # a wave arrives together
    requests = []
    for _ in range(rng.randint(3, 8)):
        own = _prompt(rng, rng.randint(1, longest))
        roll = rng.random()
        prompt = shared if roll < 0.15 else shared + own if roll < 0.45 + sharing else own
        if window:
            prompt = prompt[:longest]
        arrival = burst if rng.random() < (0.7 if tight else 0.4) else \
            rng.choice([0, 0, 1, 2, 3, 4, 6, 8])
        requests.append(Request(prompt, tuple(sorted(_params(rng, hook).items())), arrival))
    need = [len(r.prompt) + (p["max_tokens"] + block_size) * (p.get("beam_width") or
                                                              p.get("n", 1))
            for r in requests for p in [dict(r.params)]]
    if pressure:
        tokens = max(max(need), int(sum(need) * rng.uniform(0.1, 0.4)))
    else:
        tokens = sum(need) + rng.randint(0, 64)
    return Workload(seed, -(-tokens // block_size), block_size, tuple(sorted(o.items())),
                    tuple(requests))


# ------------------------------------------------------------------ simpler ones


def candidates(w: Workload):
    """Candidate workloads one step simpler than ``w``, the biggest simplifications first."""
    reqs = w.requests
    for i in reversed(range(len(reqs))):
        if len(reqs) > 1:
            yield dataclasses.replace(w, requests=reqs[:i] + reqs[i + 1:])
    if any(dict(r.params)["max_tokens"] > 1 for r in reqs):  # every output halved at once
        yield dataclasses.replace(w, requests=tuple(
            _with(r, max_tokens=max(1, dict(r.params)["max_tokens"] // 2)) for r in reqs))
    first = min(r.arrival for r in reqs)
    if first:  # every arrival moved earlier together
        yield dataclasses.replace(w, requests=tuple(
            dataclasses.replace(r, arrival=r.arrival - first) for r in reqs))
    opts = dict(w.options)
    for name in list(opts):
        if name in ("max_num_batched_tokens", "max_model_len", "max_num_seqs") or \
                opts[name] == DEFAULTS.get(name):
            continue
        o = {k: v for k, v in opts.items() if k != name}
        if name == "enable_chunked_prefill":
            o["max_num_batched_tokens"] = o["max_model_len"]
        if name == "preemption":
            o.pop("num_cpu_blocks", None)
        if name == "sliding_window":
            o.pop("num_sink_tokens", None)
        yield dataclasses.replace(w, options=tuple(sorted(o.items())))
    if opts["max_num_seqs"] < min(16, opts["max_num_batched_tokens"]):  # the limit lifted
        o = {**opts, "max_num_seqs": min(16, opts["max_num_batched_tokens"])}
        yield dataclasses.replace(w, options=tuple(sorted(o.items())))
    for i, r in enumerate(reqs):
        p = dict(r.params)
        simpler = []
        for n in (len(r.prompt) // 2, len(r.prompt) - 1):
            if 1 <= n < len(r.prompt):
                simpler.append(dataclasses.replace(r, prompt=r.prompt[:n]))
        for k in (p["max_tokens"] // 2, p["max_tokens"] - 1):
            if 1 <= k < p["max_tokens"]:
                simpler.append(_with(r, max_tokens=k))
        if p.get("beam_width"):
            simpler.append(_with(r, beam_width=None, temperature=0.0) if p["beam_width"] == 2
                           else _with(r, beam_width=p["beam_width"] - 1))
        if p.get("n", 1) > 1:
            simpler.append(_with(r, n=p["n"] - 1))
        elif p.get("temperature") != 0.0 and not p.get("beam_width"):
            simpler.append(_with(r, temperature=0.0, seed=None, stop_token_ids=None))
        if p.get("stop_token_ids"):
            simpler.append(_with(r, stop_token_ids=None))
        if r.arrival:
            simpler.append(dataclasses.replace(r, arrival=0))
        for s in simpler:
            yield dataclasses.replace(w, requests=reqs[:i] + (s,) + reqs[i + 1:])


def _with(r: Request, **changes: Any) -> Request:
    p = {k: v for k, v in {**dict(r.params), **changes}.items() if v is not None}
    return dataclasses.replace(r, params=tuple(sorted(p.items())))
