"""How much KV memory sharing saves: parallel sampling and beam search, measured on blocks.

The paper (Kwon et al., SOSP 2023, section 6.3) measures the memory vLLM saves by
sharing KV blocks: 6.1%-9.8% for parallel sampling and 37.6%-55.2% for beam search on
Alpaca; 16.2%-30.5% and 44.3%-66.3% on ShareGPT. This module reproduces the *kind* of
measurement with chapter 03's real :class:`~paged_lib.blocks.BlockAllocator` and
:class:`~paged_lib.blocks.BlockTable` (``fork`` and copy-on-write ``append_token``), and no
model:

* **Parallel sampling** (:func:`parallel_sampling_usage`): the prompt is prefilled into
  one table, which is forked ``n - 1`` times; every sample then appends one token per
  step. The prompt's full blocks stay shared; its last, partly filled block is copied
  on each sample's first write (all but the last writer).
* **Beam search** (:func:`beam_search_usage`): a seeded *synthetic* beam process. Each
  step every live beam proposes its ``W`` most likely next tokens under random
  log-probabilities (a fresh random softmax over a small vocabulary), and the engine's
  own :func:`~paged_lib.engine.beam_search.beam_step` keeps the ``W`` best candidates by
  cumulative log-probability: beams with no surviving child are freed, a parent's first
  surviving child keeps its table, every further child forks it. Then each survivor
  appends its token (copy-on-write where the last block is shared).

"Without sharing" is the same work with every sequence holding its own copy of all its
tokens (``cdiv(num_tokens, block_size)`` blocks each), as a system without paging or
copy-on-write must. A trace's requests are overlaid at their arrival steps with no
memory limit and no scheduler, and the saving is ``1 - shared / unshared`` for the
peak and for the time-averaged number of blocks.

Assumptions, against the paper's real runs (OPT-13B on the real traces, under a
scheduler): every sample and beam generates exactly the request's ``output_len`` tokens
(no EOS, so no sample finishes early); beam scores come from random log-probabilities,
not a model, so how often beams collapse onto one ancestor is only roughly like a real
model's; the traces are synthetic (chapter 02) with the paper's mean lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from paged_lib.blocks import BlockAllocator, BlockTable, Slot
from paged_lib.util import cdiv
from paged_lib.workloads import Request

#: The paper's savings (section 6.3), as (low, high) over its widths 2, 4, 6.
PAPER_SAVINGS: dict[tuple[str, str], tuple[float, float]] = {
    ("alpaca", "parallel"): (0.061, 0.098),
    ("alpaca", "beam"): (0.376, 0.552),
    ("sharegpt", "parallel"): (0.162, 0.305),
    ("sharegpt", "beam"): (0.443, 0.663),
}
MODES = ("parallel", "beam")


@dataclass(frozen=True)
class Usage:
    """Blocks one request holds after prefill (index 0) and after each decode step."""

    shared: list[int]    # physical blocks in use, with fork and copy-on-write
    unshared: list[int]  # blocks the same sequences hold when none is shared
    copies: int          # copy-on-write block copies made

    @property
    def peak_ratio(self) -> float:
        """Peak blocks with sharing over peak blocks without (below 1: sharing helps)."""
        return max(self.shared) / max(self.unshared)


def unshared_blocks(tables: list[BlockTable], block_size: int) -> int:
    return sum(cdiv(t.num_tokens, block_size) for t in tables)


def _in_use(allocator: BlockAllocator) -> int:
    return allocator.num_blocks - allocator.num_free


def _pool(prompt_len: int, output_len: int, width: int, block_size: int) -> BlockAllocator:
    """A pool that cannot run out: every sequence with its own copy of everything."""
    for name, value in (("prompt_len", prompt_len), ("width", width),
                        ("block_size", block_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if output_len < 0:
        raise ValueError(f"output_len must be >= 0, got {output_len}")
    return BlockAllocator(width * cdiv(prompt_len + output_len, block_size) + width + 1)


def _prefill(allocator: BlockAllocator, prompt_len: int, block_size: int) -> BlockTable:
    table = BlockTable(allocator, block_size)
    for _ in range(prompt_len):
        table.append_token()
    return table


def parallel_sampling_usage(prompt_len: int, output_len: int, n: int,
                            block_size: int = 16) -> Usage:
    """``n`` samples of one prompt, each ``output_len`` tokens long, on shared blocks."""
    allocator = _pool(prompt_len, output_len, n, block_size)
    first = _prefill(allocator, prompt_len, block_size)
    tables = [first] + [first.fork() for _ in range(n - 1)]
    shared, unshared, copies = [_in_use(allocator)], [unshared_blocks(tables, block_size)], 0
    for _ in range(output_len):
        copies += sum(t.append_token().copy is not None for t in tables)
        shared.append(_in_use(allocator))
        unshared.append(unshared_blocks(tables, block_size))
    return Usage(shared, unshared, copies)


# ------------------------------------------------------------------ the cache side

SlotWriter = Callable[[torch.Tensor, torch.Tensor, Slot, torch.Tensor, torch.Tensor], None]


def apply_slot(k_cache: torch.Tensor, v_cache: torch.Tensor, slot: Slot, key: torch.Tensor,
               value: torch.Tensor) -> None:
    """Write one token's ``key``/``value`` ``[num_kv_heads, head_dim]`` where ``slot`` says.

    On copy-on-write (``slot.copy = (src, dst)``) the whole block ``src`` is copied into
    ``dst`` first, so ``dst`` holds the tokens the sequence shared before it gets the new
    one; ``src`` itself is never written (other sequences still read it).
    """
    from paged_lib.kernels.copy_blocks import copy_blocks

    if slot.copy is not None:
        copy_blocks(k_cache, v_cache, [slot.copy], backend="torch")
    k_cache[slot.block, slot.offset] = key
    v_cache[slot.block, slot.offset] = value


@dataclass(frozen=True)
class SamplingDemo:
    """Parallel sampling on a real (NaN-poisoned) cache, checked by attention."""

    blocks: list[list[int]]            # each sample's block table at the end
    copies: list[tuple[int, int]]      # copy-on-write copies, in order
    blocks_in_use: int                 # with sharing
    blocks_unshared: int               # if each sample held its own copy
    max_error: float                   # paged attention vs each sample's own contiguous K/V


def parallel_sampling_demo(write: SlotWriter = apply_slot, n: int = 4, prompt_len: int = 6,
                           new_tokens: int = 5, block_size: int = 4, num_heads: int = 4,
                           num_kv_heads: int = 2, head_dim: int = 16, seed: int = 0
                           ) -> SamplingDemo:
    """Prefill a prompt, fork it ``n`` ways, let each sample write its own tokens, attend.

    Every K/V goes into the cache through ``write`` (:func:`apply_slot`, or a learner's
    version). Then one decode query per sample runs through
    :func:`paged_lib.kernels.paged_attention` over the *shared* blocks and is compared
    with PyTorch's SDPA on that sample's own tokens, kept aside in contiguous tensors: a
    missing or wrong copy shows up as a large error or NaN.
    """
    from paged_lib.kernels import paged_attention
    from paged_lib.kernels.reference import sdpa_per_sequence

    g = torch.Generator().manual_seed(seed)
    num_blocks = n * cdiv(prompt_len + new_tokens, block_size) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    allocator = BlockAllocator(num_blocks)

    def token() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(num_kv_heads, head_dim, generator=g),
                torch.randn(num_kv_heads, head_dim, generator=g))

    prompt = BlockTable(allocator, block_size)
    own = [token() for _ in range(prompt_len)]
    for kv in own:
        write(k_cache, v_cache, prompt.append_token(), *kv)
    tables = [prompt] + [prompt.fork() for _ in range(n - 1)]
    history = [list(own) for _ in range(n)]
    copies = []
    for _ in range(new_tokens):
        for table, hist in zip(tables, history, strict=True):
            slot, kv = table.append_token(), token()
            copies += [slot.copy] if slot.copy else []
            write(k_cache, v_cache, slot, *kv)
            hist.append(kv)
    q = torch.randn(n, num_heads, head_dim, generator=g)
    width = max(len(t.blocks) for t in tables)
    block_tables = torch.tensor([t.blocks + [-1] * (width - len(t.blocks)) for t in tables],
                                dtype=torch.int32)
    seq_lens = torch.tensor([t.num_tokens for t in tables], dtype=torch.int32)
    out = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, backend="torch")
    kv = [(torch.stack([k for k, _ in h], 1), torch.stack([v for _, v in h], 1))
          for h in history]
    want = sdpa_per_sequence(q, kv, head_dim ** -0.5)
    err = (out - want).abs().max()
    return SamplingDemo([t.blocks for t in tables], copies, _in_use(allocator),
                        unshared_blocks(tables, block_size),
                        float("nan") if torch.isnan(err) else float(err))


def tiny_random_llama(seed: int = 0):
    """The chapter's engine model: a seeded random tiny Llama built with ``transformers``
    (nothing downloaded) and the same weights as a :class:`~paged_lib.model.TinyLlama`.

    Returns ``(transformers model, TinyLlama)``: the first checks the engine's beams.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from paged_lib.model import TinyLlama

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=None, bos_token_id=None)
    hf_model = LlamaForCausalLM(config).float().eval()
    return hf_model, TinyLlama.from_hf(hf_model)


