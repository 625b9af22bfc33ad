"""Sliding window with attention sinks on blocks (chapter 11; StreamingLLM, arXiv:2309.17453).

``LLMEngine(..., sliding_window=W, num_sink_tokens=S)`` keeps, per sequence, the first
``S`` tokens of its text (the *sinks*) and its most recent tokens, and gives every block
that falls out of the window back to the allocator, so a stream of any length holds at
most :attr:`SlidingWindow.max_blocks` blocks.

**What attention sees.** The cache of a sequence is a logical run of tokens, in order:
``S`` sinks, then the recent tokens. Recent tokens leave a whole block at a time: when
the next token would make ``W + B`` recent tokens (``B`` the block size), the ``B``
oldest go. So a query sees the sinks and its last ``W`` to ``W + B - 1`` tokens (itself
included), exactly those: the block table handed to the kernels lists only kept blocks
and ``seq_lens`` counts only kept tokens, so the kernels are unchanged. Positions are
taken *within the cache*, as StreamingLLM does: the cached tokens sit at positions
``0 .. len(cache) - 1`` and the next token at ``len(cache)``, so a model trained on short
texts runs a stream of any length at positions it knows (``S + W + B - 1`` must not
exceed its ``max_position``: 512 for the shipped model, trained on 257-token windows).

**Sinks are exact, not whole blocks.** The ``B`` tokens that leave are logical
positions ``S .. S + B - 1``: the tail of the block holding the last sinks and the head
of the next one. The engine frees the block at logical index ``S // B`` and, when
``S % B = r > 0``, first copies the ``r`` sinks in it to offsets ``0 .. r - 1`` of the
next block (they overwrite tokens that left). Every recent token moves back by exactly
``B`` positions, which keeps it at the same offset one logical block earlier: no other
data moves. One block freed per ``B`` tokens, ``r`` slots copied.

**Keys are stored after RoPE** (:mod:`paged_lib.model`), so moving a token back ``B``
positions means rotating its cached key by ``-B`` (RoPE rotations compose:
``R(p - B) = R(-B) R(p)``); values carry no position. Sinks never move. Cost: every
``B`` tokens, one read and one write of the window's keys (``W .. W + B - 1`` tokens x
layers x KV heads x head size), against the ``B`` reads of every kept key that attention
does over those steps: about ``2/B`` more K traffic. A key is rotated at most
``W / B + 1`` times in its life, so rounding does not pile up with the stream's length.
The alternative that avoids rotating the window: keep original positions and rotate
only the ``S`` sinks forward by ``+B`` (RoPE scores depend on position differences
only, so the recent tokens' distances are already right); it is cheaper, but positions
then grow without bound, and fp32 angles lose precision as they grow (about
``p x 6e-8`` radians at position ``p``). A third way caches keys before
RoPE and rotates them at every decoding step (StreamingLLM's own choice, its section
3.2): it needs a kernel change and rotates every kept key on every step.

**vLLM's sliding window is a different thing.** It serves models *trained* with one
(Mistral-7B's 4096 tokens): positions stay the original ones, there are no sinks, the
kernel masks keys older than the window, and the block manager frees blocks wholly
before ``num_computed - window + 1``; vLLM's hybrid KV cache manager keeps only the
most recent ``sliding_window_size`` tokens' slots for such layers (vLLM docs, "Hybrid KV
Cache Manager"). Here the model was trained on full attention over short texts;
re-positioning and sinks are what let it run past them.

**Not supported** (``ValueError``): prefix caching (cached blocks are shared and hashed
by their text; windowed blocks are rewritten), swap preemption, ``n > 1`` and beam
search (shared blocks would be rewritten for all holders), a prompt longer than
``S + W`` (the prefill kernel would let it attend to all of itself). A windowed sequence
is never preempted: admission counts each request's :meth:`SlidingWindow.max_blocks`
and what running ones may still take (:meth:`SlidingWindow.reserving`), because the
K/V of dropped tokens cannot be recomputed; a custom ``admission`` hook that ignores
the count and gets a windowed sequence preempted is a ``RuntimeError``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from paged_lib.blocks import BlockTable
from paged_lib.engine.block_manager import shared_prompt_blocks
from paged_lib.engine.reservation import reserving
from paged_lib.engine.scheduler_output import SchedulerOutput
from paged_lib.engine.sequence import SamplingParams, Sequence, SequenceGroup
from paged_lib.model import apply_rope, rope_cos_sin
from paged_lib.util import cdiv


def num_dropped(num_tokens: int, window: int, num_sink_tokens: int, block_size: int) -> int:
    """Tokens a sequence has dropped from its cache once ``num_tokens`` tokens of its text
    have been fed in: whole units of ``block_size``, so that between ``window`` and
    ``window + block_size - 1`` recent tokens stay after the sinks.

    Example (window 8, 2 sinks, block size 4): 13 tokens -> 0 dropped (11 recent);
    14 -> 4 (8 recent); 17 -> 4 (11 recent); 18 -> 8.
    """
    return max(0, (num_tokens - num_sink_tokens - window) // block_size) * block_size


def kept_tokens(num_tokens: int, window: int, num_sink_tokens: int, block_size: int) -> list[int]:
    """Text indices of the tokens in the cache after ``num_tokens`` were fed, in cache
    order (the token at list index ``i`` has position ``i``): the sinks, then the recent."""
    gone = num_dropped(num_tokens, window, num_sink_tokens, block_size)
    sinks = min(num_sink_tokens, num_tokens)
    return list(range(sinks)) + list(range(sinks + gone, num_tokens))


def window_blocks(num_tokens: int, window: int, num_sink_tokens: int, block_size: int) -> int:
    """Blocks one windowed sequence holds after ``num_tokens`` tokens were fed."""
    return cdiv(len(kept_tokens(num_tokens, window, num_sink_tokens, block_size)), block_size)


@dataclass(frozen=True)
class WindowOp:
    """The K/V edits one dropped block asks of the model runner: rotate the keys at
    ``rotate_slots`` (``block * block_size + offset``) by ``-shift`` positions, then
    copy the first ``copy_len`` slots of block ``copy_src`` into ``copy_dst``."""

    rotate_slots: tuple[int, ...]
    shift: int
    copy_src: int = -1
    copy_dst: int = -1
    copy_len: int = 0


def drop_oldest(table: BlockTable, num_sink_tokens: int) -> tuple[BlockTable, WindowOp]:
    """Drop the ``block_size`` oldest recent tokens (logical ``S .. S + B - 1``) from a
    table holding at least ``S + B`` tokens.

    Returns the new table (the old one is spent: its references move to the new one, and
    the dropped block goes back to its allocator) and the K/V edits that keep the cache
    right (module docstring). Pure Python: nothing touches tensors.
    Example (block size 4, 2 sinks): blocks ``[7, 3, 5]`` holding 11 tokens ->
    ``[3, 5]`` holding 7; block 7 freed, its 2 sinks copied to block 3, keys of the 5
    recent tokens (slots 14, 15, 20, 21, 22) rotated by -4.
    """
    bs, sinks = table.block_size, num_sink_tokens
    if table.num_tokens < sinks + bs:
        raise ValueError(f"a table of {table.num_tokens} tokens has no {bs} recent tokens "
                         f"to drop after {sinks} sinks")
    blocks, gone = table.blocks, sinks // bs
    shared = [b for b in blocks[gone:] if table.allocator.refcount(b) > 1]
    if shared:
        raise ValueError(f"blocks {shared} are shared: dropping rewrites the keys after the "
                         "sinks (a windowed table cannot be forked)")
    kept = blocks[:gone] + blocks[gone + 1:]
    new = BlockTable(table.allocator, bs, kept, table.num_tokens - bs)
    table.allocator.free(blocks[gone])
    rotate = tuple(kept[x // bs] * bs + x % bs for x in range(sinks, new.num_tokens))
    r = sinks % bs
    if r == 0:
        return new, WindowOp(rotate, bs)
    return new, WindowOp(rotate, bs, blocks[gone], blocks[gone + 1], r)


def apply_ops(ops: list[WindowOp], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              rope_theta: float) -> None:
    """Do the edits of ``ops``, in order, on every layer's ``(k_cache, v_cache)``."""
    for op in ops:
        for k_cache, v_cache in kv_caches:
            _, bs, heads, dim = k_cache.shape
            if op.rotate_slots:
                flat = k_cache.view(-1, heads, dim)
                idx = torch.tensor(op.rotate_slots, dtype=torch.int64, device=k_cache.device)
                pos = torch.full((len(op.rotate_slots),), -op.shift)
                cos, sin = rope_cos_sin(pos, dim, rope_theta, k_cache.dtype)
                flat[idx] = apply_rope(flat[idx], cos.to(k_cache.device),
                                       sin.to(k_cache.device))
            if op.copy_len:
                k_cache[op.copy_dst, :op.copy_len] = k_cache[op.copy_src, :op.copy_len]
                v_cache[op.copy_dst, :op.copy_len] = v_cache[op.copy_src, :op.copy_len]


