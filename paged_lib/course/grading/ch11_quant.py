"""11.3 ``write_int8_blocks`` (re-exported by ``ch11``): each call of the generated :class:`Int8`
cases against the library's write from the same state (:func:`difference`), a difference named
by :func:`reference_write`'s keywords; then random int8 workloads served with the learner's write.
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
from paged_lib.course.grading.generated.small_attention import rng
from paged_lib.util import cdiv

_TINY = torch.finfo(torch.float32).tiny


def reference_write(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                    slots: torch.Tensor, *, doubling: bool = True, requantise: bool = True,
                    fresh_at_zero: bool | str = True, per_head: bool = True, joint: bool = True,
                    grow_at_equal: bool = False, rounding: str = "round",
                    floor_tiny: bool = True, growth: str = "least",
                    need_of: str = "block") -> None:
    """The block write, block by block; a keyword changed: what one typical mistake does."""
    bs = data.shape[1]
    blocks, offsets = slots // bs, slots % bs
    rnd = {"round": torch.round, "trunc": torch.trunc, "floor": torch.floor}[rounding]
    for b in dict.fromkeys(blocks.tolist()):
        here = (blocks == b).nonzero().flatten().tolist()
        for part in [here] if joint else [[i] for i in here]:
            vals = x[part].float()
            need = (vals if need_of == "block" else x.float()).abs().amax(dim=(0, 2)) / 127
            need = need if per_head else need.amax().expand_as(need)
            old = scale[b].clone()
            if fresh_at_zero and bool((offsets[part if fresh_at_zero is True else ...] == 0).any()):
                old.zero_()
            old = torch.nan_to_num(old, nan=0.0)
            grows = need >= old if grow_at_equal else need > old
            new = torch.where(grows, _grown(need, old, growth) if doubling else need, old)
            new = new.clamp(min=_TINY) if floor_tiny else new
            if requantise:
                ratio = torch.where(old > 0, old / new, torch.zeros_like(old))
                data[b] = rnd(data[b].float() * ratio[None, :, None]).clamp(
                    -127, 127).to(torch.int8)
            scale[b] = new
            data[b, offsets[part]] = rnd(vals / new[None, :, None]).clamp(-127, 127).to(torch.int8)


def _grown(need: torch.Tensor, old: torch.Tensor, growth: str) -> torch.Tensor:
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
    (dict(growth="double"), "nothing clips: when the new values need more than twice the old "
     "scale, doubling is not enough; the scale grows to what they need, new = max(need, 2 x old)"),
    (dict(need_of="call"), "each block's scale follows only the tokens written into that "
     "block: a call that writes into several blocks takes each block's own largest value"),
    (dict(requantise=False), "when the scale grows, the codes already in the block must be "
     "requantised to it (round(q x (old / new))), or they now mean values new / old times "
     "too large"),
    (dict(fresh_at_zero=False), "a token written at offset 0 starts the block afresh: the "
     "block was just allocated, and its scale belongs to an earlier owner"),
    (dict(fresh_at_zero="call"), "a block starts afresh only when this call writes its own "
     "offset 0: decide it for each block on its own, not once for the whole call"),
    (dict(per_head=False), "one scale per (block, KV head): each head grows on its own "
     "largest value"),
    (dict(joint=False), "the tokens of one call that land in one block are taken together: "
     "one growth from their joint largest value, not one per token"),
    (dict(growth="pow2"), "a growing scale goes no higher than the two rules ask: what the "
     "new values need, or twice the old scale if that is more, new = max(need, 2 x old), "
     "not the old scale doubled until it fits (that wastes precision)"),
    (dict(grow_at_equal=True), "a value exactly at 127 x scale fits: the scale grows only "
     "when need > old, both in fp32 (in float64 the need lands off the fp32 scale)"),
    (dict(rounding="trunc"), "round to the nearest code (torch.round), do not truncate"),
    (dict(rounding="floor"), "round to the nearest code (torch.round), not down"),
    (dict(floor_tiny=False), "a scale never goes below torch.finfo(torch.float32).tiny: a "
     "first token of zeros must not leave a scale of 0 (0 / 0 is NaN)"),
]


# ------------------------------------------------------------------ comparing


@dataclass
class WriteCall:
    """One call: ``data`` and ``scale`` before it (the blocks it does not touch hold a pattern
    that must stay), the ``blocks`` it touches in slot order, the library's answer ``lib``."""

    where: str
    x: torch.Tensor
    slots: torch.Tensor
    data: torch.Tensor
    scale: torch.Tensor
    blocks: list[int]
    lib: tuple = ()


