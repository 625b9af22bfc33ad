"""11.4 ``drop_oldest(table, num_sink_tokens)`` (re-exported by ``ch11``): named edge
states, then the generated stage (random windowed workloads served with the learner's
function in the engine). A wrong answer on an edge is named by recomputing the typical
mistakes (:func:`reference_drop`'s keywords) on the same state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paged_lib.blocks import BlockAllocator, BlockTable
from paged_lib.course import grading
from paged_lib.course.grading import generated
from paged_lib.engine.window import WindowOp

__all__ = ["check_drop_oldest", "reference_drop"]


def reference_drop(table: BlockTable, num_sink_tokens: int, *, gone: str = "floor",
                   copy: str = "partial", rotate: str = "new", shift: int = 1,
                   free: bool = True, check_shared: str = "after", check_short: bool = True,
                   free_first: bool = False) -> tuple[BlockTable, WindowOp]:
    """The release written out; with a keyword changed, what one typical mistake does
    (the hints name them). Defaults: the library's rule. ``gone="last_sink"``: the block
    holding the last sink goes, every sink in it copied on; ``check_shared="rewritten"``:
    only the blocks after the released one are checked; ``free_first``: the block is
    freed before the shared check, which then raises on a changed pool."""
    bs, sinks, pool = table.block_size, num_sink_tokens, table.allocator
    if check_short and table.num_tokens < sinks + bs:
        raise ValueError("too short")
    blocks = table.blocks
    g = {"floor": sinks // bs, "ceil": -(-sinks // bs), "first": 0,
         "last_sink": max(0, (sinks - 1) // bs)}[gone]
    if free and free_first:
        pool.free(blocks[g])
    looked = {"after": blocks[g:], "all": blocks, "none": [],
              "rewritten": blocks[g + 1:]}[check_shared]
    if any(pool.refcount(b) > 1 for b in looked):
        raise ValueError("shared")
    kept = blocks[:g] + blocks[g + 1:]
    new = BlockTable(pool, bs, kept, table.num_tokens - bs)
    if free and not free_first:
        pool.free(blocks[g])
    source = kept if rotate == "new" else blocks
    first = {"new": sinks, "old": sinks, "all": 0, "copied": g * bs}[rotate]
    slots = tuple(source[x // bs] * bs + x % bs for x in range(first, new.num_tokens))
    r = sinks - g * bs if gone == "last_sink" else sinks % bs
    if copy == "partial" and r or copy == "always":
        return new, WindowOp(slots, shift * bs, blocks[g], blocks[g + 1], r or bs)
    return new, WindowOp(slots, shift * bs)


_SLIPS: list[tuple[dict, str]] = [
    (dict(check_shared="all"), "only the blocks from the released one on are rewritten: a "
     "shared sink block before it is fine"),
    (dict(gone="first"), "the sinks are never released: the block that goes is the one "
     "at logical index num_sink_tokens // block_size, the first after the whole sink blocks"),
    (dict(gone="ceil"), "the block at logical index num_sink_tokens // block_size goes (its "
     "first num_sink_tokens % block_size slots are sinks, copied on before it goes), not "
     "the first block after every sink"),
    (dict(gone="last_sink"), "whole sink blocks stay where they are: the block that goes "
     "is the one holding the oldest recent token (logical position num_sink_tokens), so "
     "only the sinks that share a block with leaving tokens are copied, none when the "
     "sinks fill whole blocks"),
    (dict(copy="never"), "when num_sink_tokens % block_size = r > 0, the released block "
     "holds r sinks: copy them to the first r slots of the next block (copy_src, copy_dst, "
     "copy_len)"),
    (dict(copy="always"), "with whole sink blocks (num_sink_tokens % block_size == 0) "
     "nothing is copied: copy_src = copy_dst = -1, copy_len = 0"),
    (dict(rotate="old"), "rotate_slots are the slots of the kept tokens in the NEW table: "
     "each recent token moved one logical block back"),
    (dict(rotate="copied"), "the sinks copied on into the next block keep their positions "
     "too (they are sinks, only moved): rotate from position num_sink_tokens on"),
    (dict(rotate="all"), "the sinks keep their positions: rotate only the tokens after them"),
    (dict(shift=-1), "shift is block_size: the model runner rotates the keys by -shift "
     "positions"),
    (dict(free=False), "the released block goes back to the allocator (allocator.free: "
     "one reference dropped): without it every window step leaks a block"),
    (dict(check_shared="rewritten"), "the released block counts too: another sequence that "
     "holds it shares this table's tokens (a forked table, which no window serves): "
     "ValueError, as for the blocks after it"),
    (dict(free_first=True), "a ValueError changes nothing: look at every block the drop "
     "would touch before freeing one (the pool after your ValueError is not the pool "
     "before it)"),
    (dict(check_shared="none"), "a block after the sinks that another sequence holds "
     "(reference count > 1) is a ValueError: dropping rewrites it for every holder"),
    (dict(check_short=False), "a table of fewer than num_sink_tokens + block_size tokens "
     "has no block of recent tokens to drop: ValueError"),
]


# ------------------------------------------------------------------ states and answers


@dataclass
class DropCall:
    where: str
    blocks: list[int]
    num_tokens: int
    block_size: int
    sinks: int
    refs: list[int]          # the pool's reference counts before
    free: list[int]          # its free list before, in order

    def table(self) -> BlockTable:
        pool = BlockAllocator(len(self.refs))
        pool.ref_counts = list(self.refs)
        pool.free_block_ids = deque(self.free)
        return BlockTable(pool, self.block_size, self.blocks, self.num_tokens)

    def story(self) -> str:
        shared = {b: self.refs[b] for b in self.blocks if self.refs[b] > 1}
        return (f"{self.where}: a table of {self.num_tokens} tokens on blocks {self.blocks} "
                f"(block size {self.block_size}), {self.sinks} sink token(s)"
                + (f", blocks shared (reference counts): {shared}" if shared else "")
                + f", free list {self.free}")


def _answer(fn: Callable, call: DropCall, **slip: Any) -> tuple:
    """What a function does on the call's state, comparably: ('ValueError', pool) or
    (new blocks, new num_tokens, op fields, pool: reference counts, free list)."""
    table = call.table()
    pool = table.allocator
    try:
        out = fn(table, call.sinks, **slip)  # slips are reference_drop's keywords
    except ValueError:
        return ("ValueError", list(pool.ref_counts), list(pool.free_block_ids))
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], WindowOp)
            and hasattr(out[0], "blocks") and hasattr(out[0], "num_tokens")):
        return ("not (table, WindowOp)", repr(out)[:120])
    new, op = out
    return (list(new.blocks), new.num_tokens, _canonical(op), list(pool.ref_counts),
            list(pool.free_block_ids))


def _canonical(op: WindowOp) -> tuple:
    """The op's fields as the model runner reads them: a shift with no key to rotate
    does nothing (``WindowOp((), 0)`` is ``WindowOp((), 4)``), nor does a copy of no slot
    say anything with its source and destination; both are told as the defaults."""
    rot = tuple(op.rotate_slots)
    copied = op.copy_len != 0
    return (rot, op.shift if rot else 0, op.copy_src if copied else -1,
            op.copy_dst if copied else -1, op.copy_len)


def _show(ans: tuple) -> str:
    if ans[0] == "ValueError":
        return "a ValueError"
    if ans[0] == "not (table, WindowOp)":
        return f"{ans[1]} (not a (table, WindowOp) pair)"
    blocks, n, (rot, shift, src, dst, length), refs, free = ans
    copy = f"copy {length} slot(s) of block {src} into block {dst}" if length else "no copy"
    return (f"table {blocks} of {n} tokens; rotate the keys at slots {list(rot)}, shift "
            f"{shift}; {copy}; free list after {free}")


def _compare(fn: Callable, call: DropCall) -> None:
    want = _answer(reference_drop, call)
    got = _answer(fn, call)
    if got == want:
        return
    if got[0] != "ValueError" and want[0] != "ValueError" and len(got) == 5 and \
            got[:3] == want[:3]:  # only the pool differs: say how
        detail = (f"; the pool after: the library's reference counts "
                  f"{[want[3][b] for b in call.blocks]} on {call.blocks}, free list "
                  f"{want[4]}; yours {[got[3][b] for b in call.blocks]}, {got[4]}")
    else:
        detail = ""
    hint = next((h for slip, h in _SLIPS if _slip_answer(call, slip) == got),
                None) or _which_part(got, want, call)
    grading.fail(f"{call.story()}; the library answers {_show(want)}, yours {_show(got)}{detail}",
                 hint)


def _slip_answer(call: DropCall, slip: dict) -> tuple | None:
    """What one typical mistake answers on this state; None where that mistake would
    crash (a slip that skips a check may index past the table: not the learner's error)."""
    try:
        return _answer(reference_drop, call, **slip)
    except Exception:  # noqa: BLE001 - any crash of a planted slip means "not this one"
        return None


def _which_part(got: tuple, want: tuple, call: DropCall) -> str:
    """When no known slip explains the answer: name the first part that differs."""
    if got[0] == "ValueError" and want[0] != "ValueError":
        if call.num_tokens == call.sinks + call.block_size:
            return ("a table of exactly num_sink_tokens + block_size tokens is long enough: "
                    "its one block of recent tokens goes, and no key is left to rotate")
        return ("the library drops a block here: the table holds at least num_sink_tokens "
                "+ block_size tokens, and no block from the released one on is shared")
    if got[0] == "ValueError" and want[0] == "ValueError":
        return ("a ValueError changes nothing: the pool after it must be the pool before it")
    if got[0] == "ValueError" or want[0] == "ValueError" or len(got) != 5:
        return ("compare this table with the spec's situations: which block goes, which "
                "sinks must move and where, which keys change position, the pool after")
    names = ["the new table's blocks", "its number of tokens", "the WindowOp"]
    for name, g, w in zip(names, got[:3], want[:3], strict=True):
        if g != w:
            if name == "the WindowOp":
                fields = ["rotate_slots", "shift", "copy_src", "copy_dst", "copy_len"]
                name = "the WindowOp's " + ", ".join(
                    f for f, a, b in zip(fields, g, w, strict=True) if a != b)
            return (f"{name} differ(s) from the library's: compare them above with what "
                    "the model runner does with each field")
    return "the pool after the call differs: compare the reference counts and the free list"


def _edge(where: str, blocks: list[int], num_tokens: int, bs: int, sinks: int,
          num_blocks: int = 12, shared: dict[int, int] | None = None) -> DropCall:
    refs = [0] * num_blocks
    for b in blocks:
        refs[b] = 1
    for b, n in (shared or {}).items():
        refs[b] = n
    free = [b for b in (5, 0, 11, 2, 9, 4, 10, 1, 8, 3, 6, 7) if b < num_blocks and refs[b] == 0]
    return DropCall(where, blocks, num_tokens, bs, sinks, refs, free)


def _edges() -> list[DropCall]:
    return [
        _edge("the spec's example", [7, 3, 5], 11, 4, 2),
        _edge("no sinks", [4, 1, 6], 12, 4, 0),
        _edge("sinks filling one block", [2, 5, 8], 10, 4, 4),
        _edge("sinks filling two blocks", [0, 1, 2, 3], 14, 4, 8),
        _edge("more sinks than a block (6 sinks, blocks of 4)", [9, 4, 7, 1], 15, 4, 6),
        _edge("exactly sinks + one block of tokens", [3, 8], 6, 4, 2),
        _edge("exactly sinks + one block, whole sink block", [1, 2], 8, 4, 4),
        _edge("a block size of 1 and 3 sinks", [5, 6, 7, 8, 9], 5, 1, 3),
        _edge("blocks of 2 and 3 sinks", [4, 9, 2, 6], 8, 2, 3),
        _edge("a sink block shared with another sequence (never rewritten)", [6, 2, 9], 10,
              4, 4, shared={6: 2}),
        _edge("a block after the sinks shared with another sequence", [6, 2, 9], 10, 4, 2,
              shared={2: 2}),
        _edge("the block to release shared with another sequence (4 sinks, blocks of 4)",
              [6, 2, 9], 10, 4, 4, shared={2: 2}),
        _edge("a table too short to drop a block (5 tokens, 2 sinks, blocks of 4)", [4, 7],
              5, 4, 2),
    ]


def check_drop_oldest(fn: Callable[..., Any]) -> None:
    """11.4: ``drop_oldest(table, num_sink_tokens) -> (BlockTable, WindowOp)``."""
    with grading.exercise("11.4"):
        for call in _edges():
            _compare(fn, call)
        generated.check("drop_oldest", fn, "the block at logical index num_sink_tokens // "
                        "block_size goes, its num_sink_tokens % block_size sinks copied to "
                        "the next block, and every recent token's key rotated by -block_size, "
                        "whatever the block size and however many sinks")
