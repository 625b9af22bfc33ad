"""The paged engine beside what it is measured against (chapters 06 and 07).

The "before" system (:class:`paged_lib.engine.static_batching.StaticBatchingEngine`) and
the simulator's prediction (:func:`paged_lib.engine.trace.simulated_blocks`) live with the
engine; this module adds what the chapters feed them and read from them:

* :func:`chapter_trace`, :func:`chapter_requests` - one mixed-length trace as engine input
  (through :func:`paged_lib.engine.trace.trace_requests`): real code bytes as prompts (so
  the output is readable) and ``ignore_eos`` with ``max_tokens = output_len`` (so lengths
  are exactly the trace's).
* :func:`static_stats` - the static system's steps in the engine's ``EngineStats`` shape,
  from chapter 02's ``static-max`` simulator (no model: the schedule follows from the
  lengths alone, and the static engine steps through the same schedule);
* :func:`engine_requests` - the trace as the engine sees it (BOS counted in the prompt);
* :func:`policy_steps` - chapter 02's policies (static, the three Orca reservations,
  paged) on the same trace and pool, in steps; :func:`hidden_cost` - what steps do not
  show of one engine run (tokens computed again, preemptions, blocks held);
* :func:`preemption_cost` - chapter 07's trade-off: bytes a swap moves vs tokens a
  recompute runs again, for one engine run.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_lib import workloads
from paged_lib.accounting import ModelSpec, kv_bytes_per_token
from paged_lib.engine.sequence import EngineStats, RequestTimeline, SamplingParams
from paged_lib.engine.trace import trace_requests
from paged_lib.fragmentation import simulate_timeline
from paged_lib.tokenizer import BOS_ID
from paged_lib.util import cdiv
from paged_lib.workloads import Request

#: Chapter 06's setting: 48 requests, a 120-block pool of 8-token blocks, max length 160.
NUM_REQUESTS, NUM_BLOCKS, BLOCK_SIZE, MAX_LEN = 48, 120, 8, 160

#: Prompt text: plain Python, so the shipped code model continues it sensibly.
CODE_TEXT = '''import os
import sys


def read_lines(path):
    """Return the lines of a file without their newline."""
    with open(path) as f:
        return [line.rstrip("\\n") for line in f]


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1

    def most_common(self, n=1):
        items = sorted(self.counts.items(), key=lambda kv: -kv[1])
        return items[:n]


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    counter = Counter()
    for name in argv:
        for line in read_lines(os.path.join(".", name)):
            counter.add(line)
    return counter.most_common(3)
'''


def chapter_trace(num_requests: int = NUM_REQUESTS, seed: int = 0,
                  max_len: int = MAX_LEN) -> list[Request]:
    """Alpaca-shaped lengths (chapter 02's synthetic trace), all arriving at step 0.

    Lengths are clipped to ``max_len - 1`` because the engine's prompt adds a BOS token
    (:func:`chapter_requests`): every engine request then fits ``max_len``.
    """
    trace = workloads.alpaca_like(num_requests, seed=seed, max_len=max_len - 1)
    return [Request(r.prompt_len, r.output_len, 0.0) for r in trace]


def chapter_requests(requests: Sequence[Request]) -> tuple[list[list[int]],
                                                         list[SamplingParams]]:
    """The trace as engine input (:func:`paged_lib.engine.trace.trace_requests`): prompt
    ``i`` is BOS, then ``prompt_len`` bytes of :data:`CODE_TEXT` from a line start; params
    ask for exactly ``output_len`` greedy tokens (EOS ignored).

    Byte ids are token ids for the course's byte-level tokenizer
    (:class:`paged_lib.tokenizer.ByteTokenizer`).
    """
    return trace_requests(requests, text=CODE_TEXT, bos_id=BOS_ID)


def engine_requests(requests: Sequence[Request]) -> list[Request]:
    """The trace's lengths as the engine serves them: BOS + ``prompt_len`` prompt tokens."""
    return [Request(r.prompt_len + 1, r.output_len, r.arrival) for r in requests]


def static_stats(requests: Sequence[Request], num_blocks: int = NUM_BLOCKS,
                 block_size: int = BLOCK_SIZE, max_len: int = MAX_LEN) -> EngineStats:
    """Static max-length batching of ``requests`` on ``num_blocks`` blocks, per step.

    From chapter 02's simulator (``static-max``): ``batch_sizes`` counts requests still
    generating, ``blocks_used`` the blocks reserved (a finished request keeps its
    reservation until its batch ends), ``tokens_per_step`` the tokens generated;
    ``requests`` hold each request's admission and last step, as the engine records them.
    """
    tl = simulate_timeline(list(requests), "static-max", num_blocks * block_size, block_size,
                           max_len, record=True)
    running, reserved = [0] * tl.num_steps, [0] * tl.num_steps
    for a in tl.allocations:
        for t in range(a.start, a.end):
            reserved[t] += cdiv(a.size, block_size)
    stats = EngineStats(num_blocks=num_blocks, block_size=block_size)
    stats.requests = [RequestTimeline() for _ in requests]
    for run in tl.runs:
        stats.requests[run.request].admitted_steps.append(run.start)
        stats.requests[run.request].finished_step = run.end - 1
        for t in range(run.start, run.end):
            running[t] += 1
    starts = {run.start for run in tl.runs}
    for t in range(tl.num_steps):
        stats.record_step("prefill" if t in starts else "decode", running[t], reserved[t],
                          running[t], running[t])
    return stats


#: Chapter 02's policies the chapter sets beside the engine, in its order.
STEP_POLICIES = ("static-max", "orca-max", "orca-pow2", "orca-oracle", "paged")


def policy_steps(requests: Sequence[Request], num_blocks: int = NUM_BLOCKS,
                 block_size: int = BLOCK_SIZE, max_len: int = MAX_LEN) -> dict[str, int]:
    """Steps chapter 02's simulator needs to serve ``requests`` (as the engine sees them,
    :func:`engine_requests`) on a pool of ``num_blocks * block_size`` token slots, for
    each of :data:`STEP_POLICIES`. Lengths alone decide them: no model runs."""
    reqs = engine_requests(requests)
    return {p: simulate_timeline(reqs, p, num_blocks * block_size, block_size,
                                 max_len).num_steps for p in STEP_POLICIES}


def hidden_cost(stats: EngineStats, requests: Sequence[Request]) -> dict[str, float | int]:
    """What a step count hides, for one engine run of ``requests``: tokens run through
    the model in all, of them recomputed after a preemption, against the prompt and
    output tokens the trace needs; preemptions; mean and peak blocks held."""
    reqs = engine_requests(requests)
    summary = stats.summary()
    return {"computed_tokens": sum(stats.computed_tokens),
            "recomputed_tokens": stats.recomputed_tokens,
            "prompt_tokens": sum(r.prompt_len for r in reqs),
            "output_tokens": sum(r.output_len for r in reqs),
            "preemptions": stats.preemptions,
            "mean_blocks_used": summary["mean_blocks_used"],
            "peak_blocks_used": stats.peak_blocks_used}


def kv_bytes_per_block(config: ModelSpec, block_size: int) -> int:
    """Bytes of one block of K and V over every layer (what a swap copies per block),
    with chapter 01's formula: the model's config is a ``ModelSpec``."""
    return kv_bytes_per_token(config) * block_size


def preemption_cost(stats: EngineStats, config: ModelSpec) -> dict[str, int]:
    """What one run's preemptions cost: block copies and bytes (swap), tokens (recompute)."""
    return {"preemptions": stats.preemptions,
            "swapped_blocks": stats.swapped_blocks,
            "swapped_bytes": stats.swapped_blocks * kv_bytes_per_block(config,
                                                                       stats.block_size),
            "recomputed_tokens": stats.recomputed_tokens}


#: Chapter 07's "pool far too small": 7 requests (one of them 2 parallel samples).
PRESSURE_BLOCKS, PRESSURE_BLOCK_SIZE = 10, 8


def pressure_requests() -> tuple[list[list[int]], list[SamplingParams]]:
    """Seven requests that need about 30 blocks of 8 at once: six greedy, and one that
    draws 2 seeded samples (its prompt blocks are shared, so swapping it meets sharing)."""
    trace = chapter_trace(7, seed=5, max_len=64)
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)] * 6 + [
        SamplingParams(max_tokens=24, n=2, temperature=0.8, seed=7, ignore_eos=True)]
    prompts, _ = chapter_requests(trace)
    return prompts, params
