"""The floor: how fast this machine could run a step at best, measured in the same run.

A decode step must read every weight once (the LM head too) and the K/V of every token
its sequences attend to, and must do two FLOPs per weight per token (plus attention's).
Memory and arithmetic overlap at best, so the step cannot take less than the larger of

    bytes read / memory bandwidth      and      FLOPs / matmul rate

(the roofline model: Williams, Waterman and Patterson, "Roofline", CACM 2009; the vLLM
paper's section 2.3 makes the same point for GPUs, where a decode step is bound by
reading memory). :func:`measure_machine` measures both rates here and now, at the
threads torch uses, so every figure a bench prints comes beside its own floor as a ratio.

On a CPU the bandwidth is the better of two reads of a buffer far larger than the caches:
a sum, and the model's own linear map of one row (:mod:`paged_lib.kernels.cpu_linear`'s C
kernel, which prefetches ahead; on an AMD EPYC, 2026-12-07, two threads, both read 256 MB
at 50-70 GB/s, as the host's other work allowed). ``torch.mv`` is not timed: BLAS runs it
on one thread whatever torch's count.
The matmul rate is the fastest of the fp32 products of square matrices this machine has:
``torch.mm`` (the BLAS PyTorch was built with), oneDNN's on a prepacked weight, and the C
kernel's. They can differ by far: on that EPYC ``torch.mm`` (Intel's MKL) did 210 GFLOP/s
and the other two about 480, and a floor taken from the slower would let a step look
closer to the machine than it is. Both rates are what this machine delivers now (other
work on shared cores lowers them), not a spec sheet's peak.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from paged_lib.kernels.cpu_linear import LinearWeights, c_kernel_available, linear
from paged_lib.model import TinyLlamaConfig


@dataclass(frozen=True)
class Machine:
    """Measured rates: ``bandwidth`` bytes/s read from memory, ``flops`` fp32 FLOP/s of a
    large matmul, at ``threads`` torch threads."""

    bandwidth: float
    flops: float
    threads: int

    def describe(self) -> str:
        return (f"this machine now, {self.threads} thread(s): reads memory at "
                f"{self.bandwidth / 1e9:.1f} GB/s, fp32 matmul {self.flops / 1e9:.0f} GFLOP/s")


#: The least wall time of one timed run (the function called as often as that takes).
#: This process's CPU time counts the threads other than the calling one in the kernel's
#: ticks (4 ms here): a run of one 6-ms call once gave a 256 MiB read "151 GB/s".
MIN_RUN_SECONDS = 0.1


def _best_seconds(fn, repeats: int, clocks=(time.perf_counter, time.process_time)) -> float:
    """The shortest time per call of ``repeats`` runs, each of at least
    :data:`MIN_RUN_SECONDS` and timed by the wall clock and by this process's CPU seconds
    per torch thread, whichever is shorter: on shared cores a run's wall clock also
    counts the turns other processes took, which say nothing about the machine's rates.
    ``fn`` must keep every torch thread busy (CPU seconds per thread are then its time).
    ``clocks`` (wall, process CPU) are there for tests that drive the timing by hand."""
    fn()  # warm-up: page faults and first-call costs are not the rate
    (wall_clock, cpu_clock), threads, times = clocks, torch.get_num_threads(), []
    for _ in range(repeats):
        calls, wall, cpu = 0, wall_clock(), cpu_clock()
        while calls == 0 or wall_clock() - wall < MIN_RUN_SECONDS:
            fn()
            calls += 1
        wall, cpu = wall_clock() - wall, cpu_clock() - cpu
        times.append(min(wall, cpu / threads) / calls)
    return min(times)


def measure_machine(read_bytes: int = 256 * 2**20, matmul_size: int = 1536,
                    repeats: int = 5) -> Machine:
    """Memory bandwidth and fp32 matmul rate (the fastest of ``torch.mm``, oneDNN's
    prepacked product and the C kernel's) at ``torch.get_num_threads()`` threads, on the
    CPU (about three seconds). The best of ``repeats`` runs (:func:`_best_seconds`): the
    floor is what the machine *can* do, so a run slowed by other work does not lower it."""
    if read_bytes < 2**20 or matmul_size < 64:
        raise ValueError(f"read_bytes must be at least 1 MiB and matmul_size at least 64, "
                         f"got {read_bytes} and {matmul_size}")
    cols = 4096
    x = torch.ones(read_bytes // 4 // cols, cols)
    nbytes = x.numel() * 4
    read = _best_seconds(lambda: x.sum(), repeats)
    if c_kernel_available(x):  # the model's own map of one row, on a copy in its layout
        weights, row = LinearWeights([x]), torch.ones(1, cols)
        x = None
        read = min(read, _best_seconds(lambda: linear(row, weights), repeats))
    x = weights = None  # free them before the matmuls
    a, b = torch.randn(matmul_size, matmul_size), torch.randn(matmul_size, matmul_size)
    mm = _best_seconds(lambda: torch.mm(a, b), repeats)
    for c_kernel in (False, True):  # oneDNN's product, then the C kernel's
        weights = LinearWeights([b], min_prepack_bytes=0, c_kernel=c_kernel)
        if weights.packed is not None or weights.tiles is not None:
            mm = min(mm, _best_seconds(lambda w=weights: linear(a, w), repeats))
    return Machine(bandwidth=nbytes / read, flops=2 * matmul_size**3 / mm,
                   threads=torch.get_num_threads())


def linear_params(cfg: TinyLlamaConfig) -> int:
    """Weights of one decoder layer's linear maps (Q, K, V, O, gate, up, down)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size


def weight_bytes(cfg: TinyLlamaConfig) -> int:
    """Bytes of weights a step reads: every layer's linear maps and norms, the final norm
    and the LM head (the embedding table is only looked up, a few rows; when it is tied
    to the head it is read once, as the head)."""
    per_layer = linear_params(cfg) + 2 * cfg.hidden_size
    params = cfg.num_layers * per_layer + cfg.hidden_size + cfg.vocab_size * cfg.hidden_size
    return params * cfg.dtype_bytes


def kv_bytes_per_token(cfg: TinyLlamaConfig) -> int:
    """K and V of one token, all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cfg.dtype_bytes


@dataclass(frozen=True)
class Floor:
    """A step's (or several steps') work and the least time it can take."""

    bytes: int
    flops: int
    seconds: float

    def ratio(self, seconds: float) -> float:
        return seconds / self.seconds


def step_floor(cfg: TinyLlamaConfig, seq_lens: list[int], query_lens: list[int],
               machine: Machine) -> Floor:
    """The floor of one step that runs ``query_lens[s]`` new tokens of sequence ``s``,
    which holds ``seq_lens[s]`` tokens after the step (as the model runner's input says).

    Bytes: the weights once, every K/V the sequences read, the new tokens' K/V written.
    FLOPs: two per linear weight per new token, two per head weight per sequence (the
    LM head runs on each sequence's last token only), and attention's four per head
    dimension per (query, key) pair, causal within a prompt.
    """
    if len(seq_lens) != len(query_lens) or any(
            not 1 <= q <= s for s, q in zip(seq_lens, query_lens, strict=True)):
        raise ValueError(f"need 1 <= query_len <= seq_len for each sequence, got seq_lens "
                         f"{seq_lens} and query_lens {query_lens}")
    tokens, seqs = sum(query_lens), len(seq_lens)
    pairs = sum(q * s - q * (q - 1) // 2 for s, q in zip(seq_lens, query_lens, strict=True))
    kv = kv_bytes_per_token(cfg)
    nbytes = weight_bytes(cfg) + kv * (sum(seq_lens) + tokens)
    flops = (2 * tokens * cfg.num_layers * linear_params(cfg)
             + 2 * seqs * cfg.vocab_size * cfg.hidden_size
             + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs)
    return Floor(nbytes, flops, max(nbytes / machine.bandwidth, flops / machine.flops))


def part_floors(cfg: TinyLlamaConfig, seq_lens: list[int], query_lens: list[int],
                machine: Machine, decode_layers: bool = False) -> dict[str, float]:
    """Seconds at best of each part of one step, each bounded on its own the same way:
    the layers' linear maps (their weights, their FLOPs), the LM head (its weights, one
    row per sequence), and attention (the K/V read and written, its FLOPs) of the
    decoding sequences (one new token) and of the prefilling ones apart. With
    ``decode_layers``, a decode step's layers (each one C call: ``backend="cpu"``) are one
    part, "decode layers", bounded by their maps' and attention's bytes and FLOPs together."""
    step_floor(cfg, seq_lens, query_lens, machine)  # checks the lengths
    tokens, seqs, kv = sum(query_lens), len(seq_lens), kv_bytes_per_token(cfg)
    head = cfg.vocab_size * cfg.hidden_size
    work = {"linear maps": (cfg.num_layers * linear_params(cfg) * cfg.dtype_bytes,
                            2 * tokens * cfg.num_layers * linear_params(cfg)),
            "LM head": (head * cfg.dtype_bytes, 2 * seqs * head)}  # (bytes, FLOPs)
    for part, decoding in (("decode attention", True), ("prefill attention", False)):
        pairs = [(s, q) for s, q in zip(seq_lens, query_lens, strict=True)
                 if (q == 1) == decoding]
        scores = sum(q * s - q * (q - 1) // 2 for s, q in pairs)
        work[part] = (kv * sum(s + q for s, q in pairs),
                      4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * scores)
    if decode_layers and all(q == 1 for q in query_lens):
        (maps_bytes, maps_flops), (kv_bytes, kv_flops) = (work.pop("linear maps"),
                                                          work.pop("decode attention"))
        del work["prefill attention"]
        work["decode layers"] = (maps_bytes + kv_bytes, maps_flops + kv_flops)
    return {part: max(nbytes / machine.bandwidth, flops / machine.flops)
            for part, (nbytes, flops) in work.items()}


def decode_floor(cfg: TinyLlamaConfig, batch: int, context: int, machine: Machine) -> Floor:
    """The floor of a decode step of ``batch`` sequences of ``context`` tokens each."""
    return step_floor(cfg, [context] * batch, [1] * batch, machine)


class StepRecorder:
    """Records each step an engine's model runs (its sequences' lengths), so a trace's
    time can be set beside the floor of the very steps the engine chose::

        rec = StepRecorder(engine)   # wraps engine.runner.execute
        engine.generate(...)
        rec.floor(cfg, machine)      # the sum of the steps' floors
    """

    def __init__(self, engine):
        self.steps: list[tuple[list[int], list[int]]] = []
        execute = engine.runner.execute

        def recorded(inp):
            if not inp.is_empty():
                self.steps.append((list(inp.seq_lens), list(inp.query_lens)))
            return execute(inp)

        engine.runner.execute = recorded

    def floor(self, cfg: TinyLlamaConfig, machine: Machine) -> Floor:
        floors = [step_floor(cfg, s, q, machine) for s, q in self.steps]
        return Floor(sum(f.bytes for f in floors), sum(f.flops for f in floors),
                     sum(f.seconds for f in floors))

    def part_floors(self, cfg: TinyLlamaConfig, machine: Machine,
                    decode_layers: bool = False) -> dict[str, float]:
        """:func:`part_floors` summed over the recorded steps."""
        total: dict[str, float] = {}
        for s, q in self.steps:
            for part, sec in part_floors(cfg, s, q, machine, decode_layers).items():
                total[part] = total.get(part, 0.0) + sec
        return total


def time_decode_steps(model, batch: int, context: int, steps: int = 5,
                      block_size: int = 16, backend: str = "auto") -> tuple[float, float]:
    """Median (wall, calling thread's CPU) seconds of one decode step of the model runner
    (metadata, forward, LM head on the last tokens; no scheduler, no sampling) at
    ``batch`` sequences of ``context`` tokens (their prompts are prefilled first)."""
    from paged_lib.engine.model_input import ModelInput
    from paged_lib.engine.model_runner import ModelRunner
    from paged_lib.kernels.backends import resolve_backend

    if batch < 1 or context < 2 or steps < 1:
        raise ValueError(f"need batch >= 1, context >= 2, steps >= 1; got {batch}, "
                         f"{context}, {steps}")
    per_seq = -(-(context + steps) // block_size)
    runner = ModelRunner(model, batch * per_seq, block_size,
                         backend=resolve_backend(backend, model.device))
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(batch)]
    vocab = model.config.vocab_size
    prompt_len = context - 1
    runner.execute(ModelInput(input_ids=[(7 * i) % vocab for i in range(batch * prompt_len)],
                              block_tables=tables, seq_lens=[prompt_len] * batch,
                              query_lens=[prompt_len] * batch))
    walls, cpus = [], []
    for step in range(steps + 1):  # the first decode step is a warm-up
        inp = ModelInput(input_ids=[(3 * s + step) % vocab for s in range(batch)],
                         block_tables=tables, seq_lens=[prompt_len + 1 + step] * batch,
                         query_lens=[1] * batch)
        wall, cpu = time.perf_counter(), time.thread_time()
        runner.execute(inp)
        if step:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.thread_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def decode_step_lines(model, machine: Machine, batches=(1, 8, 32), context: int = 128,
                      backend: str = "auto", measure=None, rounds: int = 3) -> list[str]:
    """One line per batch size: a decode step's time (wall and thread CPU) beside its
    floor, as a ratio.

    ``measure`` (e.g. :func:`measure_machine`), where given, is called right before each
    timing, ``rounds`` timings a batch, and the line reports the round whose ratio is the
    median, with the rates its floor used; without it, every floor uses ``machine``. A shared
    machine's rates drift within seconds (on the EPYC above, reading memory went from 88 to
    54 GB/s and back between one call and the next), so a floor measured a minute earlier,
    before a benchmark's other work, can be far from the one the step met."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    read, rounds = (measure, rounds) if measure is not None else (lambda: machine, 1)
    lines = []
    for batch in batches:
        timed = []
        for _ in range(rounds):
            now = read()
            wall, cpu = time_decode_steps(model, batch, context, backend=backend)
            f = decode_floor(model.config, batch, context + 3, now)
            timed.append((f.ratio(wall), wall, cpu, f, now))
        ratio, wall, cpu, f, now = sorted(timed, key=lambda t: t[0])[rounds // 2]
        lines.append(f"decode step at batch {batch} ({context} tokens each): {1e3 * wall:.1f}"
                     f" ms wall, {1e3 * cpu:.1f} ms thread CPU; floor {1e3 * f.seconds:.1f} ms"
                     f" ({f.bytes / 1e6:.0f} MB, {f.flops / 1e6:.0f} MFLOP at "
                     f"{now.bandwidth / 1e9:.1f} GB/s, {now.flops / 1e9:.0f} GFLOP/s): "
                     f"{ratio:.2f}x the floor ({f.ratio(cpu):.2f}x by CPU time)"
                     + (f"; median of {rounds} rounds, each beside its own reading"
                        if measure is not None else ""))
    return lines
