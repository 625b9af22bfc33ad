"""The model runner: the only part of the engine that touches tensors.

Per step it (1) performs the block copies the scheduler asked for - swap out to the CPU
pool, swap in, and copy-on-write inside the GPU pool (with chapter 08's
:func:`paged_lib.kernels.copy_blocks.copy_blocks`) - (2) turns the scheduled sequences
into an :class:`~paged_lib.model.AttentionMetadata` with :func:`build_metadata`, (3) runs
the model over the packed new tokens, and (4) returns the logits of each sequence's last
token. The KV caches are allocated once, filled with NaN: a kernel that reads a slot
nobody wrote turns the output into NaN instead of into a plausible wrong answer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from paged_lib.engine.scheduler import SchedulerOutput
from paged_lib.kernels.copy_blocks import copy_blocks as copy_blocks_kernel
from paged_lib.kernels.kv_quant import allocate_quantized_kv_caches, copy_quantized_kv, is_quantized
from paged_lib.model import AttentionMetadata, TinyLlama
from paged_lib.util import cdiv

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
    ``"int8"`` or ``"fp8_e4m3"`` (chapter 11): :class:`~paged_lib.kv_quant.QuantizedKV`
    pairs instead (8-bit data and its scales)."""
    cfg = model.config
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    if kv_cache_dtype != "auto":
        return allocate_quantized_kv_caches(kv_cache_dtype, cfg.num_layers, shape, device)
    return [(torch.full(shape, float("nan"), dtype=model.dtype, device=device),
             torch.full(shape, float("nan"), dtype=model.dtype, device=device))
            for _ in range(cfg.num_layers)]


def swap_blocks(src_caches: KVCaches, dst_caches: KVCaches,
                pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks ``src -> dst`` from one pool to the other, every layer (swap
    out: GPU to CPU; swap in: CPU to GPU)."""
    if not pairs:
        return
    if is_quantized(src_caches[0][0]):  # chapter 11: the blocks' scales travel with them
        return copy_quantized_kv(src_caches, dst_caches, pairs)
    device = src_caches[0][0].device
    src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64,
                       device=dst_caches[0][0].device)
    for (sk, sv), (dk, dv) in zip(src_caches, dst_caches, strict=True):
        dk[dst] = sk[src].to(dk.device)
        dv[dst] = sv[src].to(dv.device)


class ModelRunner:
    """Owns the GPU (and CPU) KV caches and runs the model one step at a time."""

    window = None  # chapter 11: the engine's SlidingWindow (K/V edits, kept lengths)

    def __init__(self, model: TinyLlama, num_blocks: int, block_size: int,
                 num_cpu_blocks: int = 0, backend: str = "torch",
                 build_metadata_fn: Callable = build_metadata, kv_cache_dtype: str = "auto"):
        self.model = model
        self.block_size = block_size
        self.backend = backend
        self.build_metadata = build_metadata_fn
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, model.device,
                                            kv_cache_dtype)
        self.cpu_kv_caches = (allocate_kv_caches(model, num_cpu_blocks, block_size, "cpu",
                                                 kv_cache_dtype)
                              if num_cpu_blocks > 0 else [])

    @torch.no_grad()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits ``[num_scheduled_seqs, vocab_size]`` (fp32) of each sequence's last token."""
        if self.window is not None:  # keys of dropped blocks' successors re-rotated first
            self.window.apply(self.kv_caches)
        swap_blocks(self.kv_caches, self.cpu_kv_caches, out.swap_out)  # before reuse
        swap_blocks(self.cpu_kv_caches, self.kv_caches, out.swap_in)
        if out.blocks_to_copy and is_quantized(self.kv_caches[0][0]):  # with their scales
            copy_quantized_kv(self.kv_caches, self.kv_caches, out.blocks_to_copy)
        elif out.blocks_to_copy:  # copy-on-write inside the GPU pool: the chapter-08 kernel
            copy_blocks_kernel([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches],
                               out.blocks_to_copy, backend=self.backend)
        if out.is_empty():
            return torch.empty(0, self.model.config.vocab_size)
        # a sequence holds num_cached + num_new_tokens tokens after this step: all of its
        # text, except the prompt step of a shared recompute (its tail comes next step)
        ends = [s.seq.num_cached + s.num_new_tokens for s in out.scheduled]
        lens = ends if self.window is None else [  # only the kept tokens are in the cache
            self.window.cache_len(s.seq, e) for s, e in zip(out.scheduled, ends, strict=True)]
        meta = self.build_metadata([s.seq.block_table.blocks for s in out.scheduled], lens,
                                   [s.num_new_tokens for s in out.scheduled], self.block_size)
        check_metadata(meta, self.kv_caches[0][0].shape[0], self.block_size)
        meta = _to_device(meta, self.model.device)
        ids = [t for sched, end in zip(out.scheduled, ends, strict=True)
               for t in sched.seq.token_ids[end - sched.num_new_tokens:end]]
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.model.device)
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