#: The engine options a window works with, at the only value it takes.
_SUPPORTED = {"enable_prefix_caching": False, "preemption": "recompute",
              "tensor_parallel_size": 1, "kv_cache_dtype": "auto"}


def make_window(sliding_window: int | None, num_sink_tokens: int, block_size: int, config,
                drop_oldest: Callable = drop_oldest, **options) -> SlidingWindow | None:
    """``LLMEngine``'s window (``None`` without ``sliding_window``), checked: a bad value,
    sinks without a window, or an engine option it does not combine with (``options``,
    e.g. ``enable_prefix_caching=True``, ``preemption="swap"``) is a ``ValueError``.
    ``drop_oldest``: the engine's hook (``EngineHooks.drop_oldest``)."""
    if sliding_window is None:
        if num_sink_tokens != 0:
            raise ValueError(f"num_sink_tokens={num_sink_tokens!r} needs sliding_window")
        return None
    for name, value in options.items():
        if value != _SUPPORTED[name]:
            raise ValueError(f"sliding_window does not combine with {name}={value!r} (see "
                             "paged_lib.engine.window for why)")
    return SlidingWindow(sliding_window, num_sink_tokens, block_size, config.max_position,
                         config.rope_theta, drop_oldest=drop_oldest)


class SlidingWindow:
    """The engine's window: drops blocks as sequences grow, keeps the edits for the runner.

    Hooks (each one line in the shared engine files): :meth:`slide` before a step is
    scheduled (and :meth:`check_no_preemption` after), :meth:`cache_len` for the
    ``seq_lens`` the kernels get, its ``pending`` edits handed to the step's
    :class:`~paged_lib.engine.model_input.ModelInput` (the runner does them before the
    forward pass), :meth:`check_request` and :meth:`reserving` at admission.
    """

    def __init__(self, window: int, num_sink_tokens: int, block_size: int,
                 max_position: int | None = None, rope_theta: float = 10000.0,
                 drop_oldest: Callable = drop_oldest):
        for name, v, low in (("sliding_window", window, 1), ("num_sink_tokens",
                                                             num_sink_tokens, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        span = num_sink_tokens + window + block_size - 1
        if max_position is not None and span > max_position:
            raise ValueError(f"sliding_window={window} + num_sink_tokens={num_sink_tokens} + "
                             f"block_size - 1 = {span} cached tokens need positions past the "
                             f"model's max_position {max_position}: make the window smaller")
        self.window, self.num_sink_tokens, self.block_size = window, num_sink_tokens, block_size
        self.rope_theta = rope_theta
        #: the release of one block (``EngineHooks.drop_oldest``, chapter 11's 11.4)
        self.drop_oldest = drop_oldest
        self.pending: list[WindowOp] = []
        self._dropped: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()

    @property
    def max_blocks(self) -> int:
        """The most blocks one windowed sequence ever holds: sinks plus ``W + B - 1``."""
        return cdiv(self.num_sink_tokens + self.window + self.block_size - 1, self.block_size)

    def dropped(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s text no longer in its cache."""
        return self._dropped.get(seq, 0)

    def cache_len(self, seq: Sequence, num_text_tokens: int) -> int:
        """Tokens in ``seq``'s cache when its first ``num_text_tokens`` have K/V."""
        return num_text_tokens - self.dropped(seq)

    def check_no_preemption(self, out: SchedulerOutput) -> None:
        """``RuntimeError`` if this step preempted a sequence that dropped tokens: their
        K/V cannot be recomputed (a custom ``admission`` hook can cause it)."""
        for group in out.preempted:
            for seq in group.seqs:
                if self.dropped(seq):
                    raise RuntimeError(
                        f"request {group.request_id} was preempted after its window dropped "
                        f"{self.dropped(seq)} tokens, whose K/V cannot be recomputed: keep "
                        "the default admission (it reserves each stream's blocks), or give "
                        "the pool more blocks")

    def slide(self, seq: Sequence) -> int:
        """Drop what must go before ``seq`` feeds its next token (``num_cached + 1``
        tokens fed then); returns the blocks freed. Idempotent until it feeds."""
        table = seq.block_table
        if table is None or table.num_tokens != seq.num_cached - self.dropped(seq):
            return 0  # not in the GPU pool, or part way through a chunked prefill
        freed = 0
        target = num_dropped(seq.num_cached + 1, self.window, self.num_sink_tokens,
                             self.block_size)
        while self.dropped(seq) < target:
            seq.block_table, op = self.drop_oldest(seq.block_table, self.num_sink_tokens)
            self.pending.append(op)
            self._dropped[seq] = self.dropped(seq) + self.block_size
            freed += 1
        return freed

    def slide_all(self, groups: list[SequenceGroup]) -> int:
        """:meth:`slide` every live sequence of the running ``groups``."""
        return sum(self.slide(s) for g in groups for s in g.live_seqs())

    def apply(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Do the pending K/V edits on ``kv_caches`` now (the engine instead hands them to
        the step's model input; a study that drives a cache by hand calls this)."""
        ops, self.pending = self.pending, []
        apply_ops(ops, kv_caches, self.rope_theta)

    # ------------------------------------------------------------ admission

    def check_request(self, i: int, prompt: list[int], params: SamplingParams) -> None:
        """``ValueError`` for a request the window cannot serve (module docstring)."""
        if params.num_seqs != 1:
            raise ValueError(f"request {i}: sliding_window serves one sequence per request "
                             f"(n=1, no beam search), got {params.num_seqs}: windowed "
                             "blocks are rewritten, so they cannot be shared")
        if len(prompt) > self.num_sink_tokens + self.window:
            raise ValueError(f"request {i}: its prompt of {len(prompt)} tokens is longer than "
                             f"num_sink_tokens + sliding_window = "
                             f"{self.num_sink_tokens + self.window}; the prefill would attend "
                             "to all of it")

    def blocks_at_most(self, prompt_len: int, max_tokens: int) -> int:
        """The most blocks a request ever holds: its whole text, or the window's cap."""
        whole = shared_prompt_blocks(prompt_len, [max_tokens - 1], self.block_size)
        return min(whole, self.max_blocks)

    def reserving(self, num_required_blocks: Callable,
                  running: Callable[[], list[SequenceGroup]]) -> Callable:
        """An admission count that also reserves growth: a waiting group needs its
        :meth:`blocks_at_most` plus what the ``running()`` groups may still take, so
        free blocks always cover every windowed sequence up to its cap (no preemption;
        :func:`~paged_lib.engine.reservation.reserving`)."""
        return reserving(num_required_blocks, running, lambda g: self.blocks_at_most(
            len(g.prompt_token_ids), g.params.max_tokens))