def snap(where: str, x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
         slots: torch.Tensor) -> WriteCall:
    from paged_lib.kernels.kv_quant import write_int8_blocks

    blocks = list(dict.fromkeys((slots // data.shape[1]).tolist()))
    before = torch.full(data.shape, 77, dtype=torch.int8), torch.full(scale.shape, 0.25)
    before[0][blocks], before[1][blocks] = data[blocks].cpu(), scale[blocks].cpu()
    call = WriteCall(where, x.detach().float().cpu().clone(), slots.cpu().clone(), *before, blocks)
    call.lib = _run(write_int8_blocks, call)
    return call


def _run(fn: Callable, call: WriteCall, **slip: Any) -> tuple[torch.Tensor, torch.Tensor]:
    data, scale = call.data.clone(), call.scale.clone()
    fn(call.x.clone(), data, scale, call.slots.clone(), **slip)  # slip: reference_write's
    return data, scale


def difference(call: WriteCall, data: torch.Tensor, scale: torch.Tensor, ref: tuple) -> str | None:
    """Where the learner's (data, scale) after the call differ from ``ref``, or None."""
    rd, rs = ref
    if data.dtype != torch.int8 or data.shape != rd.shape:
        return f"data became {data.dtype} {tuple(data.shape)}: write into it in place"
    ys, ls = scale.nan_to_num(-1.0), rs.nan_to_num(-1.0)  # NaN: never written, on both
    changed = (data != rd).flatten(1).any(1) | (ys != ls).any(1)
    changed[call.blocks] = False
    if bool(changed.any()):
        return f"block {int(changed.nonzero()[0])}, which the call does not write, changed"
    for b in call.blocks:
        for h in range(scale.shape[1]):
            want, got = float(rs[b, h]), float(scale[b, h])
            if not (got == got and abs(got - want) <= 1e-6 * abs(want)):
                return (f"block {b}, head {h}: {_before(call, b, h)}; the library's scale "
                        f"after it is {want:.6g}, yours {got:.6g}")
    blocks, offsets = call.slots // data.shape[1], call.slots % data.shape[1]
    for b in call.blocks:
        offs = offsets[blocks == b]
        live = int(offs.max()) + 1  # slots past the last written: unread
        diff = (data[b, :live].int() - rd[b, :live].int()).abs()
        diff[:int(offs.min()), call.scale[b].isnan()] = 0  # never written: unread below
        if not bool((diff > 0).any()):
            continue
        tie = ((_quotients(call, b, rs[b].double())[:live].abs() % 1) - 0.5).abs() < 1e-3
        bad = (diff > 1) | ((diff == 1) & ~tie)
        if bool(bad.any()):
            o, h, d = (int(v) for v in bad.nonzero()[0])
            what = "this call's token" if bool((offs == o).any()) else "a code already there"
            return (f"block {b}, head {h}: {_before(call, b, h)}; at offset {o} ({what}), "
                    f"dimension {d}, the library's code is {int(rd[b, o, h, d])}, yours "
                    f"{int(data[b, o, h, d])} (scale {float(rs[b, h]):.6g})")
    return None


def _quotients(call: WriteCall, b: int, new: torch.Tensor) -> torch.Tensor:
    """The exact value / new scale of every slot of block ``b``."""
    bs = call.data.shape[1]
    old = call.scale[b].double().nan_to_num(0.0)
    q = call.data[b].double() * old[None, :, None] / new[None, :, None]
    for t in ((call.slots // bs) == b).nonzero().flatten().tolist():
        q[int(call.slots[t] % bs)] = call.x[t].double() / new[:, None]
    return q


def _before(call: WriteCall, b: int, h: int) -> str:
    mine = ((call.slots // call.data.shape[1]) == b).nonzero().flatten()
    offs = sorted(int(call.slots[t] % call.data.shape[1]) for t in mine)
    old = float(call.scale[b, h])
    held = ("never written (scale NaN)" if old != old else
            f"it starts afresh (offset 0 is written; its old scale {old:.6g} was an "
            f"earlier owner's)" if 0 in offs else f"its scale was {old:.6g}")
    amax = float(call.x[mine][:, h].abs().max())
    return (f"the call writes {len(offs)} token(s) at offset(s) {offs}, largest |value| "
            f"{amax:.6g} (/ 127 = {amax / 127:.6g}); {held}")


def compare(fn: Callable, call: WriteCall) -> None:
    """Fail at the first difference from the library's answer, named by the slip that gives it."""
    got = _run(fn, call)
    why = difference(call, *got, call.lib)
    if why is not None:
        grading.fail(f"{call.where}: {why}", next(
            (hint for slip, hint in _SLIPS
             if difference(call, *got, _run(reference_write, call, **slip)) is None),
            "compare this state with your rule for each (block, KV head) on its own: was "
            "the block just allocated, what do the new values need, does the scale grow and "
            "to what, what do the codes already there become, what do the new tokens become"))


# ------------------------------------------------------------------ generated cases

_REGIMES = {"same": "values as large as before", "grow": "values half as large again",
            "jump": "values a hundred times larger", "zeros": "a token of zeros",
            "subnormal": "values of 1e-40 (below float32's tiny)",
            "limit": "a value exactly 127 x the scale", "shrink": "values 100 times smaller"}


@dataclass(frozen=True)
class Int8:
    """11.3: ``calls[i]`` tokens of sequence 0 (and one of sequence 1 when ``two``) per call."""

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
        return list(_build(self))

    def describe(self) -> str:
        bs = self.block_size
        steps = "; ".join(f"{n} token(s) with {_REGIMES[r]}"
                          for n, r in zip(self.calls, self.regimes, strict=True))
        return (f"blocks of {bs}" + (" (not a power of two)" if bs & (bs - 1) else "")
                + f", {self.heads} KV head(s) of {self.dim} number(s), sequence 0 "
                f"holding {self.start} token(s) (offset {self.start % bs} of its block) in "
                + ("blocks an earlier owner left (scale 9)" if self.stale else
                   "blocks never written (scale NaN)")
                + (", a second sequence decoding one token per call" if self.two else "")
                + f"; {len(self.calls)} call(s): {steps}")

    def states(self) -> list[str]:
        r = self.regimes
        return numeric.reached(
            (f"block size {self.block_size}", self.block_size in (3, 5, 6, 7)),
            ("more than 2 KV heads", self.heads > 2), ("head size not 2", self.dim != 2),
            ("values below float32's tiny", "subnormal" in r),
            ("a call into 3 or more blocks", any(n > 2 * self.block_size for n in self.calls)),
            ("growth after a value at the limit", any(
                a == "limit" and b in ("grow", "jump") for a, b in zip(r, r[1:], strict=False))))

    def smaller(self) -> Iterator[Int8]:
        c, r, n = self.calls, self.regimes, len(self.calls)
        for i in range(n if n > 1 else 0):  # one call fewer
            yield dataclasses.replace(self, calls=c[:i] + c[i + 1:], regimes=r[:i] + r[i + 1:])
        for i in range(n):
            for less in shorter(c[i]):
                yield dataclasses.replace(self, calls=c[:i] + (less,) + c[i + 1:])
        yield from fewer(self, two=[False], start=shorter(self.start, 0),
                          heads=shorter(self.heads), dim=shorter(self.dim), stale=[False])
        for i in (i for i in range(n) if r[i] != "same"):
            yield dataclasses.replace(self, regimes=r[:i] + ("same",) + r[i + 1:])
        yield from fewer(self, block_size=[b for b in (4, 2) if b < self.block_size])


@functools.lru_cache(maxsize=256)
def _build(p: Int8) -> tuple[WriteCall, ...]:
    from paged_lib.kernels.kv_quant import write_int8_blocks

    # the values from their own generator: a contrast changes only the layout
    g, gx = torch.Generator().manual_seed(1100 + p.seed), torch.Generator().manual_seed(p.seed)
    bs = p.block_size
    lens = [p.start + sum(p.calls)] + ([len(p.calls)] if p.two else [])
    need = [cdiv(n, bs) for n in lens]
    num_blocks = sum(need) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [order[:need[0]], order[need[0]:sum(need)]]
    shape = (num_blocks, bs, p.heads, p.dim)
    data = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8) if p.stale else \
        torch.zeros(shape, dtype=torch.int8)
    scale = torch.full((num_blocks, p.heads), 9.0 if p.stale else float("nan"))
    pos, mag = [0, 0], 1.0

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
    pick = rng(1130 + seed)
    bs = pick([3, 5, 6, 7, 1, 2, 4, 8, 12])
    n = pick([1, 2, 3, 4])
    calls = tuple(pick([1, 1, 2, bs, bs + 1, 2 * bs + 1, 3 * bs]) for _ in range(n))
    regimes = tuple(list(_REGIMES)[(seed + i) % len(_REGIMES)] for i in range(len(calls)))
    return Int8(seed, bs, pick([1, 2, 3, 4]), pick([1, 3, 4, 6]), pick([0, 0, 1, bs - 1, bs]),
                calls, regimes, bool(pick([0, 1])), bool(pick([0, 0, 1])))


def int8_cases(count: int = 48) -> list[Int8]:
    return [_draw(seed) for seed in range(count)]


INT8_CONTRASTS = (Contrast(
    lambda p: dataclasses.replace(p, block_size=4) if p.block_size & (p.block_size - 1) else None,
    "it passes with blocks of 4 and fails with blocks of a size that is not a power of two: a "
    "slot's block is slot // block_size and its offset slot % block_size (a shift and a mask, "
    ">> and &, give them only for powers of two)"),)


def check_write_int8_blocks(fn: Callable[..., Any]) -> None:
    """11.3: ``write_int8_blocks(x, data, scale, slots)`` writes in place."""
    with grading.exercise("11.3"):
        numeric.check("11.3", int8_cases(), lambda p: [
            compare(fn, call) for call in p.build()], INT8_CONTRASTS)
        # a state the spec names and no engine makes
        compare(fn, snap("a block never written (scale NaN), first written at offset 2",
                         torch.tensor([[[1.0, -2.0], [0.5, 0.25]]]),
                         torch.zeros(3, 4, 2, 2, dtype=torch.int8),
                         torch.full((3, 2), float("nan")), torch.tensor([6])))
        # a value exactly between two codes, which a comparison with ties let by and no
        # served value reaches: 125.5 x 1.1015625 times the reciprocal lands below the tie
        tie = snap("a block never written given 127 and 125.5 times 1.1015625 at offsets 0 "
                   "and 1 in one call (its scale 1.1015625)",
                   torch.tensor([[[139.8984375]], [[138.24609375]]]), torch.zeros(
                       2, 4, 1, 1, dtype=torch.int8), torch.full((2, 1), float("nan")),
                   torch.tensor([4, 5]))
        compare(fn, tie)
        grading.expect_equal(int(_run(fn, tie)[0][1, 1, 0, 0]), 126, f"{tie.where}: its code",
                             "a value becomes torch.round(v / scale): v * (1 / scale) rounds "
                             "1 / scale first and misses an exact tie (125.5 -> 126, the even)")
        generated.check("write_int8_blocks", lambda x, data, scale, slots: fn(
            x.clone(), data, scale, slots.clone()), "every generated call agreed up to a "
            "code one off at an exact tie, which the engine's next layer sees: ties round half "
            "to even (torch.round, not floor(v + 0.5)); requantise by the ratio first, round(q "
            "* (old / new)), not round(q * old / new); else look for state kept outside data")
