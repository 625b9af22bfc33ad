"""What exercise 09.3's check watches while the learner's ``attend_tiles`` runs.

A tiled online softmax and "keep every tile's scores, normalise once at the end" give the
same numbers; what differs is what the code holds. The caches are wrapped in
:class:`TileTensor`, which maps every read (indexing, ``index_select``, ``gather``,
``take``, any op on a view) to the positions it returns; every tensor computed from a read
carries ``_span`` (every position its value depends on) and ``_from`` (where the data it
carries element by element starts: not the running max or denominator). At each read
:class:`TileLog` flags the first of: a tensor bigger than one state per head still alive
from two tiles back; small tensors from several earlier tiles adding up to more than one
``(m, l, acc)``; a big tensor grown tile after tile; a read of one KV head's K or V going
back over positions already passed (a second pass; walking the tiles backward is one pass).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

_ONE_STATE = ("between tiles hold one running (m, l, acc) and nothing else: fold each tile "
              "into it as soon as it is read")
_READS = (torch.Tensor.__getitem__, torch.index_select, torch.Tensor.index_select,
          torch.gather, torch.Tensor.gather, torch.take, torch.Tensor.take)


class TileLog:
    """One call of the learner's function: its reads, what it holds, the first problem."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                 seq_len: int, tile: int, num_heads: int):
        nb, bs, _, d = k_cache.shape
        posmap = torch.full((nb, bs), -1, dtype=torch.int64)
        for j, b in enumerate(table.tolist()[:-(-seq_len // bs)] if seq_len else []):
            n = min(bs, seq_len - j * bs)
            posmap[b, :n] = torch.arange(j * bs, j * bs + n)
        nkv = k_cache.shape[2]
        # each element's position and KV head in one map: position * nkv + head
        posmap = torch.where(posmap >= 0, posmap * nkv, posmap)
        self.caches = {}  # storage pointer -> (kind, element-wise position map, its offset)
        for kind, cache in (("K", k_cache), ("V", v_cache)):
            full = (posmap[:, :, None, None] + torch.arange(nkv)[None, None, :, None]
                    * (posmap[:, :, None, None] >= 0)).expand(cache.shape).contiguous()
            self.caches[cache.untyped_storage().data_ptr()] = (kind, full,
                                                               cache.storage_offset())
        self.tile, self.small, self.block_size = tile, num_heads * d, bs
        self.num_heads, self.num_kv_heads = num_heads, nkv
        self.state = num_heads * (v_cache.shape[-1] + 2)
        self.reads: list[int] = []  # elements each read returned
        self.far: dict[tuple[str, int], int] = {}  # (kind, KV head) -> highest first position
        self.back: dict[tuple[str, int], int] = {}  # (kind, KV head) -> lowest last position
        self.ways: dict[tuple[str, int], set[str]] = {}  # the walks its reads still fit
        self.live: dict[int, weakref.ref] = {}
        self.problem: str | None = None
        self.hint: str | None = None
        self.past_end = False  # a read returned a slot past seq_len (or of the padding)
        #: the first op whose inputs were finite and whose output was not: (its name,
        #: "inf" or "nan", whether an input held a zero)
        self.made_nonfinite: tuple[str, str, bool] | None = None

    def flag(self, problem: str, hint: str) -> None:
        if self.problem is None:
            self.problem, self.hint = problem, hint

    def positions(self, t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """(kind, the position of every element of ``t``) if ``t`` is a cache or a view."""
        found = self.caches.get(t.untyped_storage().data_ptr())
        if found is None:
            return None
        kind, full, base = found
        return kind, full.as_strided(t.shape, t.stride(), t.storage_offset() - base)

    def read(self, kind: str | None, pos: torch.Tensor) -> tuple[int, int] | None:
        """Log one read returning the elements at positions ``pos``; its in-sequence span.
        ``kind`` None: an op on views of the cache (not an indexing read: no order check)."""
        self.reads.append(pos.numel())
        inside = pos[pos >= 0]
        self.past_end |= inside.numel() < pos.numel()
        if inside.numel() == 0:
            return None
        nkv = self.num_kv_heads
        lo, hi = int(inside.min()) // nkv, int(inside.max()) // nkv
        if kind is not None:
            for head in (inside % nkv).unique().tolist():
                mine = inside[inside % nkv == head] // nkv
                self._check_pass(kind, head, int(mine.min()), int(mine.max()))
        self._check_held(lo // self.tile)
        self._check_grown(lo)
        return lo, hi

    def _check_pass(self, kind: str, head: int, lo: int, hi: int) -> None:
        """One read of ``kind`` for KV ``head``, positions ``lo``-``hi``: a second pass
        goes back over positions already passed, whichever way the tiles are walked."""
        key = (kind, head)
        far, back = self.far.get(key, -1), self.back.get(key, 1 << 62)
        ways = self.ways.setdefault(key, {"forward", "backward"})
        if hi < far:
            ways.discard("forward")
        if lo > back:
            ways.discard("backward")
        if not ways:  # neither a forward nor a backward walk: a second pass
            self.flag(f"read {kind} (KV head {head}) of positions {lo}-{hi} again after your "
                      "reads of it had gone past them: a second pass over the sequence (the "
                      "max first, then the sum)",
                      "one pass over the tiles is enough: when a tile raises the running "
                      "max m, rescale what was summed so far by exp(m_old - m_new); and "
                      "the query heads that share a KV head are served by one read of it "
                      "(a loop over KV heads, not over query heads)")
        self.far[key], self.back[key] = max(far, lo), min(back, hi)

    def _check_held(self, now: int) -> None:
        """At a read of tile ``now``: what is still alive from tile ``now - 2`` or older?"""
        held: dict[int, int] = {}  # tile -> numbers still held that depend on it at most
        for key, ref in list(self.live.items()):
            t = ref()
            if t is None:
                del self.live[key]
                continue
            last = t._span[1] // self.tile
            if last > now - 2:
                continue
            held[last] = held.get(last, 0) + t.numel()
            if t.numel() > self.small:
                self.flag(f"while reading tile {now} you still hold a tensor of shape "
                          f"{tuple(t.shape)} computed from tile {last}: you keep earlier "
                          "tiles' scores or values",
                          "fold each tile into the running (m, l, acc) and let its scores "
                          "and values go: a kernel holds one tile at a time")
        if len(held) > 1 and sum(held.values()) > 1.5 * self.state:
            self.flag(f"while reading tile {now} you still hold {sum(held.values())} numbers "
                      f"computed from {len(held)} earlier tiles ({sorted(held)}): you keep "
                      "every tile's scores or state and combine them at the end, so what "
                      "you hold grows with the sequence", _ONE_STATE)

    def _check_grown(self, lo: int) -> None:
        """At a read from position ``lo`` on: a big tensor still alive that depends on
        positions from before the previous tile grew tile after tile (a concatenation).
        (A tile read as whole blocks depends on up to a block more on each side.)"""
        for ref in list(self.live.values()):
            t = ref()
            if t is not None and t.numel() > self.small \
                    and t._from[0] < lo - 2 * self.tile - self.block_size:
                self.flag(f"while reading from position {lo} on you still hold a tensor of "
                          f"shape {tuple(t.shape)} computed from positions {t._from[0]}-"
                          f"{t._from[1]}: scores or values concatenated tile after tile, so "
                          "what you hold grows with the sequence", _ONE_STATE)

    def track(self, t: torch.Tensor, span: tuple[int, int], data: tuple[int, int]) -> None:
        t._span, t._from = span, data
        self.live[id(t)] = weakref.ref(t)


_ACTIVE: list[TileLog] = []


class TileTensor(torch.Tensor):
    """A cache, or a tensor computed from it, that reports to the active :class:`TileLog`.

    ``_span``: the first and last sequence position its value depends on (None: none).
    """

    _span: tuple[int, int] | None = None
    _from: tuple[int, int] | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = super().__torch_function__(func, types, args, kwargs)
        if _ACTIVE:
            with torch._C.DisableTorchFunctionSubclass():
                _after(_ACTIVE[-1], func, args, kwargs, out)
        return out


def _tensors(x) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, list | tuple):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _after(log: TileLog, func, args, kwargs, out) -> None:
    outs = [t for t in _tensors(out) if isinstance(t, TileTensor)]
    if not outs:
        return
    ins = list(_tensors((args, kwargs)))
    views = [(t, p) for t in ins if (p := log.positions(t)) is not None]
    spans = [s for s in (getattr(t, "_span", None) for t in ins) if s is not None]
    # the data carried element by element: not a state of one number per head
    datas = [t._from for t in ins if getattr(t, "_from", None) is not None
             and t.numel() > log.num_heads]
    if views and any(log.positions(o) is not None for o in outs) and func not in _READS:
        return  # a view of the cache: nothing read yet
    if views and func in _READS and args and args[0] is views[0][0]:
        (t, (kind, pos)) = views[0]
        try:  # the same read on the position map: the positions it returned
            pos = func(pos, *args[1:], **{k: x for k, x in kwargs.items() if k != "out"})
        except (RuntimeError, IndexError, TypeError):
            pass  # (then every position of what it read from)
        reads = [log.read(kind, pos)]
    else:  # an op on views of the cache (a copy, a cat, an einsum) reads them whole
        reads = [log.read(None, pos) for _, (_, pos) in views]
    if log.made_nonfinite is None:
        _watch_finite(log, func, ins, outs)
    spans = [s for s in spans + reads if s is not None]
    datas = [s for s in datas + reads if s is not None] or spans
    span = (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else None
    if span is not None:
        data = (min(s[0] for s in datas), max(s[1] for s in datas))
        for o in outs:
            log.track(o, span, data)


def _watch_finite(log: TileLog, func, ins: list[torch.Tensor], outs: list) -> None:
    """Note the first op that made inf or NaN out of finite numbers (an overflowing
    exp, a 0 / 0): what the learner's arithmetic did, as opposed to NaN read from a slot
    past the sequence's end."""
    floats = [t for t in ins if t.is_floating_point()]
    made = [o for o in outs if o.is_floating_point() and not bool(o.isfinite().all())]
    name = getattr(func, "__name__", str(func))
    if made and any(w in name for w in ("exp", "div", "softmax")) \
            and all(bool(t.isfinite().all()) for t in floats):
        what = "inf" if any(bool(o.isinf().any()) for o in made) else "nan"
        zero = any(bool((t == 0).any()) for t in floats)
        log.made_nonfinite = (name, what, zero)


@contextlib.contextmanager
def watching(log: TileLog, k_cache: torch.Tensor, v_cache: torch.Tensor
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``with watching(log, k, v) as (k, v):`` the learner reads ``k`` and ``v``, watched."""
    _ACTIVE.append(log)
    try:
        yield k_cache.as_subclass(TileTensor), v_cache.as_subclass(TileTensor)
    finally:
        _ACTIVE.remove(log)
        log.live.clear()
