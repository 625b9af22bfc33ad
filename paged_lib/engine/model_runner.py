"""The model runner: the only part of the engine that touches tensors.

Per step it takes a :class:`~paged_lib.engine.model_input.ModelInput` (flat lists, built
once by the engine from the scheduler's decision, the same on every tensor-parallel rank)
and (1) does the sliding window's K/V edits (chapter 11), then the block moves the
scheduler asked for - swap out to the CPU pool, swap in, and copy-on-write inside the GPU
pool (:mod:`paged_lib.kernels.cache_ops`), (2) turns the sequences' tables and lengths
into an :class:`~paged_lib.model.AttentionMetadata` with :func:`build_metadata`, (3) runs
the model over the packed new tokens, and (4) returns the logits of each sequence's last
token. The KV caches are allocated once, filled with NaN: a kernel that reads a slot
nobody wrote turns the output into NaN instead of into a plausible wrong answer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from paged_lib.engine.model_input import ModelInput
from paged_lib.engine.window import apply_ops
from paged_lib.kernels.cache_ops import copy_blocks_in_pool, swap_blocks
from paged_lib.kernels.kv_quant import allocate_quantized_kv_caches
from paged_lib.model import AttentionMetadata, TinyLlama
from paged_lib.util import cdiv, keep_freed_memory

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def build_metadata(block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
                   block_size: int) -> AttentionMetadata:
    """Tensors for one step of a batch of sequences.

    Sequence ``s`` holds ``seq_lens[s]`` tokens once this step's ``query_lens[s]`` new
    ones are written; its K/V lives in ``block_tables[s]`` (physical blocks, logical
    order). The new tokens are the last ``query_lens[s]`` positions, packed back to back.

    Returns ``slot_mapping`` int64 ``[sum(query_lens)]`` (``block * block_size + offset``
    of each new token), ``block_tables`` int32 ``[num_seqs, longest table]`` padded with
    -1, ``seq_lens`` and ``query_lens`` int32 ``[num_seqs]``, ``positions`` int64.

    Example (block size 4): a sequence in blocks ``[7, 2]`` with ``seq_len`` 6 decoding 1
    token writes position 5, slot ``2 * 4 + 1 = 9``.
    """
    slots, positions = [], []
    for table, seq_len, query_len in zip(block_tables, seq_lens, query_lens, strict=True):
        for pos in range(seq_len - query_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
    width = max((len(t) for t in block_tables), default=0)
    padded = [t + [-1] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(padded, dtype=torch.int32).reshape(len(padded), width),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_lens=torch.tensor(query_lens, dtype=torch.int32),
        positions=torch.tensor(positions, dtype=torch.int64))


def check_metadata(meta: AttentionMetadata, num_blocks: int, block_size: int) -> None:
    """Check a step's metadata once (on the host), so the kernels need not, per layer.

    Raises ``ValueError`` naming the first problem: a wrong dtype or shape, a slot or a
    block outside the pool, a table too short for its sequence, a query longer than its
    sequence. Also records ``max_seq_len``, ``max_query_len`` and ``num_decodes`` on
    ``meta``.
    """
    for name, dtype in (("slot_mapping", torch.int64), ("block_tables", torch.int32),
                        ("seq_lens", torch.int32), ("query_lens", torch.int32),
                        ("positions", torch.int64)):
        t = getattr(meta, name)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"metadata.{name} must be a {dtype} tensor, got {got}")
    num_seqs = meta.seq_lens.shape[0]
    if meta.block_tables.ndim != 2 or meta.block_tables.shape[0] != num_seqs:
        raise ValueError(f"metadata.block_tables must be [num_seqs={num_seqs}, max_blocks], "
                         f"got {tuple(meta.block_tables.shape)}")
    seq_lens, query_lens = meta.seq_lens.tolist(), meta.query_lens.tolist()
    num_tokens = sum(query_lens)
    for name in ("slot_mapping", "positions"):
        if tuple(getattr(meta, name).shape) != (num_tokens,):
            raise ValueError(f"metadata.{name} must have one entry per new token "
                             f"({num_tokens}), got shape {tuple(getattr(meta, name).shape)}")
    slots = meta.slot_mapping
    if num_tokens and not (0 <= int(slots.min()) and int(slots.max()) < num_blocks * block_size):
        raise ValueError(f"metadata.slot_mapping has slots outside 0..{num_blocks * block_size - 1}"
                         f" ({num_blocks} blocks x {block_size})")
    for s, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        if not 1 <= query_len <= seq_len:
            raise ValueError(f"sequence {s}: query_len {query_len} must be in 1..seq_len "
                             f"({seq_len})")
    tables = meta.block_tables
    used = cdiv(meta.seq_lens.long(), block_size)  # blocks each sequence reads
    read = torch.arange(tables.shape[1])[None, :] < used[:, None]
    bad = (used > tables.shape[1]) | (read & ((tables < 0) | (tables >= num_blocks))).any(1)
    if bool(bad.any()):
        s = int(bad.nonzero()[0])
        raise ValueError(f"sequence {s}: its {seq_lens[s]} tokens need {int(used[s])} blocks "
                         f"of 0..{num_blocks - 1}, its block table row is {tables[s].tolist()}")
    meta.max_seq_len = max(seq_lens, default=0)
    meta.max_query_len = max(query_lens, default=0)
    meta.num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))


def allocate_kv_caches(model: TinyLlama, num_blocks: int, block_size: int,
                       device: torch.device | str, kv_cache_dtype: str = "auto") -> KVCaches:
    """One (K, V) pair per layer, ``[num_blocks, block_size, num_kv_heads, head_dim]``,
    filled with NaN (a read of a slot never written shows up as NaN). ``kv_cache_dtype``
    ``"int8"`` or ``"fp8_e4m3"`` (chapter 11): :class:`~paged_lib.kernels.kv_quant.QuantizedKV`
    pairs instead (8-bit data and its scales)."""
    cfg = model.config
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    if kv_cache_dtype != "auto":
        return allocate_quantized_kv_caches(kv_cache_dtype, cfg.num_layers, shape, device)
    return [(torch.full(shape, float("nan"), dtype=model.dtype, device=device),
             torch.full(shape, float("nan"), dtype=model.dtype, device=device))
            for _ in range(cfg.num_layers)]


class ModelRunner:
    """Owns the GPU (and CPU) KV caches and runs the model one step at a time."""

    def __init__(self, model: TinyLlama, num_blocks: int, block_size: int,
                 num_cpu_blocks: int = 0, backend: str = "torch",
                 build_metadata: Callable = build_metadata, kv_cache_dtype: str = "auto"):
        self.model = model
        self.block_size = block_size
        self.backend = backend
        self.build_metadata = build_metadata  # the hook (chapter 06)
        if torch.device(model.device).type == "cpu":
            keep_freed_memory()  # a step's activations reused, not faulted in anew
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, model.device,
                                            kv_cache_dtype)
        self.cpu_kv_caches = (allocate_kv_caches(model, num_cpu_blocks, block_size, "cpu",
                                                 kv_cache_dtype)
                              if num_cpu_blocks > 0 else [])

    @torch.no_grad()
    def execute(self, inp: ModelInput) -> torch.Tensor:
        """Logits ``[num_scheduled_seqs, vocab_size]`` (fp32) of each sequence's last token."""
        # keys of dropped blocks' successors re-rotated first (chapter 11), then the moves
        apply_ops(inp.window_ops, self.kv_caches, self.model.config.rope_theta)
        swap_blocks(self.kv_caches, self.cpu_kv_caches, inp.swap_out)  # before reuse
        swap_blocks(self.cpu_kv_caches, self.kv_caches, inp.swap_in)
        copy_blocks_in_pool(self.kv_caches, inp.blocks_to_copy, self.backend)
        if inp.is_empty():
            return torch.empty(0, self.model.config.vocab_size)
        meta = self.build_metadata(inp.block_tables, inp.seq_lens, inp.query_lens,
                                   self.block_size)
        check_metadata(meta, self.kv_caches[0][0].shape[0], self.block_size)
        meta = _to_device(meta, self.model.device)
        input_ids = torch.tensor(inp.input_ids, dtype=torch.int64, device=self.model.device)
        hidden = self.model(input_ids, self.kv_caches, meta, backend=self.backend,
                            validate=False)
        return self.model.compute_logits(hidden[meta.logits_indices.to(hidden.device)])


def _to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    if meta.slot_mapping.device == device:
        return meta
    return AttentionMetadata(*(t.to(device) for t in (
        meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_lens, meta.positions)),
        max_seq_len=meta.max_seq_len, max_query_len=meta.max_query_len,
        num_decodes=meta.num_decodes)