# ------------------------------------------------------------------ beam search


#: ``beam_step(tables, cum_logprobs, candidates, beam_width)`` ->
#: ``[(parent, table, token, cum_logprob), ...]``, the engine's hook (see
#: :func:`paged_lib.engine.beam_search.beam_step`).
BeamStepFn = Callable[[list[BlockTable], list[float], list[list[tuple[int, float]]], int],
                      list[tuple[int, BlockTable, int, float]]]


class RandomBeamScorer:
    """Seeded stand-in for a model: each beam's next-token log-probabilities.

    Every call draws logits ``N(0, sigma^2)`` over ``vocab`` tokens per beam and returns
    their log-softmax ``[num_beams, vocab]``. ``sigma`` sets how peaked the
    distributions are, hence how often one beam's children crowd out the others.
    """

    def __init__(self, seed: int = 0, vocab: int = 32, sigma: float = 2.0):
        self.rng = np.random.default_rng(seed)
        self.vocab, self.sigma = vocab, sigma

    def __call__(self, num_beams: int) -> np.ndarray:
        logits = self.rng.normal(0.0, self.sigma, size=(num_beams, self.vocab))
        logits -= logits.max(axis=1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))


def top_candidates(logprobs: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    """Each beam's ``k`` likeliest ``(token, logprob)``, best first (ties: lower token).

    The same candidates the engine's sampler hands to ``beam_step`` (``torch.topk`` of a
    beam's log-probabilities), from the rows of ``logprobs [num_beams, vocab]``.
    """
    out = []
    for row in logprobs:
        best = np.lexsort((np.arange(row.size), -row))[:k]
        out.append([(int(t), float(row[t])) for t in best])
    return out


@dataclass(frozen=True)
class BeamFrame:
    """One recorded step of a beam search (for pictures and the stepper widget)."""

    step: int
    parents: list[int]          # parent (old beam index) of each new beam
    tokens: list[int]           # token each new beam appended
    blocks: list[list[int]]     # each new beam's block table after the step
    ref_counts: dict[int, int]  # ref count of every block in use
    copies: list[tuple[int, int]]
    freed_beams: list[int]      # old beams that died this step
    freed_blocks: list[int]     # physical blocks that went back to the pool
    scores: list[float]
    num_tokens: list[int]       # each new beam's length (prompt + generated)
    block_size: int


def beam_search_usage(prompt_len: int, output_len: int, beam_width: int,
                      block_size: int = 16, seed: int = 0, step_fn: BeamStepFn | None = None,
                      record: list[BeamFrame] | None = None, **scorer_kw) -> Usage:
    """A synthetic beam search of ``output_len`` steps over block tables.

    Each step: every live beam's ``beam_width`` best candidates under
    :class:`RandomBeamScorer`; ``step_fn`` (default: the engine's
    :func:`~paged_lib.engine.beam_search.beam_step`, or a learner's) keeps the best
    continuations, forks and frees the tables; then every new beam appends its token
    (copy-on-write where its last block is shared), as the engine does next step.
    ``record``, if given, receives a :class:`BeamFrame` per step.
    """
    if step_fn is None:
        from paged_lib.engine.beam_search import beam_step as step_fn
    allocator = _pool(prompt_len, output_len, beam_width, block_size)
    scorer = RandomBeamScorer(seed, **scorer_kw)
    tables = [_prefill(allocator, prompt_len, block_size)]
    cum = [0.0]
    shared, unshared, copies = [_in_use(allocator)], [unshared_blocks(tables, block_size)], 0
    if record is not None:
        record.append(_frame(0, [0], [-1], tables, allocator, [], [], set(), cum))
    for step in range(1, output_len + 1):
        candidates = top_candidates(scorer(len(tables)), beam_width)
        old_blocks = [t.blocks for t in tables]  # a freed table forgets its blocks
        new = step_fn(list(tables), list(cum), candidates, beam_width)
        parents = [int(p) for p, _, _, _ in new]
        tokens = [int(t) for _, _, t, _ in new]
        tables, cum = [t for _, t, _, _ in new], [float(c) for _, _, _, c in new]
        step_copies = [s.copy for s in (t.append_token() for t in tables) if s.copy]
        copies += len(step_copies)
        shared.append(_in_use(allocator))
        unshared.append(unshared_blocks(tables, block_size))
        if record is not None:
            freed = sorted(set(range(len(old_blocks))) - set(parents))
            dead = {b for i in freed for b in old_blocks[i]}
            record.append(_frame(step, parents, tokens, tables, allocator, step_copies,
                                 freed, dead, cum))
    return Usage(shared, unshared, copies)


def _frame(step, parents, tokens, tables, allocator, copies, freed, dead_blocks, scores):
    in_use = {b for t in tables for b in t.blocks}
    return BeamFrame(step, list(parents), list(tokens), [t.blocks for t in tables],
                     {b: allocator.refcount(b) for b in sorted(in_use)}, list(copies),
                     list(freed), sorted(b for b in dead_blocks if allocator.refcount(b) == 0),
                     [round(float(s), 4) for s in scores], [t.num_tokens for t in tables],
                     tables[0].block_size)


def record_beam_search(prompt_len: int = 6, output_len: int = 10, beam_width: int = 3,
                       block_size: int = 4, seed: int = 0, step_fn: BeamStepFn | None = None,
                       **scorer_kw) -> tuple[list[BeamFrame], Usage]:
    """A small beam search recorded step by step, for the beam-tree pictures."""
    frames: list[BeamFrame] = []
    usage = beam_search_usage(prompt_len, output_len, beam_width, block_size, seed, step_fn,
                              frames, **scorer_kw)
    return frames, usage


# ------------------------------------------------------------------ traces


@dataclass(frozen=True)
class Savings:
    """Blocks with and without sharing over a whole trace, and the fraction saved."""

    mode: str
    width: int
    peak_shared: int
    peak_unshared: int
    mean_shared: float
    mean_unshared: float
    copies: int
    per_request_saving: float  # mean over requests of each one's own time-averaged saving

    @property
    def peak_saving(self) -> float:
        return 1.0 - self.peak_shared / self.peak_unshared

    @property
    def mean_saving(self) -> float:
        return 1.0 - self.mean_shared / self.mean_unshared


def request_usage(request: Request, mode: str, width: int, block_size: int = 16,
                  seed: int = 0) -> Usage:
    """One request's usage under parallel sampling (``n = width``) or beam search."""
    if mode == "parallel":
        return parallel_sampling_usage(request.prompt_len, request.output_len, width,
                                       block_size)
    if mode == "beam":
        return beam_search_usage(request.prompt_len, request.output_len, width, block_size,
                                 seed)
    raise ValueError(f"unknown mode {mode!r}: choose one of {MODES}")


def trace_savings(requests: list[Request], mode: str, width: int, block_size: int = 16,
                  seed: int = 0) -> Savings:
    """Overlay every request's usage at its arrival step; compare peak and mean blocks.

    The overlay weighs each request by its blocks x steps, so long requests dominate;
    ``per_request_saving`` counts every request once, to show how much that matters.

    Request ``i`` of a beam trace uses scorer seed ``seed + i``. The time average runs
    from the first arrival to the last step any request holds blocks.
    """
    if not requests:
        raise ValueError("trace_savings needs at least one request")
    usages = [request_usage(r, mode, width, block_size, seed + i)
              for i, r in enumerate(requests)]
    starts = [int(np.ceil(r.arrival)) for r in requests]
    horizon = max(s + len(u.shared) for s, u in zip(starts, usages, strict=True))
    shared, unshared = np.zeros(horizon, np.int64), np.zeros(horizon, np.int64)
    for s, u in zip(starts, usages, strict=True):
        shared[s:s + len(u.shared)] += u.shared
        unshared[s:s + len(u.unshared)] += u.unshared
    window = slice(min(starts), horizon)
    own = np.mean([1.0 - sum(u.shared) / sum(u.unshared) for u in usages])
    return Savings(mode, width, int(shared.max()), int(unshared.max()),
                   float(shared[window].mean()), float(unshared[window].mean()),
                   sum(u.copies for u in usages), float(own))


def savings_table(traces: dict[str, list[Request]], widths: tuple[int, ...] = (2, 4, 6),
                  block_size: int = 16, seed: int = 0) -> dict[tuple[str, str, int], Savings]:
    """:func:`trace_savings` for every trace, mode and width: ``{(trace, mode, width): ...}``."""
    return {(name, mode, w): trace_savings(reqs, mode, w, block_size, seed)
            for name, reqs in traces.items() for mode in MODES for w in widths}
