"""A paged cache that watches how it is read: the grader of exercise 04.2.

Blockwise attention and "gather everything, then one softmax" give the same numbers, so
comparing outputs cannot tell them apart. What differs is *how the cache is read* and
*what is kept*: a kernel reads each block once, folds it into a running ``(m, l, acc)``
and forgets it. :class:`BlockCache` hands out one physical block per read
(``cache[b]``) and logs every read; each block it returns is a :class:`_FromBlock`
tensor that remembers which read it came from, and so does everything computed from it.
The grader then checks, while the learner's code runs:

* every read is a single block (an index tensor would gather many blocks at once);
* only the sequence's own blocks are read, each once, K before V, block after block;
* no tensor computed from a block is still alive two reads later, unless it is as small
  as the running state (``[num_heads, head_dim]``): keeping scores or values around is
  collecting the whole row, which is what the online softmax avoids;
* and all such small tensors together stay within about one running state: a list of
  every block's ``(m, l, acc)``, merged at the end, grows with the sequence;
* no tensor built from the reads has a dimension longer than one block's worth
  (``block_size``, ``head_dim`` or ``num_heads``): that is a concatenation of blocks.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch


@dataclass
class Read:
    """One read: which cache ("K" or "V"), which physical block, its place in the order."""

    kind: str
    block: int | tuple[int, ...]  # a tuple: many blocks in one read (a gather)
    number: int  # 0 for the first K read (and for the first V read), 1 for the next, ...


@dataclass
class ReadLog:
    """Everything the learner's code did with the caches, and the first broken rule."""

    reads: list[Read] = field(default_factory=list)
    problem: str | None = None
    hint: str | None = None
    live: list[tuple[weakref.ref, int, int]] = field(default_factory=list)
    max_dim: int = 0
    max_small: int = 0
    state_size: int = 0  # numbers in one running (m, l, acc): num_heads x (head_dim + 2)

    def flag(self, problem: str, hint: str) -> None:
        if self.problem is None:
            self.problem, self.hint = problem, hint


_ACTIVE: list[ReadLog] = []  # the log that tagged tensors report to (one at a time)


class _FromBlock(torch.Tensor):
    """A tensor that carries ``_newest``: the latest read number its value depends on."""

    _newest: int = -1

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        newest = max((getattr(a, "_newest", -1) for a in _tensors(args, kwargs)), default=-1)
        out = super().__torch_function__(func, types, args, kwargs)
        for t in _tensors(out, {}):
            if isinstance(t, _FromBlock):
                t._newest = max(newest, getattr(t, "_newest", -1))
                _track(t)
        return out


def _tensors(args, kwargs) -> list:
    found, todo = [], [args, kwargs]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, list | tuple):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
    return found


def _track(t: _FromBlock) -> None:
    if not _ACTIVE or t._newest < 0:
        return
    log = _ACTIVE[-1]
    longest = max(t.shape, default=1)
    if longest > log.max_dim:
        log.flag(f"a tensor of shape {tuple(t.shape)} built from the cache has a dimension "
                 f"of {longest}, longer than one block ({log.max_dim} at most): you "
                 "concatenated several blocks' keys, values or scores",
                 "the online softmax never holds more than one block: fold each block into "
                 "(m, l, acc) and move on")
    log.live.append((weakref.ref(t), t._newest, t.numel()))


class BlockCache:
    """A read-only paged cache ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    ``cache[b]`` (``b`` an int) returns physical block ``b`` as a tensor
    ``[block_size, num_kv_heads, head_dim]``; ``cache[b, ...]`` indexes into it.
    ``shape``, ``dtype`` and ``len`` work as for a tensor; nothing else does.
    """

    def __init__(self, data: torch.Tensor, kind: str, log: ReadLog):
        self._data, self._kind, self._log = data, kind, log

    @property
    def shape(self) -> torch.Size:
        return self._data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._data.dtype

    def __len__(self) -> int:
        return self._data.shape[0]

    def __iter__(self):
        raise TypeError(f"{self._kind}_cache cannot be iterated: read one block at a time, "
                        f"{self._kind.lower()}_cache[b]")

    def __getattr__(self, name: str):
        raise AttributeError(f"{self._kind}_cache only supports reads of one block, "
                             f"{self._kind.lower()}_cache[b], plus .shape and .dtype "
                             f"(not .{name})")

    def __getitem__(self, index):
        first, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        block = _block_id(first)
        log = self._log
        if block is None:
            log.flag(f"{self._kind}_cache was indexed with {_describe(first)}: that gathers "
                     "many blocks in one read (gather, then one softmax over all scores)",
                     "a kernel reads one block at a time: index the cache with a single "
                     "physical block id, cache[block_table[j]], and fold that block into "
                     "the running state before reading the next")
            ids = (list(range(len(self))[first]) if isinstance(first, slice)
                   else torch.as_tensor(first).reshape(-1).tolist())
            log.reads.append(Read(self._kind, tuple(dict.fromkeys(int(b) for b in ids)), -1))
            out = self._data[index].clone().as_subclass(_FromBlock)
            out._newest = 10**9
            return out
        number = sum(r.kind == self._kind for r in log.reads)
        log.reads.append(Read(self._kind, block, number))
        if block < 0 or block >= self._data.shape[0]:
            log.flag(f"read {self._kind} of block {block}, which does not exist"
                     + (" (-1 is the block table's padding)" if block == -1 else ""),
                     "visit only the first cdiv(seq_len, block_size) entries of the "
                     "block table; the rest is padding")
            raise IndexError(f"physical block {block} does not exist (the cache has "
                             f"{self._data.shape[0]} blocks)")
        _check_stale(log, number)
        out = self._data[block].clone().as_subclass(_FromBlock)
        out._newest = number
        return out[rest] if rest else out


