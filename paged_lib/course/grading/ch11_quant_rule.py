"""The rule of chapter 11's exercise 11.3 written out (:func:`reference_write`, with the
typical mistakes as keywords) and the comparison of one call's answer with the library's,
told as a story (used by :mod:`paged_lib.course.grading.ch11_quant`).

Codes are compared exactly, except that a code one away from the library's is accepted
where the exact quotient is within 1e-3 of a half (a tie: computing ``q * old / new``
instead of ``q * (old / new)`` may round it the other way); scales within 1e-6 relative;
slots past the last token written in a block are never read, so they are not compared,
nor, in a block never written before (scale NaN), the slots below the first one written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from paged_lib.course import grading

__all__ = ["WriteCall", "compare", "difference", "reference_write", "snap"]

_TINY = torch.finfo(torch.float32).tiny


def reference_write(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                    slots: torch.Tensor, *, doubling: bool = True, requantise: bool = True,
                    fresh_at_zero: bool = True, per_head: bool = True, joint: bool = True,
                    grow_at_equal: bool = False, rounding: str = "round",
                    floor_tiny: bool = True, forget_rest: bool = True, growth: str = "least",
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
                if not forget_rest:
                    ratio = torch.where(old > 0, ratio, torch.ones_like(old))
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
    lib_data: torch.Tensor | None = None
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
    blocks = list(dict.fromkeys((slots // data.shape[1]).tolist()))
    idx = torch.tensor(blocks, dtype=torch.long)
    return WriteCall(where, x.detach().float().cpu().clone(), slots.cpu().clone(),
                     tuple(data.shape), blocks, data[idx].cpu().clone(),
                     scale[idx].cpu().clone())


def _run(fn: Callable, call: WriteCall, **slip: Any) -> tuple[torch.Tensor, torch.Tensor]:
    data, scale = call.state()
    if fn is reference_write:
        reference_write(call.x.clone(), data, scale, call.slots.clone(), **slip)
    else:
        fn(call.x.clone(), data, scale, call.slots.clone())
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


def compare(fn: Callable, call: WriteCall, story: str) -> None:
    """Fail with the first difference of ``fn``'s answer from the library's, and the hint
    of the typical mistake that gives the same answer."""
    ref = (call.lib_data, call.lib_scale) if call.lib_data is not None else \
        _run(reference_write, call)
    got = _run(fn, call)
    why = difference(call, *got, ref)
    if why is not None:
        grading.fail(f"{story}: {why}", next(
            (hint for slip, hint in _SLIPS
             if difference(call, *got, _run(reference_write, call, **slip)) is None),
            "compare this state with your rule for each (block, KV head) on its own: was "
            "the block just allocated, what do the new values need, does the scale grow and "
            "to what, what do the codes already there become, what do the new tokens become"))
