"""Chapter 11's exercise 11.3, ``write_int8_blocks`` (re-exported by
:mod:`paged_lib.course.grading.ch11`): one step's K (or V) written into int8 blocks whose
per-(block, KV head) scale grows (:func:`paged_lib.kernels.kv_quant.write_int8_blocks`).

Three parts, first difference told as a story:

* named edge states (the spec's example, a first token of zeros, a token at, just past
  and far past the limit, several tokens of one step in a block, a step that crosses a
  block boundary into a reallocated block, a block never written), each next to the
  library's answer;
* replay: the library's engine serves int8 workloads (parallel samples and beams whose
  copy-on-write carries the scale, preemption by recompute and by swap, prefix hits and
  chunked prefill) and every call it makes to the write is asked of the learner's
  function, on the same blocks, and compared;
* the learner's write plugged into the engine, the same workloads served: every
  output's tokens must be the library's (a code one off at a tie, which the replay lets
  through, shows here);
* generated cases (:mod:`~paged_lib.course.grading.generated.numeric_int8`): blocks of
  any size, 1 to 4 heads, calls in every regime of growth, each call compared.

How answers are compared, and the typical mistakes that name a wrong one:
:mod:`paged_lib.course.grading.ch11_quant_rule`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from paged_lib.course import grading
from paged_lib.course.grading import serving
from paged_lib.course.grading.ch11_quant_rule import WriteCall, compare, reference_write, snap
from paged_lib.course.grading.generated import numeric, numeric_int8

__all__ = ["QUANT_WORKLOADS", "check_write_int8_blocks", "reference_write"]

# ------------------------------------------------------------------ the named edges


def _edge(where: str, x: list, slots: list[int], blocks: dict[int, tuple[list, list]],
          shape: tuple[int, ...] = (6, 4, 2, 2)) -> WriteCall:
    """A call on a cache of ``shape`` whose ``blocks`` hold (codes [bs, heads, dim] or
    a fill value, scale per head) before it."""
    data = torch.zeros(shape, dtype=torch.int8)
    scale = torch.full((shape[0], shape[2]), float("nan"))
    for b, (codes, s) in blocks.items():
        data[b] = torch.as_tensor(codes, dtype=torch.int8)
        scale[b] = torch.as_tensor(s, dtype=torch.float32)
    return snap(where, torch.tensor(x, dtype=torch.float32), data, scale,
                 torch.tensor(slots, dtype=torch.long))


def _edges() -> list[WriteCall]:
    g = torch.Generator().manual_seed(11)

    def codes(lo: int = -127, hi: int = 128) -> list:
        return torch.randint(lo, hi, (4, 2, 2), generator=g).tolist()

    held = codes()
    return [
        _edge("the spec's example: block 3 held 2 tokens at scale 0.01, a token of 2.0 "
              "arrives at offset 2", [[[2.0, -0.5]]], [14],
              {3: ([[[127, 0]], [[-64, 32]], [[0, 0]], [[0, 0]]], [0.01])},
              shape=(5, 4, 1, 2)),
        _edge("a first token of all zeros (a fresh block 2)", [[[0.0, 0.0], [0.0, 0.0]]],
              [8], {2: (codes(), [0.5, 0.5])}),
        _edge("a token exactly at the limit (|x| = 127 x scale = 63.5 with scale 0.5)",
              [[[63.5, -10.0], [-63.5, 1.0]]], [5], {1: (held, [0.5, 0.5])}),
        _edge("a token just past the limit (64 with scale 0.5: the scale doubles)",
              [[[64.0, 1.0], [3.0, 1.0]]], [6], {1: (held, [0.5, 0.5])}),
        _edge("a token far past the limit (1000 with scale 0.5)",
              [[[1000.0, 1.0], [-2.0, 0.5]]], [7], {1: (held, [0.5, 0.5])}),
        _edge("several tokens of one step in one block (offsets 1-3: 5.0, then -9.0, then 1.0)",
              [[[5.0, 1.0], [0.5, 0.5]], [[-9.0, 3.0], [1.0, 4.0]], [[1.0, 1.0], [1.0, 1.0]]],
              [17, 18, 19], {4: (codes(), [0.03, 0.03])}),
        _edge("a step that crosses a block boundary (offsets 2, 3 of block 5, then offsets "
              "0, 1 of block 0, reallocated with an earlier owner's codes and scale 9)",
              [[[5.0, 1.0], [1.0, 1.0]], [[0.5, 0.5], [0.5, 0.5]], [[0.2, 0.1], [0.3, 0.2]],
               [[0.1, 0.1], [0.1, 0.1]]], [22, 23, 0, 1],
              {5: (codes(), [0.01, 0.2]), 0: (codes(), [9.0, 9.0])}),
        _edge("a block never written (scale NaN), first written at offset 2",
              [[[1.0, -2.0], [0.5, 0.25]]], [6], {}),
    ]


# ------------------------------------------------------------------ the engine


#: name, engine options, prompts (lengths), params, arrival steps
QUANT_WORKLOADS = [
    ("samples n=3 and beams of 3 sharing blocks (copy-on-write carries the scale), "
     "preempted by recompute, 14 blocks of 4", dict(num_blocks=14, block_size=4, watermark=0),
     [7, 13, 5], [dict(max_tokens=7, temperature=1.0, n=3, seed=1),
                  dict(max_tokens=6, beam_width=3), dict(max_tokens=9, temperature=0.0)],
     [0, 0, 2]),
    ("prefix hits in the same step and later, chunks of 6 tokens, 16 blocks of 4",
     dict(num_blocks=16, block_size=4, watermark=0, enable_prefix_caching=True,
          enable_chunked_prefill=True, max_num_batched_tokens=6, max_num_seqs=4),
     [11, 14, 9, 10],
     [dict(max_tokens=5, temperature=0.0, ignore_eos=True)] * 4, [0, 0, 0, 3]),
    ("samples n=2, preempted by swap, 10 blocks of 2 (CPU pool 40)",
     dict(num_blocks=10, block_size=2, watermark=0, preemption="swap", num_cpu_blocks=40),
     [5, 6, 3], [dict(max_tokens=6, temperature=0.8, n=2, seed=4),
                 dict(max_tokens=5, temperature=0.0), dict(max_tokens=6, beam_width=2)],
     [0, 0, 1]),
]


def _serve(model: Any, workload: tuple, write: Callable) -> list:
    """The tokens of every output of ``workload`` served with ``write`` as the hook."""
    from paged_lib.engine import EngineHooks, LLMEngine, SamplingParams

    name, options, prompts, params, arrivals = workload
    opts = dict(options)
    engine = LLMEngine(model, opts.pop("num_blocks"), opts.pop("block_size"),
                       attention_backend="torch", kv_cache_dtype="int8",
                       hooks=EngineHooks(write_int8_blocks=lambda x, data, scale, slots: write(
                           x.clone(), data, scale, slots.clone())), **opts)
    g = torch.Generator().manual_seed(113)
    shared = torch.randint(32, 127, (8,), generator=g).tolist()  # prompts past 8 share it
    texts = [(shared + torch.randint(32, 127, (n,), generator=g).tolist())[:n] if n > 8
             else torch.randint(32, 127, (n,), generator=g).tolist() for n in prompts]
    outs = engine.generate(texts, [SamplingParams(**p) for p in params],
                           arrival_steps=arrivals)
    return [[c.token_ids for c in o.outputs] for o in outs]


@functools.cache
def recorded() -> tuple[list[WriteCall], list[list]]:
    """Every call the library's engine makes to the write on :data:`QUANT_WORKLOADS`
    (with the library's answers), and each workload's tokens; once per
    process."""
    from paged_lib.kernels.kv_quant import write_int8_blocks
    from paged_lib.model import load_tiny_code_llama

    model = load_tiny_code_llama()
    per_pass = 2 * model.config.num_layers  # K then V of each layer, every forward pass
    calls: list[WriteCall] = []
    served = []
    with serving.one_thread():
        for w in QUANT_WORKLOADS:
            made: list[int] = []

            def record(x, data, scale, slots, w=w, made=made):
                k = len(made)
                made.append(k)
                call = snap(f"'{w[0]}', forward pass {k // per_pass}, layer "
                            f"{k % per_pass // 2}'s {'KV'[k % 2]}", x, data, scale, slots)
                write_int8_blocks(x, data, scale, slots)
                idx = torch.tensor(call.blocks, dtype=torch.long)
                call.lib_data, call.lib_scale = call.state()
                call.lib_data[idx], call.lib_scale[idx] = data[idx].cpu(), scale[idx].cpu()
                calls.append(call)

            served.append(_serve(model, w, record))
    return calls, served


#: every replayed call agreed, where a code one off at an exact tie is let through; served,
#: that code feeds the next layer, so the usual cause is the order of the requantising
_SERVE_HINT = ("every replayed call agreed up to a code one off at an exact tie, which the "
               "engine's next layer sees: requantise with the ratio first, round(q * (old / "
               "new)), not round(q * old / new), as the spec's exact codes ask; else look "
               "for state kept outside data and scale")


def _check_engine(fn: Callable) -> None:
    from paged_lib.model import load_tiny_code_llama

    calls, served = recorded()
    for call in calls:
        compare(fn, call, f"replaying the engine: in {call.where}, it wrote "
                           f"{len(call.slots)} token(s) to slots {call.slots.tolist()}")
    model = load_tiny_code_llama()
    for w, tokens in zip(QUANT_WORKLOADS, served, strict=True):
        with serving.one_thread():
            mine = _serve(model, w, fn)
        if mine != tokens:
            r = next(i for i, (a, b) in enumerate(zip(mine, tokens, strict=True)) if a != b)
            grading.fail(f"serving '{w[0]}' with your write plugged into the engine: request "
                         f"{r} generated {mine[r]}, the library's engine {tokens[r]}",
                         _SERVE_HINT)


def check_write_int8_blocks(fn: Callable[..., Any]) -> None:
    """11.3: ``write_int8_blocks(x, data, scale, slots)`` writes in place."""
    with grading.exercise("11.3"):
        for call in _edges():
            compare(fn, call, call.where)
        _check_engine(fn)
        numeric.check("11.3", numeric_int8.int8_cases(), lambda p: [
            compare(fn, call, call.where) for call in p.build()], numeric_int8.INT8_CONTRASTS)
