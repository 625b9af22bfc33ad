"""11.3 ``write_int8_blocks`` (re-exported by ``ch11``), in order: the generated
:class:`Int8` cases, each call compared with the library's write from the same state
(:func:`difference`: codes exact but one off at a tie, scales within 1e-6, unread slots
skipped), a difference named by :func:`reference_write`'s keywords; a block never written
first written past offset 0; random int8 workloads served with the learner's write.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from paged_lib.course import grading
from paged_lib.course.grading import generated
from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.generated.numeric import Contrast, fewer, shorter
from paged_lib.util import cdiv

__all__ = ["INT8_CONTRASTS", "Int8", "WriteCall", "check_write_int8_blocks", "compare",
           "int8_cases", "reference_write", "snap"]

_TINY = torch.finfo(torch.float32).tiny


def reference_write(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                    slots: torch.Tensor, *, doubling: bool = True, requantise: bool = True,
                    fresh_at_zero: bool = True, per_head: bool = True, joint: bool = True,
                    grow_at_equal: bool = False, rounding: str = "round",
                    floor_tiny: bool = True, growth: str = "least",
                    need_of: str = "block") -> None:
    """The block write, written out block by block; with a keyword changed, what one
    typical mistake does (the hints name them). Defaults: the library's rule.
    ``growth``: "least" (the smallest scale that holds the values and at least doubles),
    "pow2" (doubled until it holds them), "double" (exactly doubled, clipping what does
    not fit); ``need_of``: "block" (the tokens of the call in that block) or "call" (all
    of the call's tokens, whatever block they go to)."""
    bs = data.shape[1]
    blocks, offsets = slots // bs, slots % bs
    rnd = {"round": torch.round, "trunc": torch.trunc, "floor": torch.floor}[rounding]
    order = list(dict.fromkeys(blocks.tolist()))
    for b in order:
        here = (blocks == b).nonzero().flatten().tolist()
        groups = [here] if joint else [[i] for i in here]
        for part in groups:
            vals = x[part].float()
            need = (vals if need_of == "block" else x.float()).abs().amax(dim=(0, 2)) / 127
            if not per_head:
                need = need.amax().expand_as(need)
            old = scale[b].clone()
            if fresh_at_zero and bool((offsets[part] == 0).any()):
                old.zero_()
            old = torch.nan_to_num(old, nan=0.0)
            grows = need >= old if grow_at_equal else need > old
            new = torch.where(grows, _grown(need, old, growth) if doubling else need, old)
            if floor_tiny:
                new = new.clamp(min=_TINY)
            if requantise:
                ratio = torch.where(old > 0, old / new, torch.zeros_like(old))
                data[b] = rnd(data[b].float() * ratio[None, :, None]).clamp(
                    -127, 127).to(torch.int8)
            scale[b] = new
            data[b, offsets[part]] = rnd(vals / new[None, :, None]).clamp(
                -127, 127).to(torch.int8)


def _grown(need: torch.Tensor, old: torch.Tensor, growth: str) -> torch.Tensor:
    """The scale a growing (block, head) gets, per ``growth`` (:func:`reference_write`)."""
    if growth == "least":
        return torch.maximum(need, 2 * old)
    new = torch.where(old > 0, 2 * old, need)
    if growth == "pow2":
        while bool((new < need).any()):
            new = torch.where(new < need, 2 * new, new)
    return new


_SLIPS: list[tuple[dict, str]] = [
    (dict(doubling=False), "when the scale grows it at least doubles: new = max(need, 2 x "
     "old), so a value requantised many times has lost less than one final step"),
    (dict(growth="double"), "nothing clips: when the new values need more than twice the "
     "old scale, doubling is not enough; the scale grows to what they need, new = max(need, "
     "2 x old)"),
    (dict(need_of="call"), "each block's scale follows only the tokens written into that "
     "block: a call that writes into several blocks takes each block's own largest value"),
    (dict(requantise=False), "when the scale grows, the codes already in the block must be "
     "requantised to it (round(q x (old / new))), or they now mean values new / old times "
     "too large"),
    (dict(fresh_at_zero=False), "a token written at offset 0 starts the block afresh: the "
     "block was just allocated, and its scale belongs to an earlier owner"),
    (dict(per_head=False), "one scale per (block, KV head): each head grows on its own "
     "largest value"),
    (dict(joint=False), "the tokens of one call that land in one block are taken together: "
     "one growth from their joint largest value, not one per token"),
    (dict(growth="pow2"), "a growing scale goes no higher than the two rules ask: what the "
     "new values need, or twice the old scale if that is more, new = max(need, 2 x old), "
     "not the old scale doubled until it fits (that wastes precision)"),
    (dict(grow_at_equal=True), "a value exactly at 127 x scale fits: the scale grows only "
     "when need > old"),
    (dict(rounding="trunc"), "round to the nearest code (torch.round), do not truncate"),
    (dict(rounding="floor"), "round to the nearest code (torch.round), not down"),
    (dict(floor_tiny=False), "a scale never goes below torch.finfo(torch.float32).tiny: a "
     "first token of zeros must not leave a scale of 0 (0 / 0 is NaN)"),
]


# ------------------------------------------------------------------ comparing


@dataclass
class WriteCall:
    """One call of the write: where and what, the blocks it touches before and after."""

    where: str
    x: torch.Tensor
    slots: torch.Tensor
    shape: tuple[int, ...]          # data's shape
    blocks: list[int]               # the physical blocks it touches, in slot order
    data: torch.Tensor              # [len(blocks), bs, heads, dim] before
    scale: torch.Tensor             # [len(blocks), heads] before
    lib_data: torch.Tensor | None = None   # the library's answer: all blocks after
    lib_scale: torch.Tensor | None = None

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh cache of the call's shape: the touched blocks as before the call, the
        others filled with a pattern (code 77, scale 0.25) that must stay."""
        data = torch.full(self.shape, 77, dtype=torch.int8)
        scale = torch.full((self.shape[0], self.shape[2]), 0.25)
        idx = torch.tensor(self.blocks, dtype=torch.long)
        data[idx], scale[idx] = self.data, self.scale
        return data, scale


def snap(where: str, x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
         slots: torch.Tensor) -> WriteCall:
    """The call about to be made on (data, scale), with the library's answer."""
    from paged_lib.kernels.kv_quant import write_int8_blocks

    blocks = list(dict.fromkeys((slots // data.shape[1]).tolist()))
    idx = torch.tensor(blocks, dtype=torch.long)
    call = WriteCall(where, x.detach().float().cpu().clone(), slots.cpu().clone(),
                     tuple(data.shape), blocks, data[idx].cpu().clone(),
                     scale[idx].cpu().clone())
    call.lib_data, call.lib_scale = call.state()
    write_int8_blocks(call.x.clone(), call.lib_data, call.lib_scale, call.slots.clone())
    return call


def _run(fn: Callable, call: WriteCall, **slip: Any) -> tuple[torch.Tensor, torch.Tensor]:
    data, scale = call.state()
    fn(call.x.clone(), data, scale, call.slots.clone(), **slip)  # slip: reference_write's
    return data, scale


def difference(call: WriteCall, data: Any, scale: Any, ref: tuple) -> str | None:
    """Where the learner's (data, scale) after the call differ from ``ref``: a sentence,
    or None when they agree."""
    if not (isinstance(data, torch.Tensor) and isinstance(scale, torch.Tensor)):
        return "your function replaced the tensors instead of writing into them"
    rd, rs = ref
    if data.dtype != torch.int8 or tuple(data.shape) != tuple(rd.shape):
        return f"data became {data.dtype} {tuple(data.shape)}: write into it in place"
    bs = call.shape[1]
    idx = torch.tensor(call.blocks, dtype=torch.long)
    untouched = torch.ones(call.shape[0], dtype=torch.bool)
    untouched[idx] = False
    ys, ls = scale.nan_to_num(-1.0), rs.nan_to_num(-1.0)  # NaN: never written, on both
    if not (torch.equal(data[untouched], rd[untouched])
            and torch.equal(ys[untouched], ls[untouched])):
        b = int((untouched & ((data != rd).flatten(1).any(1) | (ys != ls).any(1)))
                .nonzero()[0])
        return f"block {b}, which the call does not write, changed"
    for i, b in enumerate(call.blocks):
        for h in range(call.shape[2]):
            want, got = float(rs[b, h]), float(scale[b, h])
            if not (got == got and abs(got - want) <= 1e-6 * abs(want)):
                return (f"block {b}, head {h}: {_before(call, i, h)}; the library's scale "
                        f"after it is {want:.6g}, yours {got:.6g}")
    offsets = call.slots % bs
    blocks = call.slots // bs
    for i, b in enumerate(call.blocks):
        live = int(offsets[blocks == b].max()) + 1  # slots past the last written: unread
        diff = (data[b, :live].int() - rd[b, :live].int()).abs()
        # a (block, head) never written (scale NaN) and first written past offset 0: the
        # codes below the first offset written are never read (the spec: any accepted)
        first = int(offsets[blocks == b].min())
        diff[:first, call.scale[i].isnan()] = 0
        if not bool((diff > 0).any()):
            continue
        quotient = _quotients(call, i, rs[b].double())[:live]
        tie = ((quotient.abs() % 1) - 0.5).abs() < 1e-3
        bad = (diff > 1) | ((diff == 1) & ~tie)
        if bool(bad.any()):
            o, h, d = (int(v) for v in bad.nonzero()[0])
            written = bool(((blocks == b) & (offsets == o)).any())
            what = "this call's token" if written else "a code already there"
            return (f"block {b}, head {h}: {_before(call, i, h)}; at offset {o} ({what}), "
                    f"dimension {d}, the library's code is {int(rd[b, o, h, d])}, yours "
                    f"{int(data[b, o, h, d])} (scale {float(rs[b, h]):.6g})")
    return None


def _quotients(call: WriteCall, i: int, new: torch.Tensor) -> torch.Tensor:
    """The exact value / new scale of every slot of touched block ``i`` (float64)."""
    b, bs = call.blocks[i], call.shape[1]
    old = call.scale[i].double().nan_to_num(0.0)
    q = call.data[i].double() * old[None, :, None] / new[None, :, None]
    for t in ((call.slots // bs) == b).nonzero().flatten().tolist():
        q[int(call.slots[t] % bs)] = call.x[t].double() / new[:, None]
    return q


def _before(call: WriteCall, i: int, h: int) -> str:
    b, bs = call.blocks[i], call.shape[1]
    mine = ((call.slots // bs) == b).nonzero().flatten()
    offs = sorted(int(call.slots[t] % bs) for t in mine)
    old = float(call.scale[i, h])
    held = ("never written (scale NaN)" if old != old else
            f"it starts afresh (offset 0 is written; its old scale {old:.6g} was an "
            f"earlier owner's)" if 0 in offs else f"its scale was {old:.6g}")
    amax = float(call.x[mine][:, h].abs().max())
    return (f"the call writes {len(offs)} token(s) at offset(s) {offs}, largest |value| "
            f"{amax:.6g} (/ 127 = {amax / 127:.6g}); {held}")


def compare(fn: Callable, call: WriteCall) -> None:
    """Fail with the first difference of ``fn``'s answer from the library's, and the hint
    of the typical mistake that gives the same answer."""
    got = _run(fn, call)
    why = difference(call, *got, (call.lib_data, call.lib_scale))
    if why is not None:
        grading.fail(f"{call.where}: {why}", next(
            (hint for slip, hint in _SLIPS
             if difference(call, *got, _run(reference_write, call, **slip)) is None),
            "compare this state with your rule for each (block, KV head) on its own: was "
            "the block just allocated, what do the new values need, does the scale grow and "
            "to what, what do the codes already there become, what do the new tokens become"))


# ------------------------------------------------------------------ generated cases

_REGIMES = ("same", "grow", "jump", "zeros", "subnormal", "limit", "shrink")


@dataclass(frozen=True)
class Int8:
    """One generated case of 11.3: ``calls[i]`` tokens of sequence 0 (and one of sequence
    1 when ``two``) per call, in regime ``regimes[i]``."""

    seed: int
    block_size: int
    heads: int
    dim: int
    start: int              # tokens sequence 0 holds before the first call
    calls: tuple[int, ...]
    regimes: tuple[str, ...]
    stale: bool             # blocks hold an earlier owner's codes and scale (else NaN)
    two: bool = False

    def build(self) -> list[WriteCall]:
        """The calls, each with the library's answer, in order (state carried)."""
        return list(_build(self))

    def describe(self) -> str:
        bs = self.block_size
        what = {"same": "values as large as before", "grow": "values half as large again",
                "jump": "values a hundred times larger", "zeros": "a token of zeros",
                "subnormal": "values of 1e-40 (below float32's tiny)",
                "limit": "a value exactly 127 x the scale", "shrink": "values 100 times "
                "smaller"}
        steps = "; ".join(f"{n} token(s) with {what[r]}"
                          for n, r in zip(self.calls, self.regimes, strict=True))
        return (f"blocks of {bs}" + (" (not a power of two)" if bs & (bs - 1) else "")
                + f", {self.heads} KV head(s) of {self.dim} number(s), sequence 0 "
                f"holding {self.start} token(s) (offset {self.start % bs} of its block) in "
                + ("blocks an earlier owner left (scale 9)" if self.stale else
                   "blocks never written (scale NaN)")
                + (", a second sequence decoding one token per call" if self.two else "")
                + f"; {len(self.calls)} call(s): {steps}")

    def states(self) -> list[str]:
        """The states of this case that the stage is drawn to reach."""
        out = [f"block size {self.block_size}"] if self.block_size in (3, 5, 6, 7) else []
        out += ["more than 2 KV heads"] if self.heads > 2 else []
        out += ["head size not 2"] if self.dim != 2 else []
        out += ["values below float32's tiny"] if "subnormal" in self.regimes else []
        out += ["a call into 3 or more blocks"] if any(
            n > 2 * self.block_size for n in self.calls) else []
        out += ["growth after a value at the limit"] if any(
            a == "limit" and b in ("grow", "jump") for a, b in zip(
                self.regimes, self.regimes[1:], strict=False)) else []
        return out

    def smaller(self) -> Iterator[Int8]:
        n = len(self.calls)
        for i in range(n):  # one call fewer
            if n > 1:
                yield dataclasses.replace(self, calls=self.calls[:i] + self.calls[i + 1:],
                                          regimes=self.regimes[:i] + self.regimes[i + 1:])
        for i, c in enumerate(self.calls):
            for less in shorter(c):
                yield dataclasses.replace(self, calls=self.calls[:i] + (less,)
                                          + self.calls[i + 1:])
        yield from fewer(self, two=[False], start=shorter(self.start, 0),
                          heads=shorter(self.heads), dim=shorter(self.dim), stale=[False])
        for i, r in enumerate(self.regimes):
            if r != "same":
                yield dataclasses.replace(self, regimes=self.regimes[:i] + ("same",)
                                          + self.regimes[i + 1:])
        yield from fewer(self, block_size=[b for b in (4, 2) if b < self.block_size])


@functools.lru_cache(maxsize=256)
def _build(p: Int8) -> tuple[WriteCall, ...]:
    from paged_lib.kernels.kv_quant import write_int8_blocks

    # the values from their own generator: the same whatever the block size (a contrast
    # changes only the layout)
    g, gx = torch.Generator().manual_seed(1100 + p.seed), torch.Generator().manual_seed(p.seed)
    bs = p.block_size
    lens = [p.start + sum(p.calls)] + ([len(p.calls)] if p.two else [])
    need = [cdiv(n, bs) for n in lens]
    num_blocks = sum(need) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [order[:need[0]], order[need[0]:sum(need)]]
    shape = (num_blocks, bs, p.heads, p.dim)
    if p.stale:
        data = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        scale = torch.full((num_blocks, p.heads), 9.0)
    else:
        data, scale = torch.zeros(shape, dtype=torch.int8), torch.full(
            (num_blocks, p.heads), float("nan"))
    pos = [0, 0]
    mag = 1.0

    def slots_of(s: int, n: int) -> list[int]:
        out = [tables[s][x // bs] * bs + x % bs for x in range(pos[s], pos[s] + n)]
        pos[s] += n
        return out

    if p.start:  # what sequence 0 already holds: one earlier call
        x = torch.randn(p.start, p.heads, p.dim, generator=gx)
        write_int8_blocks(x, data, scale, torch.tensor(slots_of(0, p.start)))
    calls = []
    for k, (n, regime) in enumerate(zip(p.calls, p.regimes, strict=True)):
        mag = {"grow": mag * 1.5, "jump": mag * 100, "shrink": mag / 100}.get(regime, mag)
        slots = slots_of(0, n) + (slots_of(1, 1) if p.two else [])
        x = torch.randn(len(slots), p.heads, p.dim, generator=gx) * mag
        if regime == "zeros":
            x[:n] = 0.0
        elif regime == "subnormal":
            x[:n] = torch.sign(x[:n]) * 1e-40
        elif regime == "limit":  # a value exactly at 127 x the scale of its block
            b = slots[0] // bs
            held = scale[b].nan_to_num(1.0).clamp(min=2.0 ** -20)
            x[0, :, 0] = 127 * held * torch.where(x[0, :, 0] < 0, -1.0, 1.0)
            x[:, :, 1:] = x[:, :, 1:].clamp(-0.5, 0.5) * held[None, :, None]
        s = torch.tensor(slots)
        calls.append(snap(f"call {k} of generated case {p.seed}", x, data, scale, s))
        write_int8_blocks(x.clone(), data, scale, s.clone())
    return tuple(calls)


def _draw(seed: int) -> Int8:
    g = torch.Generator().manual_seed(1130 + seed)

    def pick(xs: list | tuple):
        return xs[int(torch.randint(len(xs), (1,), generator=g))]

    bs = pick([3, 5, 6, 7, 1, 2, 4, 8, 12])
    calls = tuple(pick([1, 1, 2, bs, bs + 1, 2 * bs + 1, 3 * bs]) for _ in range(pick([1, 2,
                                                                                     3, 4])))
    regimes = tuple(_REGIMES[(seed + i) % len(_REGIMES)] for i in range(len(calls)))
    return Int8(seed, bs, pick([1, 2, 3, 4]), pick([1, 3, 4, 6]), pick([0, 0, 1, bs - 1, bs]),
                calls, regimes, bool(pick([0, 1])), bool(pick([0, 0, 1])))


def int8_cases(count: int = 48) -> list[Int8]:
    """11.3's generated cases (seeds 0, 1, ...)."""
    return [_draw(seed) for seed in range(count)]


INT8_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, block_size=4) if p.block_size & (
        p.block_size - 1) else None,
        "it passes with blocks of 4 and fails with blocks of a size that is not a power of "
        "two: a slot's block is slot // block_size and its offset slot % block_size (a shift "
        "and a mask, >> and &, give them only for powers of two)"),
)


_SERVE_HINT = ("every generated call agreed up to a code one off at an exact tie, which the "
               "engine's next layer sees: requantise with the ratio first, round(q * (old / "
               "new)), not round(q * old / new), as the spec's exact codes ask; else look "
               "for state kept outside data and scale")


def check_write_int8_blocks(fn: Callable[..., Any]) -> None:
    """11.3: ``write_int8_blocks(x, data, scale, slots)`` writes in place."""
    with grading.exercise("11.3"):
        numeric.check("11.3", int8_cases(), lambda p: [
            compare(fn, call) for call in p.build()], INT8_CONTRASTS)
        # a state the spec names and no engine makes: a block never written (scale NaN),
        # first written past offset 0 (the codes below it are never read)
        compare(fn, snap("a block never written (scale NaN), first written at offset 2",
                         torch.tensor([[[1.0, -2.0], [0.5, 0.25]]]),
                         torch.zeros(3, 4, 2, 2, dtype=torch.int8),
                         torch.full((3, 2), float("nan")), torch.tensor([6])))
        generated.check("write_int8_blocks", lambda x, data, scale, slots: fn(
            x.clone(), data, scale, slots.clone()), _SERVE_HINT)