def _block_id(index) -> int | None:
    if isinstance(index, bool):
        return None
    if isinstance(index, int):
        return index
    if isinstance(index, torch.Tensor) and index.numel() == 1 and not index.is_floating_point():
        return int(index)
    if hasattr(index, "__index__") and not isinstance(index, torch.Tensor | slice):
        return int(index)
    return None


def _describe(index) -> str:
    if isinstance(index, torch.Tensor):
        return f"a tensor of {index.numel()} block ids"
    if isinstance(index, slice):
        return "a slice"
    return f"{type(index).__name__}"


def _check_stale(log: ReadLog, number: int) -> None:
    """At read ``number``: is something from read ``number - 2`` or older still alive?"""
    still = []
    held: dict[int, int] = {}  # block read number -> numbers still held from it
    for ref, newest, numel in log.live:
        t = ref()
        if t is None:
            continue
        still.append((ref, newest, numel))
        if newest <= number - 2:
            held[newest] = held.get(newest, 0) + numel
        if newest <= number - 2 and numel > log.max_small:
            log.flag(f"while reading block {number} you still hold a tensor of shape "
                     f"{tuple(t.shape)} computed from block {newest}: you keep every "
                     "block's scores or values (a two-pass softmax over the whole row)",
                     "keep only m, l and acc between blocks: rescale them by exp(m_old - "
                     "m_new) and add the new block, then let the block go")
    if log.state_size and len(held) > 1 and sum(held.values()) > 1.5 * log.state_size:
        log.flag(f"while reading block {number} you still hold {sum(held.values())} numbers "
                 f"computed from {len(held)} earlier blocks ({sorted(held)}): you keep "
                 "every block's state and merge at the end, so what you hold grows with "
                 "the sequence",
                 "fold each block into one running (m, l, acc) as soon as it is read: "
                 "between blocks hold one state, whatever the sequence's length")
    log.live = still


def watch(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int
          ) -> tuple[BlockCache, BlockCache, ReadLog]:
    """Wrap two caches for one call of the learner's function; use inside :func:`active`."""
    log = ReadLog()
    _, block_size, _, head_dim = k_cache.shape
    log.max_dim = max(block_size, head_dim, num_heads)
    log.max_small = num_heads * max(head_dim, v_cache.shape[-1])
    log.state_size = num_heads * (v_cache.shape[-1] + 2)
    return BlockCache(k_cache, "K", log), BlockCache(v_cache, "V", log), log


class active:
    """``with active(log):`` tagged tensors report to ``log`` (and stop afterwards)."""

    def __init__(self, log: ReadLog):
        self.log = log

    def __enter__(self) -> ReadLog:
        _ACTIVE.append(self.log)
        return self.log

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self.log)
        self.log.live = []


def check_order(log: ReadLog, table: list[int]) -> None:
    """Flag reads that are not 'K then V of each of the sequence's blocks, once, in turn'.

    ``table`` is the sequence's blocks (only the ones its tokens occupy).
    """
    k_reads = [r.block for r in log.reads if r.kind == "K"]
    v_reads = [r.block for r in log.reads if r.kind == "V"]
    for kind, got in (("K", k_reads), ("V", v_reads)):
        for b in got:
            if b not in table:
                what = "padding (-1)" if b < 0 else f"block {b}"
                log.flag(f"read {kind} of {what}, which holds none of this sequence's "
                         f"tokens (its blocks are {table})",
                         "visit only the first cdiv(seq_len, block_size) entries of the "
                         "block table; the rest is padding")
                return
        if len(got) > len(table):
            log.flag(f"read {kind} {len(got)} times for a sequence of {len(table)} "
                     f"block(s): some block was read twice (a two-pass softmax, or a loop "
                     "over query heads around the loop over blocks)",
                     "read each block once, for every query head at once, and fold it into "
                     "the running (m, l, acc): one pass is enough, the running max m is "
                     "corrected as it grows by rescaling l and acc with exp(m_old - m_new)")
            return
        if got != table[:len(got)] or len(got) < len(table):
            log.flag(f"read {kind} of blocks {got}, expected each of {table} once, in order",
                     "visit logical blocks j = 0, 1, ... and read physical block "
                     "block_table[j]")
            return
    kinds = "".join(r.kind for r in log.reads)
    if kinds != "KV" * len(table):
        log.flag(f"read order {' '.join(kinds)}: every K block came before the V blocks "
                 "(all scores first, then one softmax)" if kinds.startswith("KK") else
                 f"read order {' '.join(kinds)}, expected K then V of each block in turn",
                 "read K of block j, score it, read V of block j, fold both into (m, l, acc), "
                 "then go on to block j + 1")
